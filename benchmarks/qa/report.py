"""Tables, plots and the changed answers from run_qa.py's reports (`ragkv eval` JSON + meta).

    python benchmarks/qa/report.py [--out benchmarks/qa/results]

For every qa-*.json in the folder: qa-<name>.md with, per method, over all questions and per dataset
and per question type: answer agreement with full prefill (95% bootstrap interval), F1 and EM
against the gold answers, F1 minus full prefill's (paired per question, 95% interval), questions
worse / better, median TTFT and the speed-up against HF full prefill in the same run and dtype; then
the peers' published deltas, and the questions whose answer changes under the ratio-0.15 methods.
Per report: qa-<name>.png, agreement and ΔF1 against TTFT speed-up, one panel per dataset.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = ("Published deltas for comparison (the authors' numbers, not measured here; mostly 7-14B models on GPU, "
         "see ../shared/research/quality.md): InfoFlow KV (Qwen3-14B, LongBench) full prefill vs its own blend vs "
         "CacheBlend: HotpotQA .592 / .595 / .574, 2WikiMQA .516 / .502 / .433, MuSiQue .372 / .339 / .277; "
         "FusionRAG recovers 56-100% of the full-vs-naive gap on multi-hop sets at 15% (CacheBlend 6% on Qwen3-32B "
         "HotpotQA); the CacheBlend paper reports <= 0.02 F1 loss at 15% (Mistral-7B to Llama-70B, 2Wiki, MuSiQue).")


def _order(label: str) -> tuple:
    if label == "full":
        return (0, "", 0.0)
    if "@" not in label:
        return (1, "", float(label) if label.replace(".", "").isdigit() else 9.0)
    sel, r = label.rsplit("@", 1)
    return (2, sel, float(r) if r.replace(".", "").isdigit() else 9.0)


def _ci(m: dict, key: str, fmt: str = "{:.2f}") -> str:
    lo, hi = m[f"{key}_ci"]
    return f"{fmt.format(m[key])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def method_table(methods: dict[str, dict], default: str | None) -> list[str]:
    lines = ["| method | n | agreement [95% CI] | F1 | ΔF1 vs full [95% CI] | EM | worse / better | TTFT s | speed-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label in sorted(methods, key=_order):
        m = methods[label]
        name = f"**{label} (default)**" if label == default else label
        delta = "" if label == "full" else _ci(m, "delta_f1", "{:+.3f}")
        wb = "" if label == "full" else f"{m['worse']} / {m['better']}"
        lines.append(f"| {name} | {m['n']} | {_ci(m, 'agreement')} | {m['f1']:.3f} | {delta} | {m['em']:.3f} | {wb} | "
                     f"{m['ttft_s']:.2f} | {m['speedup']:.2f}x |")
    return lines


def table(name: str, report: dict) -> str:
    meta = report["meta"]
    from ragkv.blend.config import DEFAULT_RATIO, DEFAULT_SELECTOR

    settings = report.get("method_settings", {})
    default = next((label for label, (sel, r) in settings.items() if sel == DEFAULT_SELECTOR and r == DEFAULT_RATIO),
                   None)
    lines = [f"# {name}", "", f"- model: {report['model']} ({report['model_dtype'].removeprefix('torch.')}), {report['questions']} questions "
             f"({', '.join(meta['datasets'])}; sample {report.get('sample') or 'all'}, seed {report.get('seed')})",
             f"- host: {meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}, {meta['date']}, "
             f"wall {meta['wall_s'] / 60:.0f} min", f"- `{meta['command']}`", f"- eval: `{meta['eval_command']}`", "",
             "## All questions (pooled)", "", *method_table(report["methods"], default)]
    for gname, methods in report["groups"].items():
        lines += ["", f"## {gname}", "", *method_table(methods, default)]
    for e in report["errors"]:
        lines.append(f"\nQuestion {e['question']} of {e.get('dataset', '?')} not run: {e['error']}")
    lines += ["", PEERS, "", "## Answers that change (methods at r = 0.15)", ""]
    lines += changed(report)
    return "\n".join(lines) + "\n"


def changed(report: dict, limit: int = 40) -> list[str]:
    """Questions where a method at r = 0.15 answers other than full prefill, with the answers."""
    methods = report["methods"]
    labels = [label for label in sorted(methods, key=_order) if label.endswith("0.15")]
    full = methods["full"]["per_question"]
    out = []
    for i, q in enumerate(report["per_question"]):
        diff = [(label, methods[label]["per_question"]["answer"][i]) for label in labels
                if not methods[label]["per_question"]["agreement"][i]]
        if diff:
            out.append(f"- {q['dataset']} `{q['id']}` ({q['type']}): full prefill \"{_short(full['answer'][i])}\" "
                       f"(F1 {full['f1'][i]:.2f}); " + "; ".join(f"{label}: \"{_short(a)}\"" for label, a in diff))
    if len(out) > limit:
        out = [*out[:limit], f"- ... and {len(out) - limit} more (the JSON report has every answer)"]
    return out or ["None."]


def _short(text: str, n: int = 80) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= n else text[: n - 3] + "..."


def plot(name: str, report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {"all": report["methods"], **{g: m for g, m in report["groups"].items() if "/" not in g}}
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    for col, (gname, methods) in enumerate(groups.items()):
        sels = sorted({label.rsplit("@", 1)[0] for label in methods if "@" in label})
        for row, (key, ylabel) in enumerate((("agreement", "answer = full prefill's (95% CI)"),
                                             ("delta_f1", "ΔF1 vs full prefill (95% CI)"))):
            ax = axes[row][col]
            if key == "agreement":
                ax.axhline(0.85, color="grey", lw=0.8, ls="--")
            else:
                ax.axhline(0.0, color="grey", lw=0.8)
            ax.axvline(3.0, color="grey", lw=0.8, ls=":")
            if "0" in methods:
                m = methods["0"]
                ax.plot([m["speedup"]], [m[key]], "kx", ms=8, label="naive reuse")
            for i, sel in enumerate(sels):
                pts = sorted((float(label.rsplit("@", 1)[1]), methods[label]) for label in methods
                             if label.rsplit("@", 1)[0] == sel and "@" in label)
                xs, ys = [m["speedup"] for _, m in pts], [m[key] for _, m in pts]
                err = [[m[key] - m[f"{key}_ci"][0] for _, m in pts], [m[f"{key}_ci"][1] - m[key] for _, m in pts]]
                ax.errorbar(xs, ys, yerr=err, fmt="o-", ms=4, capsize=2, color=f"C{i}", label=sel)
                for (r, _), x, y in zip(pts, xs, ys):
                    ax.annotate(f"{r:g}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel("TTFT speed-up vs HF full prefill")
            ax.set_ylabel(ylabel, fontsize=8)
            if row == 0:
                ax.set_title(f"{gname} ({methods['full']['n']} questions)", fontsize=9)
            ax.legend(fontsize=6)
    fig.suptitle(f"{name}: {report['model']} {report['model_dtype'].removeprefix('torch.')} (labels: recompute ratio)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(out: Path) -> None:
    for f in sorted(out.glob("qa-*.json")):
        rep = json.loads(f.read_text())
        if "meta" not in rep or not rep["methods"] or "groups" not in rep:
            continue
        (out / f"{f.stem}.md").write_text(table(f.stem, rep))
        plot(f.stem, rep, out / f"{f.stem}.png")
        print(f"{f.stem}: {rep['questions']} questions -> {out / (f.stem + '.md')}, .png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results"), help="folder of run_qa.py's qa-*.json")
    write_all(Path(ap.parse_args().out))


if __name__ == "__main__":
    main()
