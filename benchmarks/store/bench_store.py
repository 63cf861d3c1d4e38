"""put/get throughput per tier and storage dtype for one SmolLM2-shaped chunk entry, beside the
raw limits measured in the same run.

    .venv/bin/python benchmarks/store/bench_store.py [--redis redis://127.0.0.1:6379/0] [--reps 20]

Entry: 512 tokens, 30 layers, 3 kv heads, head_dim 64, model dtype float32 (random K/V with an
outlier key channel). GB/s = stored entry bytes / second. Raw limits: memory = copying the entry's
bytes into a fresh buffer; disk = reading the entry's bytes as one plain file (page cache) with one
readinto; redis = one plain GET of a value of the entry's size. "get" = get(key) (all layers,
verified, decoded to float32); "stored" = get_stored(key) (verified, storage dtype, no dequant).
"""

# ruff: noqa: B023  (timing closures run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid

import redis
import torch

from ragkv.keys import chunk_key
from ragkv.store.disk import DiskStore
from ragkv.store.entry import EntryMeta, encode
from ragkv.store.memory import MemoryStore
from ragkv.store.redis_store import RedisStore

L, H, T, D = 30, 3, 512, 64
CONFIGS = [("float32", None), ("float16", None), ("bfloat16", None), ("int8", "auto")]


def best(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]  # median


def make(storage, axis, seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = list(range(seed, seed + T))
    layers = []
    for _ in range(L):
        k = torch.randn(H, T, D, generator=g)
        k[:, :, 3] *= 15
        layers.append((k, torch.randn(H, T, D, generator=g)))
    key = chunk_key("bench", toks, f"sink1/v1/{storage}/{axis}")
    return EntryMeta(key, tuple(toks), 1, L, H, D, "float32", storage, axis, "bench", "sink1/v1", {}), layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ragkv-bench-")
    ns = f"bench-{uuid.uuid4().hex[:6]}:"
    stores = {
        "memory": MemoryStore(max_bytes=None),
        "disk": DiskStore(os.path.join(tmp, "kv"), max_bytes=None, fsync=False),
        "redis": RedisStore(args.redis, namespace=ns),
    }
    rc = redis.Redis.from_url(args.redis)
    rows = []
    for storage, axis in CONFIGS:
        meta, layers = make(storage, axis)
        enc = encode(meta, layers)
        nbytes = enc.nbytes
        flat = bytes(enc.header) + b"".join(bytes(b) for b in enc.blobs)
        raw_path = os.path.join(tmp, "raw.bin")
        with open(raw_path, "wb") as f:
            f.write(flat)

        def raw_file():
            buf = bytearray(nbytes)
            with open(raw_path, "rb", buffering=0) as f:
                f.readinto(buf)

        rkey = f"{ns}raw"
        rc.set(rkey, flat)
        raw = {
            "memory": best(lambda: bytearray(flat), args.reps),
            "disk": best(raw_file, args.reps),
            "redis": best(lambda: rc.get(rkey), args.reps),
        }
        rc.delete(rkey)
        for tier, s in stores.items():

            def put(s=s):
                s.delete(meta.key)
                s.put(meta, layers)

            t_put = best(put, max(3, args.reps // 4))
            t_get = best(lambda s=s: s.get(meta.key), args.reps)
            t_stored = best(lambda s=s: s._get_stored(meta.key), args.reps)
            gbs = lambda t: nbytes / t / 1e9  # noqa: E731
            rows.append(
                (
                    tier,
                    f"{storage}" + (f"/{axis}" if axis else ""),
                    nbytes / T,
                    gbs(t_put),
                    gbs(t_get),
                    gbs(t_stored),
                    gbs(raw[tier]),
                    raw[tier] / t_stored,
                    raw[tier] / t_get,
                )
            )
            s.delete(meta.key)
    stores["redis"].clear()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}, entry {L}x{H}x{T}x{D}, reps {args.reps}\n"
    )
    print(
        "| tier | storage | bytes/token | put GB/s | get GB/s | get_stored GB/s | raw GB/s "
        "| get_stored / raw | get / raw |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f} "
            f"| {r[7]:.0%} | {r[8]:.0%} |"
        )


if __name__ == "__main__":
    main()
