"""Fidelity and TTFT of token-selection strategies against HF full prefill in the same dtype, on the
benchmark set of 4 genres (corpus.py; sources and build in data/README.md).

    python benchmarks/blend/bench_blend.py --split test --per-genre 5 --dtype float32 \\
        --methods deviation,starts,query --ratios 0,0.05,0.1,0.15 --out benchmarks/blend/results/test-fp32.json

writes the JSON and, at the end, its tables and Pareto plot beside it (report.py; ``report.py *.json``
redraws them).

First the chunks of the selected prompts are precomputed into a disk store (``ragkv precompute`` of
the split's whole corpus with ``keys=`` those chunks: neighbours under ``--context`` still come from
every document, so the entries equal the whole-corpus job's; not timed). Per prompt: HF full prefill
(sdpa, the model's own forward building its cache) timed ``--repeats`` times (median) and its greedy answer (32 tokens) as the
reference; per method and ratio: the blended request timed ``--repeats`` times (median, pipelined
loading from the disk store, page cache warm), its teacher-forced fidelity (top-1 agreement with full
prefill's answer), KL of the first token, and whether its free-running greedy answer equals full
prefill's (and for how many tokens). Results are written after every prompt (a killed run keeps what
it measured; ``--resume`` continues it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import corpus
import oracle
import report as report_mod

from ragkv import models
from ragkv.blend import SELECTORS, BlendConfig, BlendEngine
from ragkv.blend.select import make_selector
from ragkv.evaluate import agreeing_prefix, kl_divergence, teacher_forced_agreement
from ragkv.policy import PrecomputePolicy
from ragkv.precompute import precompute
from ragkv.store import open_store

N_TOKENS = 32


def parse_methods(text: str):
    """'deviation,query,oracle-kv' -> [(name, selector or oracle kind)]; a name may carry settings:
    'query(rows=8,smooth=1)'."""
    out = []
    for item in _split_top(text):
        name, _, args = item.partition("(")
        if name.startswith("oracle-"):
            out.append((item, name.removeprefix("oracle-")))
            continue
        if name not in SELECTORS:
            raise SystemExit(f"unknown method {name!r}; valid: {', '.join(SELECTORS)}, oracle-kv, oracle-mix, oracle-grad")
        kwargs = eval(f"dict({args[:-1]})") if args else {}  # benchmark flags, trusted input
        out.append((item, make_selector(SELECTORS[name](**kwargs))))
    return out


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur.strip()] if p]


def timed(fn, repeats: int):
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        runs.append((time.perf_counter() - t0, out))
    return statistics.median(t for t, _ in runs), runs[-1][1]


@torch.inference_mode()
def run_prompt(engine: BlendEngine, p: dict, methods, ratios, repeats: int) -> dict:
    a, tok = engine.adapter, engine.tokenizer
    _, computed = engine.ensure(p["contexts"])
    if computed:  # every chunk of a prompt is a chunk of the corpus: precompute stored it
        print(f"warning: {p['id']}: {computed} chunk(s) were not in the store and were computed now", flush=True)
    prompt = engine.build_prompt(p["question"], p["contexts"])
    ids = torch.tensor([prompt.input_ids], device=a.device)
    full_ttft, (logits, cache) = timed(lambda: a.forward(ids, logits_to_keep=1), repeats)
    full_logits = logits[0, -1].float()
    cache.crop(-1)
    target = a.generate(ids, cache, tok, max_new_tokens=N_TOKENS, do_sample=False)
    row = {"id": p["id"], "genre": p["genre"], "tokens": prompt.num_tokens, "chunk_tokens": sum(map(len, prompt.chunk_ids)),
           "full_ttft": full_ttft, "target_tokens": int(target.numel()), "methods": {}}
    kinds = {m for _, m in methods if isinstance(m, str)}
    orders = oracle.orders(engine, prompt, target, kinds) if kinds else {}
    for name, method in methods:
        sel = oracle.FixedSelector(orders[method]) if isinstance(method, str) else method
        eng = engine.with_config(selector=sel)
        for r in ratios:
            ttft, res = timed(lambda e=eng, r=r: e.prefill_prompt(prompt, ratio=r), repeats)
            answer = a.generate(res.input_ids, res.cache, tok, max_new_tokens=N_TOKENS, do_sample=False)
            a.truncate(res.cache, prompt.num_tokens - 1)
            agree = agreeing_prefix(answer, target)
            s = res.stats
            row["methods"][f"{name}@{r:g}"] = {
                "ttft": ttft, "fidelity": teacher_forced_agreement(a, res, target),
                "kl": kl_divergence(full_logits, res.logits), "same_answer": agree == target.numel(),
                "agree_tokens": agree, "recomputed": s.recomputed_tokens,
                "split": {k: getattr(s, f"t_{k}") for k in ("lookup", "load", "load_io", "fuse", "select", "compute")},
            }
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="test", choices=["dev", "test", "all"])
    ap.add_argument("--dtype", default="auto", help="model dtype: auto | bfloat16 | float32")
    ap.add_argument("--methods", default="deviation,query")
    ap.add_argument("--ratios", default="0.05,0.1,0.15,0.3")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--per-genre", type=int, default=None, help="first N prompts of each genre only")
    ap.add_argument("--store", default=None, help="store URI (default: a disk store beside --out)")
    ap.add_argument("--context", type=int, default=PrecomputePolicy.context,
                    help="precompute policy's neighbour chunks (default: the policy's); the split's documents are "
                         "precomputed first, so neighbours come from the corpus as in `ragkv precompute`")
    ap.add_argument("--lead", action=argparse.BooleanOptionalAction, default=PrecomputePolicy.lead,
                    help="precompute policy's lead entries: the prompt's first chunk read from its entry prefilled "
                         "right behind the template prefix")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    methods, ratios = parse_methods(args.methods), [float(r) for r in args.ratios.split(",")]
    model, tok = models.load("smollm2-135m", dtype=args.dtype)
    dtype = str(model.dtype).removeprefix("torch.")
    store = open_store(args.store or f"disk://{out.parent.resolve()}/store-{dtype}?max_bytes=20G")
    engine = BlendEngine(model, tok, store, BlendConfig(), policy=PrecomputePolicy(context=args.context, lead=args.lead))
    prompts = corpus.load(args.split)
    if args.per_genre:
        prompts = [p for p in prompts if sum(q["genre"] == p["genre"] for q in prompts[: prompts.index(p)]) < args.per_genre]
    prompts = prompts[: args.limit]
    t0 = time.time()
    needed = {engine.keys.chunk_key(ids) for p in prompts for ids in engine.build_prompt(p["question"], p["contexts"]).chunk_ids}
    done = precompute(engine.prefiller, texts=corpus.documents(args.split), keys=needed)  # neighbours: the whole corpus
    print(f"precomputed the chunks of {len(prompts)} prompts ({args.split} corpus's neighbours) under "
          f"{engine.keys.policy_id}: {done.new} new, {done.skipped} stored ({time.time() - t0:.0f} s)", flush=True)
    report = {"meta": {"command": "python " + " ".join(sys.argv), "model": "SmolLM2-135M-Instruct", "dtype": dtype,
                       "threads": torch.get_num_threads(), "split": args.split, "per_genre": args.per_genre, "repeats": args.repeats,
                       "policy": engine.keys.policy_id, "lead": engine.keys.lead,
                       "methods": [m for m, _ in methods], "ratios": ratios, "n_tokens": N_TOKENS,
                       "started": time.strftime("%Y-%m-%d %H:%M")}, "prompts": []}
    if args.resume and out.exists():
        report["prompts"] = json.loads(out.read_text())["prompts"]
    done = {r["id"] for r in report["prompts"]}
    for i, p in enumerate(prompts):
        if p["id"] in done:
            continue
        t0 = time.time()
        report["prompts"].append(run_prompt(engine, p, methods, ratios, args.repeats))
        out.write_text(json.dumps(report, indent=1))
        row = report["prompts"][-1]
        best = max(row["methods"].items(), key=lambda kv: kv[1]["fidelity"])
        print(f"[{i + 1}/{len(prompts)}] {p['id']} {row['tokens']} tok, full {row['full_ttft']:.2f} s, "
              f"best {best[0]} {best[1]['fidelity']:.3f} ({time.time() - t0:.0f} s)", flush=True)
    report_mod.write(out, out.parent)


if __name__ == "__main__":
    main()
