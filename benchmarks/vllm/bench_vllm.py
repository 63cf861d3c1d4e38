"""TTFT of vLLM with RagKVConnector vs vLLM's own full prefill, per ratio, with fidelity.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm/bench_vllm.py --prompts 4 --ratios 0,0.15,1

Prompts: the test split of the 4-genre blend set (benchmarks/blend/data), chunks precomputed into a
disk store first (ragkv.integrations.vllm.precompute: the transformers engine in a child process,
as `ragkv precompute` would; keys from the checkpoint, so the store serves vLLM). vLLM: SmolLM2-135M-Instruct
in --dtype (float32: this CPU has no native bf16), one process, prefix caching off, eager; the blend
runs on vLLM's own model (ragkv.integrations.vllm.layers). Per prompt the settings are interleaved:
--repeats rounds of warm requests with max_tokens=1, the settings interleaved within each round (TTFT =
wall time of llm.generate, request in -> first token out, and the process's CPU time over the same
call: what the request cost when other work takes the cores; the best of each is kept), then greedy answers of --new-tokens tokens for fidelity against vLLM's
own full prefill: first-token agreement, identical leading tokens, and whether the gold answer is in
the text. Writes results/vllm.md and results/vllm.json (+ vllm.png with matplotlib).
On a machine shared with other work, OMP_NUM_THREADS=1 keeps OpenMP's spinning barriers from
stalling every op of both vLLM and the blend when a core is taken (seen here: 10x slower copies).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from ragkv.integrations.vllm import CPU_MEMORY_UTILIZATION, kv_transfer_config

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
DATA = Path(__file__).resolve().parents[1] / "blend" / "data"
OUT = Path(__file__).resolve().parent / "results"


def load_prompts(n: int) -> list[dict]:
    chunks = {c["id"]: c["text"] for c in map(json.loads, (DATA / "chunks.jsonl").open())}
    rows = [p for p in map(json.loads, (DATA / "prompts.jsonl").open()) if p["split"] == "test"]
    picked = rows[:: max(1, len(rows) // n)][:n]
    return [{**p, "contexts": [chunks[c] for c in p["chunks"]]} for p in picked]


def prepare(n: int, store: str, dtype: str) -> tuple[str, list[dict]]:
    """The converted SmolLM2 directory and ``n`` test prompts with their token ids ("ids"), every
    chunk precomputed into ``store`` first (in a child process: no transformers model here)."""
    from ragkv.gguf import convert_smollm2
    from ragkv.integrations.vllm.precompute import precompute

    model_dir = str(convert_smollm2())
    prompts = load_prompts(n)
    ids = precompute(model_dir, dtype, store, [(p["question"], p["contexts"]) for p in prompts])
    for p, i in zip(prompts, ids):
        p["ids"] = i
    return model_dir, prompts


def run(llm, ids, max_tokens, extra):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, extra_args={"kv_transfer_params": extra})
    c0, t0 = time.process_time(), time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return (wall, cpu), list(out.outputs[0].token_ids), out.outputs[0].text, \
        (out.kv_transfer_params or {}).get("ragkv") or {}


def lead(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--ratios", default="0,0.15,1")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--store", default="disk:///tmp/ragkv-bench-vllm")
    ap.add_argument("--memory-utilization", type=float, default=CPU_MEMORY_UTILIZATION,
                    help="vLLM's gpu_memory_utilization: on CPU the share of a NUMA node's RAM it reserves "
                         "(vLLM's own 0.92 default fails when the node is partly used)")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]

    import torch
    from vllm import LLM

    model_dir, prompts = prepare(args.prompts, args.store, args.dtype)
    load0 = os.getloadavg()[0]
    llm = LLM(model=model_dir, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False,
              max_model_len=8192, block_size=32, seed=0, gpu_memory_utilization=args.memory_utilization,
              kv_transfer_config=kv_transfer_config(args.store))
    settings = [("vLLM full prefill", {"ragkv_skip": True})] + [(f"ragkv r={r:g}", {"ragkv_ratio": r}) for r in ratios]
    run(llm, prompts[0]["ids"], 1, {"ragkv_skip": True})  # warm-up
    rows = {name: {"ttft": [], "cpu": [], "first": [], "lead": [], "answer": [], "offered": 0} for name, _ in settings}
    for p in prompts:
        ref, times = None, {name: [] for name, _ in settings}
        for _ in range(args.repeats):  # settings interleaved, so a burst of other work hits them alike
            for name, extra in settings:
                times[name].append(run(llm, p["ids"], 1, extra)[0])
        for name, extra in settings:
            _, toks, text, info = run(llm, p["ids"], args.new_tokens, extra)
            ref = toks if ref is None else ref
            r = rows[name]
            r["ttft"].append(min(w for w, _ in times[name]))
            r["cpu"].append(min(c for _, c in times[name]))
            r["first"].append(toks[:1] == ref[:1])
            r["lead"].append(lead(toks, ref))
            r["answer"].append(p["answer"].lower() in text.lower())
            r["offered"] += bool(info.get("offered"))
        print(p["id"], len(p["ids"]), "tokens", {n: (round(rows[n]["ttft"][-1], 3), round(rows[n]["cpu"][-1], 3)) for n, _ in settings}, flush=True)
    n_tok = statistics.mean(len(p["ids"]) for p in prompts)
    lines = [f"prompts: {len(prompts)} (test split, mean {n_tok:.0f} tokens), SmolLM2-135M {args.dtype}, vLLM "
             f"{__import__('vllm').__version__}, block 32, prefix caching off, {torch.get_num_threads()} threads "
             f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), best of {args.repeats}, "
             f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f} (other work on the machine)", "",
             "| setting | TTFT median (s) | speed-up | CPU s median | speed-up (CPU) | offered | first token = full | "
             f"identical leading tokens (of {args.new_tokens}) | gold answer in text |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = statistics.median(rows[settings[0][0]]["ttft"])
    base_cpu = statistics.median(rows[settings[0][0]]["cpu"])
    for name, _ in settings:
        r = rows[name]
        med, cpu = statistics.median(r["ttft"]), statistics.median(r["cpu"])
        lines.append(f"| {name} | {med:.3f} | {base / med:.2f}x | {cpu:.3f} | {base_cpu / cpu:.2f}x | {r['offered']}/{len(prompts)} | "
                     f"{sum(r['first'])}/{len(prompts)} | {statistics.mean(r['lead']):.1f} | "
                     f"{sum(r['answer'])}/{len(prompts)} |")
    OUT.mkdir(exist_ok=True)
    (OUT / "vllm.md").write_text("\n".join(lines) + "\n")
    (OUT / "vllm.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [n for n, _ in settings]
        ax.bar(names, [statistics.median(rows[n]["ttft"]) for n in names])
        ax.set_ylabel("median TTFT (s)")
        ax.set_title("vLLM TTFT: RagKVConnector vs full prefill")
        fig.tight_layout()
        fig.savefig(OUT / "vllm.png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
