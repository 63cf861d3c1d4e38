"""Run by test_processes.py in a fresh interpreter: vLLM's default multi-process engine (the engine
core, which holds the scheduler, the worker and the model, in its own process), with ragkv's
connector (``ragkv``) or without (``plain``). Prints one JSON line: what each process holds.

    python tests/vllm_connector/process_probe.py ragkv|plain STORE_DIR
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in another process
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc ships `probe` (a function) to it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def probe(worker=None) -> dict:
    """What this process holds (``collective_rpc`` passes the worker): its RSS, every live
    transformers model (PreTrainedModel) and the connector's worker side."""
    import gc

    from transformers import PreTrainedModel

    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    hf = sorted(type(o).__name__ for o in gc.get_objects() if isinstance(o, PreTrainedModel))
    out = {"pid": os.getpid(), "rss_mb": round(rss, 1), "transformers_models": hf}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return out
    if has_kv_transfer_group():
        eng = get_kv_transfer_group().engine
        out["model"] = f"{type(eng.model).__module__}.{type(eng.model).__name__}"
        out["adapter"] = type(eng.adapter).__name__
    return out


def main() -> None:
    mode, store = sys.argv[1], sys.argv[2]
    from vllm import LLM, SamplingParams
    from vllm_data import DOCS

    from ragkv.gguf import convert_smollm2
    from ragkv.integrations.vllm import CPU_MEMORY_UTILIZATION, kv_transfer_config
    from ragkv.models import load_tokenizer
    from ragkv.prompt import PromptTemplate

    kw = {"kv_transfer_config": kv_transfer_config(f"disk://{store}", 0.15)} if mode == "ragkv" else {}
    llm = LLM(model=str(convert_smollm2()), dtype="float32", enforce_eager=True,  # vLLM's defaults otherwise
              max_model_len=2048, block_size=32, seed=0, gpu_memory_utilization=CPU_MEMORY_UTILIZATION, **kw)
    ids = PromptTemplate.for_tokenizer(load_tokenizer()).build("Who built the lighthouse at Kerran Point?",
                                                              DOCS[:3]).input_ids
    infos = []
    for _ in range(2):  # ragkv: a miss (vLLM prefills, the chunks are written back), then a blend
        llm.reset_prefix_cache()  # (vLLM's prefix cache would serve the second request whole)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
        infos.append((out.kv_transfer_params or {}).get("ragkv"))
    print(json.dumps({"mode": mode, "text": out.outputs[0].text, "connector": infos,
                      "engine_core": llm.collective_rpc(probe)[0], "front_end": probe()}))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
