"""Tables and Pareto plots from bench_blend.py results.

    python benchmarks/blend/report.py benchmarks/blend/results/test-bf16.json [more.json ...] \\
        --out benchmarks/blend/results

Per result file (one split, one dtype): a table per method and ratio (fidelity with a 95% bootstrap
confidence interval over prompts, KL, share of answers equal to full prefill's, tokens before the
first divergence, median TTFT and the speedup against HF full prefill's median TTFT in the same
dtype), fidelity per genre, and a Pareto plot (fidelity vs speedup per method, one line per method
through its ratios), overall and per genre. Written to <out>/tables-<name>.md and <out>/pareto-<name>.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

GENRES = ("technical", "legal", "literature", "encyclopedic")


def bootstrap(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean, resampling prompts with replacement."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def summarize(rows: list[dict]) -> dict[str, dict]:
    full = statistics.median(r["full_ttft"] for r in rows)
    out = {}
    for label in rows[0]["methods"]:
        ms = [r["methods"][label] for r in rows]
        fid = [m["fidelity"] for m in ms]
        ttft = statistics.median(m["ttft"] for m in ms)
        out[label] = {
            "fidelity": statistics.fmean(fid), "ci": bootstrap(fid), "kl": statistics.fmean(m["kl"] for m in ms),
            "same_answer": statistics.fmean(float(m["same_answer"]) for m in ms),
            "agree_tokens": statistics.fmean(m["agree_tokens"] for m in ms), "ttft": ttft, "speedup": full / ttft,
            "recomputed": statistics.fmean(m["recomputed"] for m in ms),
            "split": {k: statistics.median(m["split"][k] for m in ms) for k in ms[0]["split"]},
            "genres": {g: statistics.fmean(r["methods"][label]["fidelity"] for r in rows if r["genre"] == g)
                       for g in GENRES if any(r["genre"] == g for r in rows)},
        }
    return {"full_ttft": full, "methods": out}


def table(name: str, meta: dict, rows: list[dict], s: dict) -> str:
    toks = sorted(r["tokens"] for r in rows)
    lines = [f"## {name}: {meta['split']} split, {len(rows)} prompts, {meta['dtype']}, {meta['threads']} threads", "",
             f"Command: `{meta['command']}`", "",
             f"Prompt tokens min/median/max {toks[0]}/{statistics.median(toks):.0f}/{toks[-1]}; "
             f"HF full prefill (sdpa, {meta['dtype']}) median TTFT {s['full_ttft']:.3f} s. "
             f"Fidelity: teacher-forced top-1 agreement with full prefill over its first {meta['n_tokens']} greedy "
             "tokens, mean over prompts [95% bootstrap CI]; same answer: share of prompts whose free-running "
             "greedy answer equals full prefill's over those tokens.", "",
             "| method @ ratio | fidelity [95% CI] | KL | same answer | tokens agreed | TTFT s | speedup | "
             "recomputed tok | select s | fuse s | compute s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, m in s["methods"].items():
        lo, hi = m["ci"]
        sp = m["split"]
        lines.append(f"| {label} | {m['fidelity']:.3f} [{lo:.3f}, {hi:.3f}] | {m['kl']:.4f} | {m['same_answer']:.2f} | "
                     f"{m['agree_tokens']:.1f} | {m['ttft']:.3f} | {m['speedup']:.2f}x | {m['recomputed']:.0f} | "
                     f"{sp['select']:.3f} | {sp['fuse']:.3f} | {sp['compute']:.3f} |")
    genres = list(next(iter(s["methods"].values()))["genres"])
    lines += ["", "Fidelity per genre:", "", "| method @ ratio | " + " | ".join(genres) + " |",
              "|---|" + "---|" * len(genres)]
    for label, m in s["methods"].items():
        lines.append(f"| {label} | " + " | ".join(f"{m['genres'][g]:.3f}" for g in genres) + " |")
    return "\n".join(lines) + "\n"


def plot(name: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("all genres", rows)] + [(g, [r for r in rows if r["genre"] == g]) for g in GENRES]
    panels = [(t, rs) for t, rs in panels if rs]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), sharey=True)
    for ax, (title, rs) in zip(axes, panels):
        s = summarize(rs)["methods"]
        by_method: dict[str, list] = {}
        for label, m in s.items():
            method, ratio = label.rsplit("@", 1)
            by_method.setdefault(method, []).append((m["speedup"], m["fidelity"], ratio))
        for method, pts in by_method.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=method, ms=4)
            for x, y, r in pts:
                ax.annotate(r, (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.axhline(0.95, color="gray", ls=":", lw=1)
        ax.set_title(f"{title} ({len(rs)} prompts)", fontsize=9)
        ax.set_xlabel("TTFT speedup vs HF full prefill (same dtype)")
    axes[0].set_ylabel("fidelity (teacher-forced top-1 agreement)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Selection strategies: fidelity vs TTFT speedup ({name}; labels: recompute ratio)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: Path, out: Path) -> None:
    """tables-<name>.md, summary-<name>.json and pareto-<name>.png of one bench_blend.py result."""
    rep = json.loads(result.read_text())
    rows, name = rep["prompts"], result.stem
    s = summarize(rows)
    (out / f"tables-{name}.md").write_text(table(name, rep["meta"], rows, s))
    (out / f"summary-{name}.json").write_text(json.dumps(s, indent=1))
    plot(name, rows, out / f"pareto-{name}.png")
    print(f"{name}: {len(rows)} prompts -> tables-{name}.md, pareto-{name}.png")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default="benchmarks/blend/results")
    args = ap.parse_args()
    for f in map(Path, args.results):
        write(f, Path(args.out))


if __name__ == "__main__":
    main()
