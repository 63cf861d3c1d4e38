"""Selectors in the chat layout that `ragkv serve` and the vLLM connector serve, on the transformers engine.

    python benchmarks/blend/chat_selectors.py --split dev --prompts 24 --rotations 0,1 > benchmarks/blend/results/chat-selectors-dev-fp32.txt

Each prompt of the 4-genre blend set is asked as a chat with a system prompt of its own (the vLLM
benchmark's SYSTEM, 149 tokens) and its chunks as documents (``PromptTemplate.chat``), in each
rotation of its chunks. The chunks are stored under the default precompute policy, behind the
template's own prefix: so the first chunk's lead entry was not prefilled behind this system prompt,
unlike in ragkv's own layout (benchmarks/blend/bench_blend.py), where it is exact.
Per sample: HF full prefill's greedy answer (--new-tokens), then per method the blend's teacher-forced
fidelity against it (ragkv.evaluate.teacher_forced_agreement) and its TTFT. Methods: r0 (naive
reuse), dev15/dev30 (deviation @ 0.15/0.3), query15, starts15, r1 (full recompute); a ``sys``
prefix (sysdev15) reads a second store precomputed behind this very system prompt
(``PromptTemplate.for_tokenizer(system=...)``). The prompts are bench_vllm.load_prompts' pick.
Prints one line per sample and, last, each method's mean fidelity [95% bootstrap CI] and its paired
difference to the first blended method. On the connector the same prompts give the same per-prompt
fidelity (benchmarks/vllm/RESULTS.md), so this runs where vLLM is not needed and is fast.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
from bench_vllm import SYSTEM, load_prompts, rotated

from ragkv.blend import BlendEngine
from ragkv.evaluate import bootstrap_ci, teacher_forced_agreement
from ragkv.gguf import convert_smollm2
from ragkv.models import load
from ragkv.prompt import PromptTemplate
from ragkv.store import open_store

METHODS = {"r0": ("deviation", 0.0), "dev15": ("deviation", 0.15), "dev30": ("deviation", 0.3),
           "r1": ("deviation", 1.0), "query15": ("query", 0.15), "starts15": ("starts", 0.15)}


def summary(results: dict[str, list[float]], times: dict[str, list[float]]) -> list[str]:
    names = list(results)
    base = next((n for n in names if n != "r0"), names[0])
    lines = []
    for name in names:
        f = results[name]
        lo, hi = bootstrap_ci(f)
        d = [a - b for a, b in zip(f, results[base])]
        dlo, dhi = bootstrap_ci(d)
        lines.append(f"{name:10s} n={len(f)} fidelity {statistics.fmean(f):.4f} [{lo:.3f}, {hi:.3f}] "
                     f"TTFT median {statistics.median(times[name]):.2f}s | vs {base} {statistics.fmean(d):+.4f} "
                     f"[{dlo:+.3f}, {dhi:+.3f}] worse/better {sum(x < 0 for x in d)}/{sum(x > 0 for x in d)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="dev", choices=["dev", "test"])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--rotations", default="0,1")
    ap.add_argument("--methods", default="r0,dev15,query15,starts15",
                    help=f"comma-separated, each one of {', '.join(METHODS)}, optionally prefixed with sys")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--store", default="/tmp/ragkv-chat-selectors", help="folder of the two disk stores")
    args = ap.parse_args()
    methods = args.methods.split(",")
    for m in methods:
        if m.removeprefix("sys") not in METHODS:
            ap.error(f"unknown method {m!r}; valid: {', '.join(METHODS)} (optionally prefixed with sys)")
    torch.set_num_threads(2)
    model, tok = load(str(convert_smollm2()), dtype=args.dtype)
    plain = BlendEngine(model, tok, open_store(f"disk://{args.store}/template-{args.dtype}"))
    engines = {False: plain}
    if any(m.startswith("sys") for m in methods):
        engines[True] = BlendEngine(model, tok, open_store(f"disk://{args.store}/system-{args.dtype}"),
                                    template=PromptTemplate.for_tokenizer(tok, system=SYSTEM))
    a = plain.adapter
    results, times = {m: [] for m in methods}, {m: [] for m in methods}
    for i, p in enumerate(load_prompts(args.prompts, args.split)):
        for engine in engines.values():
            engine.ensure(p["contexts"])
        for rot in map(int, args.rotations.split(",")):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p["question"]}]
            prompt = plain.template.chat(messages, rotated(p["contexts"], rot))
            ids = torch.tensor([prompt.input_ids])
            with torch.inference_mode():
                t0 = time.perf_counter()
                _, cache = a.forward(ids, logits_to_keep=1)
                t_full = time.perf_counter() - t0
                cache.crop(-1)
                target = a.generate(ids, cache, tok, max_new_tokens=args.new_tokens, do_sample=False)[:args.new_tokens]
            line = [f"p{i} rot{rot} T={prompt.num_tokens} chunks={len(prompt.chunk_ids)} "
                    f"first={len(prompt.chunk_ids[0])} full={t_full:.2f}s"]
            for m in methods:
                selector, ratio = METHODS[m.removeprefix("sys")]
                engine = engines[m.startswith("sys")].with_config(selector=selector)
                t0 = time.perf_counter()
                res = engine.prefill_prompt(prompt, ratio=ratio)
                t = time.perf_counter() - t0
                f = teacher_forced_agreement(a, res, target)
                results[m].append(f)
                times[m].append(t)
                line.append(f"{m}={f:.3f}/{t:.2f}s/rc{res.stats.recomputed_tokens}/lead{int(res.stats.lead)}")
            print(" ".join(line), flush=True)
    print("\n".join(summary(results, times)))


if __name__ == "__main__":
    main()
