"""Precompute throughput vs the model's plain forward on the same chunks, in the same run.

    corpus   plain-text docs of stdlib modules (pydoc), chunked by ragkv's chunker; the first
             --chunks chunks of --chunk-tokens (real text, no internet needed)
    plain    model.model(input_ids) over the same padded batches precompute runs (sink + chunk,
             longest first, --batch-tokens per forward); no store, nothing kept
    ours     ragkv.precompute.precompute(engine.prefiller, texts=chunk texts) into a fresh disk store: re-chunking,
             tokenizing, keys, contains, prefill_kv, encode + fsync'd atomic writes (background thread)
    tokens/s counts chunk tokens (the cached ones) for both; the ratio is ours / plain.

Both sides run the chunks behind the sink only (``PrecomputePolicy(context=0, lead=False)``): this
measures ragkv's overhead around the forward. The default policy (context=1, lead) also runs each
chunk's nearest neighbour through the model (about twice the tokens) and stores each chunk a second
time right behind the sink (its lead entry); their cost is in RESULTS.md.

    .venv/bin/python benchmarks/precompute/bench_precompute.py [--chunks 20] [--repeats 2]
"""

from __future__ import annotations

import argparse
import pydoc
import shutil
import statistics
import tempfile
import time

import torch

from ragkv import models
from ragkv.blend import BlendEngine
from ragkv.chunking import chunk_document
from ragkv.policy import PrecomputePolicy, StorageFormat
from ragkv.precompute import precompute
from ragkv.prefill import batches
from ragkv.store import open_store

MODULES = ("collections", "pathlib", "json", "argparse", "subprocess", "threading", "itertools", "functools",
           "logging", "email.message", "http.client", "unittest", "sqlite3", "datetime", "re")


def corpus_chunks(tok, n: int, chunk_tokens: int) -> list[str]:
    from ragkv.prompt import PromptTemplate

    tpl = PromptTemplate.for_tokenizer(tok)
    out: list[str] = []
    for name in MODULES:
        text = pydoc.render_doc(name, renderer=pydoc.plaintext)
        # full chunks only: the benchmark is about ~chunk_tokens-long chunks
        out += [c for c in chunk_document(text, tpl, chunk_tokens) if len(tpl.chunk_ids(c)) > 0.8 * chunk_tokens]
        if len(out) >= n:
            return out[:n]
    raise SystemExit(f"only {len(out)} chunks of ~{chunk_tokens} tokens in the corpus")


@torch.inference_mode()
def plain_forward(model, engine, texts, batch_tokens: int) -> float:
    planned = [engine.template.chunk_ids(t) for t in texts]
    sink = engine.keys.sink_ids
    t0 = time.perf_counter()
    for group in batches([len(c) for c in planned], len(sink), batch_tokens):
        width = len(sink) + len(planned[group[0]])
        ids = torch.zeros((len(group), width), dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, : len(sink) + len(planned[i])] = torch.tensor([*sink, *planned[i]])
        model.model(input_ids=ids)
    return sum(map(len, planned)) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="storage dtype (default: the model's)")
    args = ap.parse_args()

    model, tok = models.load(args.model)
    texts = corpus_chunks(tok, args.chunks, args.chunk_tokens)
    policy = PrecomputePolicy(context=0, lead=False)  # like with like: plain_forward runs sink + chunk only
    engine = BlendEngine(model, tok, open_store("memory"), policy=policy)  # keys/sink only; warms the fingerprint
    n_tok = sum(len(engine.template.chunk_ids(t)) for t in texts)
    plain_forward(model, engine, texts[:2], args.batch_tokens)  # warm-up
    plain, ours, secs, mib = [], [], [], 0.0
    for _ in range(args.repeats):
        plain.append(plain_forward(model, engine, texts, args.batch_tokens))
        root = tempfile.mkdtemp(prefix="ragkv-bench-")
        try:
            with open_store(f"disk://{root}") as store:
                eng = BlendEngine(model, tok, store, storage=StorageFormat(args.dtype), policy=policy)
                s = precompute(eng.prefiller, texts=texts, chunk_tokens=args.chunk_tokens, batch_tokens=args.batch_tokens)
            assert s.failed == 0 and s.new == len(texts), s.describe()
            ours.append(s.tokens_per_s)
            secs.append(s.seconds)
            mib = s.bytes_written / 2**20
        finally:
            shutil.rmtree(root, ignore_errors=True)
    p, o = statistics.median(plain), statistics.median(ours)
    print(f"model {args.model}  torch threads {torch.get_num_threads()}  {len(texts)} chunks, {n_tok} tokens, "
          f"batch_tokens {args.batch_tokens}, storage {args.dtype or str(model.dtype).removeprefix('torch.')}, {mib:.0f} MiB per run")
    print("| run | plain forward tok/s | precompute tok/s | ratio |")
    print("|---|---|---|---|")
    for i, (a, b) in enumerate(zip(plain, ours)):
        print(f"| {i + 1} | {a:.1f} | {b:.1f} | {b / a:.1%} |")
    print(f"| median | {p:.1f} | {o:.1f} | **{o / p:.1%}** |")


if __name__ == "__main__":
    main()
