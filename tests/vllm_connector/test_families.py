"""VllmLayers on each family the plugin registers (tiny random-weight Llama, Qwen2 with its qkv bias,
Mistral), against vLLM's own prefill of the same ids: every row, and scattered rows over vLLM's exact
K/V attending by original position. Each family in its own process (one vLLM engine per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("family_probe.py")


@pytest.mark.parametrize("kind, arch", [("qwen2", "BlendQwen2ForCausalLM"), ("mistral", "BlendMistralForCausalLM")])
def test_vllm_layers_equal_vllms_prefill(tmp_path, kind, arch):
    proc = subprocess.run([sys.executable, str(PROBE), kind, str(tmp_path / kind)], capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"kind"')]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1])
    print(got)
    assert got["model"] == arch and got["layers"] == 4
    assert max(got["full"]) < 1e-5 and max(got["rows"]) < 1e-5
    assert got["digest_equal"]  # the checkpoint digest is the transformers model's
