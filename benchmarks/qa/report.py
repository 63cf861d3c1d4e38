"""Tables, the plot and the flipped questions from run_qa.py's reports (`ragkv eval` JSON + meta).

    python benchmarks/qa/report.py [--out benchmarks/qa/results]

For every qa-*.json in the folder: qa-<name>.md with, per method, F1 and EM against the gold answers
(mean over questions, 95% bootstrap interval), F1 minus full prefill's (paired over questions, 95%
bootstrap interval), median TTFT and the speedup against HF full prefill in the same run and dtype,
fidelity and same answer; then the questions whose answer quality changes against full prefill,
with the answers. Over all of them: f1-vs-speedup.png (one panel per model, one line per selector
and dtype through its ratios, full prefill's F1 interval shaded).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ragkv.evaluate import bootstrap_ci

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PEERS = ("Published deltas for comparison (not measured here): the CacheBlend paper reports no F1 loss at ~15% "
         "recompute (Mistral-7B / Yi-34B / Llama-70B, GPU); the InfoFlow KV replication (Qwen3-14B, passage split) "
         "measured CacheBlend F1 0.574 vs full prefill 0.592 on HotpotQA (-0.018), 0.433 vs 0.516 on 2WikiMQA "
         "(-0.083), 0.277 vs 0.372 on MuSiQue (-0.095); EPIC (the first tokens of each chunk, like `starts`) lost more.")


def _label_key(label: str) -> tuple:
    if label == "full":
        return (0, "", 0.0)
    if "@" not in label:
        return (1, "", float(label))  # ratio 0 (naive reuse), run once for every selector
    sel, r = label.split("@")
    return (2, sel, float(r))


def question_rows(report: dict) -> list[dict]:
    """The questions file's rows that ran, in the order of ``per_question`` (failed ones left out)."""
    meta = report["meta"]
    path = Path(meta["questions_file"])
    rows = [json.loads(line) for line in (path if path.is_absolute() else REPO / path).read_text().splitlines()
            if line.strip()][: meta.get("limit")]
    failed = {e["question"] for e in report["errors"]}
    return [row for i, row in enumerate(rows, 1) if i not in failed]


def summarize(report: dict) -> dict[str, dict]:
    methods = report["methods"]
    full = methods["full"]
    full_f1 = full["per_question"]["f1"]
    out = {}
    for label in sorted(methods, key=_label_key):
        m = methods[label]
        diff = [a - b for a, b in zip(m["per_question"]["f1"], full_f1)]
        out[label] = {"f1": m["f1"], "f1_ci": m["f1_ci"], "em": m["em"], "em_ci": m["em_ci"],
                      "df1": sum(diff) / len(diff), "df1_ci": bootstrap_ci(diff), "ttft_s": m["ttft_s"],
                      "speedup": full["ttft_s"] / m["ttft_s"], "fidelity": m["fidelity"],
                      "same_answer": m["same_answer"], "ratio": m.get("ratio", 1.0 if label == "full" else None)}
    return out


def flips(report: dict, rows: list[dict]) -> list[dict]:
    """Per question whose F1 differs from full prefill's under some method: the gold answer, full
    prefill's answer and every differing method's answer with its F1 (``em_flip``: exact match changed)."""
    methods = report["methods"]
    full = methods["full"]["per_question"]
    out = []
    for i, row in enumerate(rows):
        changed = []
        for label in sorted(methods, key=_label_key):
            pq = methods[label]["per_question"]
            if label != "full" and pq["f1"][i] != full["f1"][i]:
                changed.append({"method": label, "answer": pq["answer"][i], "f1": pq["f1"][i],
                                "em_flip": pq["em"][i] != full["em"][i]})
        if changed:
            out.append({"id": row.get("id"), "type": row.get("type"), "question": row["question"],
                        "gold": row.get("answer", row.get("answers")), "full": full["answer"][i],
                        "full_f1": full["f1"][i], "methods": changed})
    return out


def _ci(x: float, ci) -> str:
    return f"{x:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def table(name: str, report: dict) -> str:
    meta, s = report["meta"], summarize(report)
    rows = question_rows(report)
    full = report["methods"]["full"]
    lines = [
        f"## {name}: {report['model']} in {report['model_dtype'].removeprefix('torch.')}, {report['questions']} "
        f"HotpotQA questions", "",
        f"Command: `{meta['command']}` ({meta['date']}; {meta['cpu']}; torch {meta['torch']}, {meta['threads']} threads; "
        f"{meta['wall_s'] / 60:.0f} min). Through `{meta['eval_command']}`.", "",
        f"Question format: `{report['question_format']!r}`. "
        "F1 / EM: the answer's first line against the gold answer (SQuAD/HotpotQA normalisation, HotpotQA's yes/no "
        f"rule), greedy up to the end of the turn or {report.get('max_new_tokens')} tokens; mean over questions "
        "[95% bootstrap interval]. ΔF1: against full prefill, paired per question. Speedup: HF full prefill's "
        f"median TTFT ({full['ttft_s']:.3f} s) over the method's, same run and dtype, chunk K/V read from the disk "
        f"store. Fidelity: teacher-forced top-1 agreement with full prefill over its first {report['n_tokens']} tokens.",
        "",
        "| method @ r | F1 [95% CI] | ΔF1 vs full [95% CI] | EM [95% CI] | TTFT s | speedup | fidelity | same answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, m in s.items():
        shown = {"full": "full prefill", "0": "naive reuse (r = 0)"}.get(label, label)
        lines.append(f"| {shown} | {_ci(m['f1'], m['f1_ci'])} | {_ci(m['df1'], m['df1_ci'])} | "
                     f"{_ci(m['em'], m['em_ci'])} | {m['ttft_s']:.3f} | {m['speedup']:.2f}x | {m['fidelity']:.3f} | "
                     f"{m['same_answer']:.2f} |")
    for e in report["errors"]:
        lines.append(f"\nQuestion {e['question']} not run: {e['error']}")
    lines += ["", PEERS, "", "### Questions whose F1 changes against full prefill", ""]
    changed = flips(report, rows)
    if not changed:
        lines.append("None: every method's answer scores as full prefill's on every question.")
    for q in changed:
        lines.append(f"- `{q['id']}` ({q['type']}) {q['question']} gold: **{q['gold']}**; full prefill: "
                     f"\"{_short(q['full'])}\" (F1 {q['full_f1']:.2f})")
        for m in q["methods"]:
            lines.append(f"  - {m['method']}: \"{_short(m['answer'])}\" (F1 {m['f1']:.2f}"
                         f"{', exact match flips' if m['em_flip'] else ''})")
    return "\n".join(lines) + "\n"


def _short(text: str, n: int = 120) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= n else text[: n - 3] + "..."


def plot(reports: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in reports.values()})
    fig, axes = plt.subplots(1, len(models), figsize=(max(6.5, 5.2 * len(models)), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        color = iter(f"C{i}" for i in range(100))
        for _name, rep in sorted(reports.items()):
            if rep["model"] != model:
                continue
            dtype = rep["model_dtype"].removeprefix("torch.")
            s = summarize(rep)
            full, c = s["full"], next(color)
            ax.axhspan(*full["f1_ci"], color=c, alpha=0.1)
            ax.plot([1.0], [full["f1"]], "s", color=c, label=f"full prefill ({dtype}; band: its 95% CI)")
            naive = s.get("0")
            if naive:
                ax.plot([naive["speedup"]], [naive["f1"]], "x", ms=8, color=c, label=f"naive reuse ({dtype})")
            for sel in sorted({label.split("@")[0] for label in s if "@" in label}):
                pts = sorted(((m["speedup"], m["f1"], label.split("@")[1], m["f1_ci"]) for label, m in s.items()
                              if label.startswith(sel + "@")), key=lambda p: float(p[2]))  # through the ratios
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                err = [[p[1] - p[3][0] for p in pts], [p[3][1] - p[1] for p in pts]]
                ax.errorbar(xs, ys, yerr=err, fmt="o-", ms=4, capsize=2, color=next(color), label=f"{sel} ({dtype})")
                for x, y, r, _ in pts:
                    ax.annotate(r, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        n = {r["questions"] for r in reports.values() if r["model"] == model}
        ax.set_title(f"{model} ({'/'.join(map(str, sorted(n)))} questions)", fontsize=9)
        ax.set_xlabel("TTFT speedup vs HF full prefill (same dtype)")
        ax.set_ylabel("answer F1 vs gold (95% CI)")
        ax.legend(fontsize=6)
    fig.suptitle("HotpotQA distractor dev: answer F1 vs TTFT speedup (labels: recompute ratio)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(out: Path) -> None:
    reports = {}
    for f in sorted(out.glob("qa-*.json")):
        rep = json.loads(f.read_text())
        if "meta" not in rep or not rep["methods"]:
            continue
        reports[f.stem] = rep
        (out / f"{f.stem}.md").write_text(table(f.stem, rep))
        print(f"{f.stem}: {rep['questions']} questions -> {out / (f.stem + '.md')}")
    if reports:
        plot(reports, out / "f1-vs-speedup.png")
        print(f"plot -> {out / 'f1-vs-speedup.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results"), help="folder of run_qa.py's qa-*.json")
    write_all(Path(ap.parse_args().out))


if __name__ == "__main__":
    main()
