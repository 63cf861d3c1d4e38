"""No transformers model in any vLLM process, under vLLM's default multi-process engine: ragkv's
plugin (entry point) makes vLLM build the blend-aware model in the engine core, the connector blends
on it, and that process holds no second set of weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("process_probe.py")
WEIGHTS_MB = 538  # SmolLM2-135M in fp32: what a second copy of the weights would add


def run_probe(mode: str, store: Path) -> dict:
    proc = subprocess.run([sys.executable, str(PROBE), mode, str(store)], capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"mode"')]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


def test_the_blend_runs_on_vllms_model_in_the_engine_process_with_no_second_copy(tmp_path):
    plain = run_probe("plain", tmp_path / "unused")
    ragkv = run_probe("ragkv", tmp_path / "store")
    miss, hit = ragkv["connector"]
    assert not miss["offered"] and miss["misses"] == 3  # vLLM prefilled, the chunks were written back
    assert hit["offered"] and hit["blend"]["hits"] == 3 and hit["blend"]["recomputed_tokens"] > 0
    core = ragkv["engine_core"]
    assert core["pid"] != ragkv["front_end"]["pid"]  # the default engine: model and connector in their own process
    assert core["model"] == "ragkv.integrations.vllm.models.BlendLlamaForCausalLM" and core["adapter"] == "VllmLayers"
    for side in ("engine_core", "front_end"):
        assert ragkv[side]["transformers_models"] == [], side
    extra = core["rss_mb"] - plain["engine_core"]["rss_mb"]
    print(f"engine core RSS: {core['rss_mb']:.0f} MB with ragkv's connector, {plain['engine_core']['rss_mb']:.0f} MB "
          f"without (+{extra:.0f} MB; the weights are {WEIGHTS_MB} MB)")
    assert extra < WEIGHTS_MB / 2
    assert ragkv["text"] == plain["text"]
