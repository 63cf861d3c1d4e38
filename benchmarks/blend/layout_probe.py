"""How much of the blend's error is the stored layout's? Fidelity with chunk entries written under
different layouts, the read path unchanged.

Every layout stores each chunk's K/V under the engine's own key (the read path re-rotates from the
entry's recorded start, so any start is read correctly); only what the chunk was prefilled behind
changes:

    policy   the precompute policy (default: its nearest chunk of the corpus at the end of a
             1024-position gap behind the template prefix): what ``ragkv precompute`` writes
    lead     the prompt's first chunk prefilled right behind the template prefix (exactly what full
             prefill computes for it: a prefix); the others as ``policy``
    allpred  each chunk behind all the chunks before it in this prompt, at the end of the gap (the
             first one behind its neighbour, as ``policy``): the cross-attention is there, only the
             distance to the template prefix is wrong
    exact    each chunk behind the template prefix and all the chunks before it, at its true
             position: the prefix cache. A check of the read path: fidelity 1.0 at every ratio

``lead`` and ``allpred`` cannot be written by a precompute job (the prompt is not known then); they
measure what a layout could gain. Teacher-forced fidelity and free-running same answer (32 tokens),
as bench_blend.py, no timing:

    python benchmarks/blend/layout_probe.py --questions examples/data/questions.jsonl \\
        --out benchmarks/blend/results/layout-probe-demo-fp32.md
    python benchmarks/blend/layout_probe.py --split dev --per-genre 2 \\
        --out benchmarks/blend/results/layout-probe-dev-fp32.md
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

from ragkv import models
from ragkv.blend import BlendConfig, BlendEngine
from ragkv.chunking import chunk_spans
from ragkv.evaluate import teacher_forced_agreement
from ragkv.neighbours import neighbour_contexts
from ragkv.policy import PrecomputePolicy
from ragkv.prefill import prefill_kv
from ragkv.store import open_store
from ragkv.store.entry import encode

LAYOUTS = ("policy", "lead", "allpred", "exact")
N_TOKENS = 32


def write_layout(engine: BlendEngine, chunks: list[list[int]], layout: str, neighbours: list[list[int]]) -> None:
    """Store every chunk of one prompt under ``layout``, keyed as the read path looks it up;
    ``neighbours``: each chunk's context under the policy (``neighbour_contexts``)."""
    s, gap = len(engine.keys.sink_ids), engine.prefiller.policy.gap
    for i, c in enumerate(chunks):
        before = [t for prev in chunks[:i] for t in prev]
        if layout == "exact" or (layout == "lead" and i == 0):
            ctx, at = before, len(before)  # behind the prefix and its predecessors, at its true position
        elif layout == "allpred" and i > 0:
            ctx, at = before[-gap:], gap
        else:
            ctx, at = neighbours[i], gap
        kv = prefill_kv(engine.adapter, engine.keys.sink_ids, [c], gap=at, contexts=[ctx] if ctx else None)[0]
        key = engine.keys.chunk_key(c)
        engine.store.put_encoded(key, encode(engine.entry_meta(key, c, s + at, engine.keys.policy_id), kv))


@torch.inference_mode()
def probe(model, tok, questions: list[dict], docs: list[str], ratios: list[float], layouts) -> dict:
    """``docs``: the corpus whose chunks (chunked as ``ragkv precompute`` does) are the neighbours."""
    policy = PrecomputePolicy()
    base = BlendEngine(model, tok, open_store("memory://"), BlendConfig(), policy=policy)
    pool = list({tuple(ids): list(ids) for d in docs for s, e in chunk_spans(d, base.template, 512)
                 for ids in [base.template.chunk_ids(d[s:e])]}.values())
    a = base.adapter
    out = {lay: {r: {"fidelity": [], "same": []} for r in ratios} for lay in layouts}
    for qi, q in enumerate(questions):
        t0 = time.time()
        prompt = base.build_prompt(q["question"], q["contexts"])
        ids = torch.tensor([prompt.input_ids])
        _, cache = a.forward(ids, logits_to_keep=1)
        cache.crop(-1)
        target = a.generate(ids, cache, tok, max_new_tokens=N_TOKENS, do_sample=False)
        chunks = [list(c) for c in prompt.chunk_ids]
        neighbours = neighbour_contexts(chunks, pool, policy.context)
        for lay in layouts:
            engine = BlendEngine(model, tok, open_store("memory://"), BlendConfig(), policy=policy)
            write_layout(engine, chunks, lay, neighbours)
            for r in ratios:
                res = engine.prefill_prompt(prompt, ratio=r)
                assert res.stats.misses == 0, "every chunk was written under the layout"
                answer = a.generate(res.input_ids, res.cache, tok, max_new_tokens=N_TOKENS, do_sample=False)
                a.truncate(res.cache, prompt.num_tokens - 1)
                out[lay][r]["fidelity"].append(teacher_forced_agreement(a, res, target))
                out[lay][r]["same"].append(answer.tolist() == target.tolist())
        print(f"[{qi + 1}/{len(questions)}] {prompt.num_tokens} tok, {len(prompt.chunk_ids)} chunks "
              f"({time.time() - t0:.0f} s)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--questions", help="a ragkv eval JSONL file (neighbours among its contexts)")
    src.add_argument("--split", choices=["dev", "test"], help="the benchmark set (neighbours from its corpus)")
    ap.add_argument("--per-genre", type=int, default=None)
    ap.add_argument("--ratios", default="0,0.15")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        raise SystemExit(f"unknown layouts {sorted(unknown)}; valid: {', '.join(LAYOUTS)}")
    ratios = [float(r) for r in args.ratios.split(",")]
    if args.questions:
        questions = [json.loads(line) for line in Path(args.questions).read_text().splitlines() if line.strip()]
        docs = sorted({c for q in questions for c in q["contexts"]})
    else:
        questions = corpus.load(args.split)
        if args.per_genre:
            questions = [p for i, p in enumerate(questions)
                         if sum(q["genre"] == p["genre"] for q in questions[:i]) < args.per_genre]
        docs = corpus.documents(args.split)
    model, tok = models.load("smollm2-135m", dtype=args.dtype)
    out = probe(model, tok, questions, docs, ratios, layouts)
    lines = [f"# Layout probe: {args.questions or args.split}, {len(questions)} prompts, "
             f"{str(model.dtype).removeprefix('torch.')}", "", f"`python {' '.join(sys.argv)}`", "",
             "| layout | ratio | fidelity | same answer |", "|---|---|---|---|"]
    for lay in layouts:
        for r in ratios:
            m = out[lay][r]
            lines.append(f"| {lay} | {r:g} | {statistics.fmean(m['fidelity']):.3f} | "
                         f"{sum(m['same'])} of {len(m['same'])} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
