"""TTFT of a blended prefill, sequential vs pipelined layer loading (ragkv.loader), per backend.

6 chunks of ~512 tokens (pydoc text of stdlib modules, ragkv.chunking.chunk_document), SmolLM2,
ratio 0.15, the default check layers (gradual 1,3,6). Per backend (memory, disk, redis) and mode, ``--reps`` prefills; the
median is reported. The split comes from the sequential run:

    load      = loader read time (BlendStats.t_load_io)
    recompute = decoder-layer compute after the last check layer (forward hooks on each layer)
    fixed     = everything else (lookup, layers up to the last check layer, fusion, lm head)
    target    : pipelined TTFT <= 1.15 * max(load, recompute) + fixed

Disk: before each prefill the entry files are evicted from the page cache with
posix_fadvise(DONTNEED) (a cold read) unless --warm.

    .venv/bin/python benchmarks/loader/bench_loader.py --reps 3
"""

from __future__ import annotations

import argparse
import os
import pydoc
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

from ragkv import models
from ragkv.blend import BlendConfig, BlendEngine
from ragkv.chunking import chunk_document
from ragkv.store.disk import DiskStore
from ragkv.store.memory import MemoryStore

HERE = Path(__file__).resolve().parent
MODULES = ["argparse", "json", "textwrap", "collections", "pathlib", "logging", "subprocess", "inspect"]


def contexts(template, n: int = 6, tokens: int = 512) -> list[str]:
    out = []
    for name in MODULES:
        text = pydoc.render_doc(__import__(name), renderer=pydoc.plaintext)
        for c in chunk_document(text, template, max_tokens=tokens):
            if len(template.chunk_ids(c)) >= tokens - 48:  # near-full chunks only
                out.append(c)
            if len(out) == n:
                return out
    raise RuntimeError("not enough text")


class LayerTimer:
    """Wall time of each decoder layer's forward (hooks), reset per prefill."""

    def __init__(self, layers):
        self.t = [0.0] * len(layers)
        self._t0 = [0.0] * len(layers)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: self._pre(i))
            layer.register_forward_hook(lambda m, a, o, i=i: self._post(i))

    def _pre(self, i):
        self._t0[i] = time.perf_counter()

    def _post(self, i):
        self.t[i] += time.perf_counter() - self._t0[i]

    def reset(self):
        self.t = [0.0] * len(self.t)


def evict_files(root: Path) -> None:
    for p in root.rglob("*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="memory,disk,redis")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--warm", action="store_true", help="disk: keep the page cache (no fadvise)")
    ap.add_argument("--out", default=str(HERE))
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tok = models.load("smollm2-135m")
    timer = LayerTimer(model.model.layers)
    tmp = tempfile.TemporaryDirectory()
    rows = []
    for backend in args.backends.split(","):
        if backend == "memory":
            store = MemoryStore(max_bytes=None)
        elif backend == "disk":
            store = DiskStore(Path(tmp.name) / "kv", max_bytes=None, fsync=False)
        else:
            from ragkv.store.redis_store import RedisStore

            store = RedisStore(args.redis, namespace=f"bench-loader-{uuid.uuid4().hex[:8]}:")
        engines = {m: BlendEngine(model, tok, store, config=BlendConfig(pipelined=m == "pipelined"))
                   for m in ("sequential", "pipelined")}
        eng = engines["sequential"]
        ctx = contexts(eng.template)
        prompt = eng.build_prompt("Which module documents the most functions?", ctx)
        eng.prefill_prompt(prompt)  # compute and store every chunk
        check = eng.config.selector.layers_for(eng.adapter.num_layers)[-1]
        res: dict[str, list] = {m: [] for m in engines}
        for _ in range(args.reps):
            for mode, e in engines.items():
                if backend == "disk" and not args.warm:
                    evict_files(Path(tmp.name) / "kv")
                timer.reset()
                r = e.prefill_prompt(prompt)
                assert r.stats.hits == 6 and not (r.stats.corrupt or r.stats.vanished or r.stats.store_errors), r.stats
                recompute = sum(timer.t[check + 1 :])
                res[mode].append((r.stats.t_total, r.stats.t_load_io, r.stats.t_load, recompute))
        med = {m: [statistics.median(x[j] for x in v) for j in range(4)] for m, v in res.items()}
        s_total, s_io, _, s_rec = med["sequential"]
        p_total, _, p_wait, _ = med["pipelined"]
        fixed = s_total - s_io - s_rec
        target = 1.15 * max(s_io, s_rec) + fixed
        rows.append(dict(backend=backend + ("" if backend != "disk" or args.warm else " (cold)"),
                         tokens=prompt.num_tokens, seq=s_total, pipe=p_total, load=s_io, recompute=s_rec,
                         fixed=fixed, wait=p_wait, target=target, ok=p_total <= target))
        if backend == "redis":
            store.clear()
        store.close()

    hdr = "| backend | prompt tokens | sequential TTFT s | pipelined TTFT s | load s | recompute s | fixed s " \
          "| pipelined wait s | target s | met |"
    print(hdr)
    print("|" + "---|" * 10)
    for r in rows:
        print(f"| {r['backend']} | {r['tokens']} | {r['seq']:.3f} | {r['pipe']:.3f} | {r['load']:.3f} | "
              f"{r['recompute']:.3f} | {r['fixed']:.3f} | {r['wait']:.3f} | {r['target']:.3f} | "
              f"{'yes' if r['ok'] else 'no'} |")
    plot(rows, Path(args.out) / "ttft.png")
    return 0


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(rows))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["fixed"] for r in rows], w, label="fixed", color="#999")
    ax.bar([i - w / 2 for i in x], [r["load"] for r in rows], w, bottom=[r["fixed"] for r in rows],
           label="load (seq.)", color="#4a7")
    ax.bar([i - w / 2 for i in x], [r["recompute"] for r in rows], w,
           bottom=[r["fixed"] + r["load"] for r in rows], label="recompute (seq.)", color="#47a")
    ax.bar([i + w / 2 for i in x], [r["pipe"] for r in rows], w, label="pipelined TTFT", color="#d83")
    ax.scatter([i + w / 2 for i in x], [r["target"] for r in rows], marker="_", s=400, color="k",
               label="target", zorder=3)
    ax.set_xticks(list(x), [r["backend"] for r in rows])
    ax.set_ylabel("seconds")
    ax.set_title("SmolLM2, 6 x 512-token chunks: sequential (left) vs pipelined (right)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
