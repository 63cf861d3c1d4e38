"""README.md's vLLM snippet as written: its precompute line, vLLM's server with the README's two
arguments, then the README's `ragkv serve` client request sent to it (port 8001): chunks hit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from readme_snippets import Runner, blocks, commands, port_of


def test_the_readme_vllm_server_answers_the_readme_request_from_stored_chunks(tmp_path):
    snippets = blocks()
    [vllm_block] = [commands(code) for lang, code in snippets if lang == "bash" and "vllm.entrypoints" in code]
    # the block's own precompute line: in the dtype of vLLM's --dtype (the README's first one is in
    # ragkv's "auto" dtype, bf16 on a CPU with native bf16, whose keys vLLM in float32 never reads)
    precompute = next(line for line in vllm_block if line.startswith("ragkv precompute"))
    server = next(line for line in vllm_block if "vllm.entrypoints" in line)
    assert "--model-dtype float32" in precompute and "--dtype float32" in server
    client = next(code for lang, code in snippets if lang == "python" and "OpenAI(" in code)
    run = Runner(tmp_path / "store", env={"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    try:
        run.shell(precompute)
        run.shell(server, ready_port=port_of(server))
        probe = client.replace("127.0.0.1:8000", f"127.0.0.1:{port_of(server)}") + (
            "\nimport json\nprint(json.dumps((r.model_extra.get('kv_transfer_params') or {}).get('ragkv')))\n")
        out = run.python(probe).strip().splitlines()
    finally:
        run.stop()
    info = json.loads(out[-1])
    assert info["recognised"] and info["offered"] and info["hits"] == 2, info
