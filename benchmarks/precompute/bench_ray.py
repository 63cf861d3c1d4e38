"""``precompute --ray`` against the local job on the same corpus, and what 1M chunks cost to store.

    corpus   --docs distinct documents (pydoc plain text of stdlib modules, cut to --doc-tokens
             tokens each), written as .txt files: the unit of Ray's work is a document
    local    ragkv.precompute.precompute(engine.prefiller, paths) in this process, torch on --cpus threads
    ray-1    ragkv.distributed.precompute_ray(..., workers=1, cpus_per_worker=--cpus)
    ray-2    ragkv.distributed.precompute_ray(..., workers=2, cpus_per_worker=--cpus // 2)
    each run writes into a fresh disk:// store (max_bytes=none, fsync on) and is timed whole: reading,
    chunking, actor start and model load (Ray), prefill, encode, write. ray.init is timed apart (once).
    tokens/s = cached chunk tokens / seconds; overhead = 1 - ray-1 / local (same CPUs).
    storage  bytes of one entry of 512 tokens per storage dtype (real encoded entries of the model),
             and the cost of 1M such chunks (whatever --chunk-tokens the timed runs use).

    .venv/bin/python benchmarks/precompute/bench_ray.py [--docs 8] [--doc-tokens 1536] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import pydoc
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ragkv import models
from ragkv.distributed import precompute_ray
from ragkv.policy import StorageFormat
from ragkv.precompute import entry_bytes, precompute
from ragkv.spec import EngineSpec
from ragkv.store import open_store

MODULES = ("collections", "pathlib", "json", "argparse", "subprocess", "threading", "itertools", "functools",
           "logging", "email.message", "http.client", "unittest", "sqlite3", "datetime", "re")
DTYPES = ("float32", "float16", "bfloat16", "int8")
STORAGE_CHUNK = 512
HERE = Path(__file__).parent


def write_corpus(tok, n_docs: int, doc_tokens: int, root: Path) -> int:
    chars = 0
    for name in MODULES[:n_docs]:
        text = pydoc.render_doc(name, renderer=pydoc.plaintext)
        ids = tok(text, add_special_tokens=False)["input_ids"][:doc_tokens]
        doc = tok.decode(ids)
        (root / f"{name}.txt").write_text(doc)
        chars += len(doc)
    return chars


def run(mode: str, spec: EngineSpec, corpus: Path, args) -> dict:
    uri = spec.store_uri
    t0 = time.perf_counter()
    if mode == "local":
        import torch

        torch.set_num_threads(args.cpus)
        with open_store(uri) as store:
            s = precompute(spec.prefiller(store), paths=[corpus], chunk_tokens=args.chunk_tokens)
    else:
        workers = int(mode.split("-")[1])
        s = precompute_ray(spec, paths=[corpus], chunk_tokens=args.chunk_tokens, workers=workers,
                           cpus_per_worker=max(1, args.cpus // workers), allow_eviction=True)
    wall = time.perf_counter() - t0
    assert s.failed == 0 and s.new == s.chunks, s.describe()
    return {"mode": mode, "chunks": s.chunks, "tokens": s.tokens, "seconds": wall, "tok_s": s.tokens / wall,
            "bytes": s.bytes_written}


def storage_table(spec: EngineSpec, chunk_tokens: int) -> list[dict]:
    rows = []
    for dt in DTYPES:
        with open_store("memory://") as store:
            eng = EngineSpec(spec.model, spec.model_dtype, storage=StorageFormat(dt)).prefiller(store)
            per_chunk = entry_bytes(eng)(chunk_tokens)
        rows.append({"dtype": dt, "bytes_per_chunk": per_chunk, "per_token": per_chunk / chunk_tokens,
                     "tb_per_1m": per_chunk * 1e6 / 1e12})
    return rows


def plot(results: dict, storage: list[dict], chunk_tokens: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    modes = list(results)
    med = [statistics.median(r["tok_s"] for r in results[m]) for m in modes]
    a.bar(modes, med, color=["#555", "#1f77b4", "#2ca02c"][: len(modes)])
    for m, rs in results.items():
        a.scatter([m] * len(rs), [r["tok_s"] for r in rs], color="k", s=12, zorder=3)
    a.set_ylabel("cached tokens / s (whole job)")
    a.set_title("precompute: local vs --ray (same CPUs)")
    b.bar([r["dtype"] for r in storage], [r["tb_per_1m"] for r in storage], color="#d62728")
    b.set_ylabel("TB for 1M chunks")
    b.set_title(f"storage of 1M chunks of {chunk_tokens} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--model-dtype", default="float32")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--storage", default="bfloat16", help="storage dtype of the timed runs")
    ap.add_argument("--ray-address", default=None, help="join this Ray head instead of starting one")
    ap.add_argument("--out", default=str(HERE / "ray.json"))
    args = ap.parse_args()

    import ray

    tok = models.load_tokenizer(args.model)
    work = Path(tempfile.mkdtemp(prefix="ragkv-bench-ray-"))
    corpus = work / "corpus"
    corpus.mkdir()
    chars = write_corpus(tok, args.docs, args.doc_tokens, corpus)
    t0 = time.perf_counter()
    for attempt in range(3):  # Ray waits a fixed 30 s for its node: a loaded machine may need another go
        try:
            if args.ray_address:  # a head started by `ray start` (see RESULTS.md)
                ray.init(address=args.ray_address, log_to_driver=False)
            else:
                ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
                         object_store_memory=200 * 2**20, log_to_driver=False)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
            t0 = time.perf_counter()
    ray_init = time.perf_counter() - t0
    modes = ("local", "ray-1", "ray-2")
    results: dict[str, list] = {m: [] for m in modes}
    try:
        for rep in range(args.repeats):
            for mode in modes:  # alternate, so load changes on the machine hit every mode alike
                store = work / f"kv-{mode}-{rep}"
                spec = EngineSpec(args.model, args.model_dtype, f"disk://{store}?max_bytes=none",
                                  storage=StorageFormat(args.storage))
                r = run(mode, spec, corpus, args)
                shutil.rmtree(store, ignore_errors=True)
                results[mode].append(r)
                print(json.dumps(r), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    storage = storage_table(EngineSpec(args.model, args.model_dtype), STORAGE_CHUNK)
    Path(args.out).write_text(json.dumps({"args": vars(args), "chars": chars, "ray_init_s": ray_init,
                                          "runs": results, "storage": storage}, indent=1) + "\n")
    plot(results, storage, STORAGE_CHUNK, Path(args.out).with_suffix(".png"))
    loc = statistics.median(r["tok_s"] for r in results["local"])
    print(f"ray.init {ray_init:.1f} s")
    for m in modes:
        med = statistics.median(r["tok_s"] for r in results[m])
        print(f"{m:6s} median {med:7.1f} tok/s  ({med / loc:.0%} of local)  runs "
              + ", ".join(f"{r['tok_s']:.1f}" for r in results[m]))
    for r in storage:
        print(f"{r['dtype']:8s} {r['bytes_per_chunk'] / 2**20:7.2f} MiB/chunk  {r['tb_per_1m']:6.2f} TB per 1M chunks")


if __name__ == "__main__":
    main()
