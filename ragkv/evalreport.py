"""``ragkv eval``'s report from its per-question records (``ragkv.evaluate``): each method's figures
over all questions and per dataset and per question type, with 95% bootstrap intervals, the Pareto
front, and the text table.

Per method and group: ``agreement`` (the answer equals full prefill's once normalised), F1 and EM
against the gold answers, ``delta_f1`` paired with full prefill per question, how many questions got
``worse`` / ``better`` than full prefill (by F1), teacher-forced ``fidelity``, median TTFT and the
``speedup`` (full prefill's median TTFT over the method's, in the same group).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def bootstrap_ci(values: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean, resampling questions with replacement (seeded)."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def agreeing_prefix(answer: Sequence[int], target: Sequence[int]) -> int:
    """Number of leading tokens of ``answer`` equal to ``target`` (at most len(target))."""
    n = min(len(answer), len(target))
    return next((i for i in range(n) if answer[i] != target[i]), n)


def margin_from_top(tf_top: Sequence, answer: Sequence[int], target: Sequence[int]) -> float | None:
    """Full prefill's logit lead of its token over ``answer``'s at the first position where ``answer``
    leaves ``target`` (full prefill's greedy answer), read from its top teacher-forced logits there
    (``tf_top[k]`` = [ids, logits], best first). None when ``answer`` follows ``target`` throughout or
    stops before it. A token outside the kept top gives the lead over the last kept one: a lower bound."""
    k = agreeing_prefix(answer, target)
    if k >= min(len(answer), len(target)):
        return None
    ids, vals = tf_top[k]
    mine = vals[ids.index(target[k])] if target[k] in ids else vals[0]
    other = vals[ids.index(answer[k])] if answer[k] in ids else vals[-1]
    return max(0.0, mine - other)


def _per_question(q, ref: dict, rec: dict, n_tokens: int, answers) -> dict:
    """One method's figures on one question (``rec`` is ``ref`` itself for full prefill)."""
    target = ref["ids"][:n_tokens]
    is_ref = rec is ref
    mine = rec["ids"][:n_tokens]
    agree = agreeing_prefix(mine, target)
    text = rec["text"]
    row = {"ttft_s": statistics.median(rec["times"]), "fidelity": 1.0 if is_ref else rec["fidelity"],
           "agree_tokens": agree, "same_answer": float(agree == len(target)),
           "div_margin": None if is_ref else margin_from_top(ref["tf"], mine, target),
           "kl": 0.0 if is_ref else rec["kl"], "answer": text,
           "agreement": float(answers.normalize_answer(text) == answers.normalize_answer(ref["text"]))}
    row["em"] = answers.best(answers.exact_match, text, q.answers) if q.answers else None
    row["f1"] = answers.best(answers.token_f1, text, q.answers) if q.answers else None
    if not is_ref:
        row["split"], row["recomputed"], row["ratio"] = rec["split"], rec["recomputed"], rec["ratio"]
    return row


def _group(rows: list[dict], full_rows: list[dict], per_question: bool) -> dict:
    """One method's summary over one group of questions (``full_rows``: full prefill's, same order)."""
    col = {k: [r[k] for r in rows] for k in rows[0] if k not in ("split",)}
    d = {"n": len(rows), "ttft_s": statistics.median(col["ttft_s"]),
         "speedup": statistics.median(r["ttft_s"] for r in full_rows) / statistics.median(col["ttft_s"]),
         "fidelity": statistics.fmean(col["fidelity"]), "fidelity_ci": bootstrap_ci(col["fidelity"]),
         "agreement": statistics.fmean(col["agreement"]), "agreement_ci": bootstrap_ci(col["agreement"]),
         "same_answer": statistics.fmean(col["same_answer"]), "agree_tokens": statistics.fmean(col["agree_tokens"]),
         "kl": statistics.fmean(col["kl"])}
    leads = [m for m in col["div_margin"] if m is not None]
    d["div_margin"] = statistics.median(leads) if leads else None
    for name in ("em", "f1"):
        scored = [x for x in col[name] if x is not None]
        if scored:
            d[name], d[f"{name}_ci"] = statistics.fmean(scored), bootstrap_ci(scored)
    pairs = [(r["f1"], f["f1"]) for r, f in zip(rows, full_rows) if r["f1"] is not None]
    if pairs:
        diff = [a - b for a, b in pairs]
        d["delta_f1"], d["delta_f1_ci"] = statistics.fmean(diff), bootstrap_ci(diff)
        d["worse"], d["better"] = sum(x < 0 for x in diff), sum(x > 0 for x in diff)
    if "split" in rows[0]:
        for k in rows[0]["split"]:
            d[f"{k}_s"] = statistics.median(r["split"][k] for r in rows)
        d["recomputed_tokens"] = statistics.fmean(col["recomputed"])
        d["ratio"] = statistics.fmean(col["ratio"])
    if per_question:
        d["per_question"] = {k: col[k] for k in ("fidelity", "same_answer", "agreement", "div_margin", "ttft_s",
                                                 "em", "f1", "answer")}
    return d


def summarize(done: Sequence[tuple], labels: Sequence[str], n_tokens: int, answers) -> dict:
    """``done``: (question, prompt tokens, {label: record}) per question that ran -> the report's
    ``methods`` (all questions, with per-question lists), ``groups`` (per dataset, and per dataset and
    type: method -> summary), ``pareto`` and ``per_question`` (dataset, type, id of each)."""
    if not done:
        return {"methods": {}, "groups": {}, "pareto": pareto({}), "per_question": [], "prompt_tokens": []}
    rows = {label: [_per_question(q, recs["full"], recs[label], n_tokens, answers) for q, _, recs in done]
            for label in labels}
    methods = {label: _group(rows[label], rows["full"], True) for label in labels}
    members: dict[str, list[int]] = {}
    for i, (q, _, _) in enumerate(done):
        members.setdefault(q.dataset or "questions", []).append(i)
        if q.type:
            members.setdefault(f"{q.dataset or 'questions'}/{q.type}", []).append(i)
    groups = {name: {label: _group([rows[label][i] for i in idx], [rows["full"][i] for i in idx], False)
                     for label in labels} for name, idx in sorted(members.items())}
    return {"methods": methods, "groups": groups, "pareto": pareto(methods),
            "prompt_tokens": [n for _, n, _ in done],
            "per_question": [{"dataset": q.dataset, "type": q.type, "id": q.id} for q, _, _ in done]}


def pareto(methods: dict[str, dict]) -> dict:
    """Which methods are worth running on these questions and this machine: the ``front`` (fastest
    first) holds every method that no other one beats on TTFT and fidelity at once; each other
    method is ``dominated`` by the most faithful of those at least as fast and as faithful (one of
    the two strictly). Full prefill takes part, so a blend slower than it is dominated too. Read on
    the medians of this run: with few questions, a difference of one token in one answer moves it."""
    items = [(name, m["ttft_s"], m["fidelity"]) for name, m in methods.items()]
    front, dominated = [], {}
    for name, t, f in items:
        better = [(o, ot, of) for o, ot, of in items if ot <= t and of >= f and (ot < t or of > f)]
        if better:
            dominated[name] = max(better, key=lambda x: (x[2], -x[1]))[0]
        else:
            front.append((t, name))
    return {"front": [name for _, name in sorted(front)], "dominated": dominated}


def format_table(report: dict) -> str:
    if not report["methods"]:
        return "no question could be evaluated"
    methods = report["methods"]
    has_f1 = any("f1" in m for m in methods.values())
    width = max(8, *(len(k) for k in methods))
    head = (f"{'method':>{width}} {'ttft_s':>8} {'speedup':>8} {'agree':>5} {'fidelity':>9} {'same_tok':>8}"
            f" {'div_mrg':>7} {'kl':>8}" + (f" {'em':>5} {'f1 [95% CI]':>18} {'dF1 [95% CI]':>22} {'w/b':>7}"
                                               if has_f1 else ""))
    head += f" {'load_s':>7} {'fuse_s':>7} {'recomp_s':>8}"
    lines = [head, "-" * len(head)]
    for name, m in methods.items():
        row = (f"{name:>{width}} {m['ttft_s']:8.3f} {m['speedup']:7.2f}x {m['agreement']:5.2f} {m['fidelity']:9.3f} "
               f"{m['same_answer']:8.2f} {_num(m['div_margin'], 7, 2)} {m['kl']:8.4f}")
        if has_f1:
            lo, hi = m["f1_ci"]
            row += f" {m['em']:5.3f} {m['f1']:5.3f} [{lo:.3f}, {hi:.3f}]"
            if name == "full":
                row += f" {'':>22} {'':>7}"
            else:
                dlo, dhi = m["delta_f1_ci"]
                row += f" {m['delta_f1']:+6.3f} [{dlo:+.3f}, {dhi:+.3f}] {m['worse']:>3}/{m['better']:<3}"
        row += "".join(f" {m.get(k, float('nan')):{w}.3f}" for k, w in (("load_s", 7), ("fuse_s", 7), ("compute_s", 8)))
        lines.append(row)
    groups = report.get("groups", {})
    if len(groups) > 1:
        lines += ["", f"{'group':<32} {'method':>{width}} {'n':>4} {'agree [95% CI]':>19} {'f1':>6} {'dF1':>7} "
                      f"{'w/b':>7} {'speedup':>8}"]
        for gname, ms in groups.items():
            for name, m in ms.items():
                lo, hi = m["agreement_ci"]
                row = f"{gname:<32} {name:>{width}} {m['n']:>4} {m['agreement']:5.2f} [{lo:.2f}, {hi:.2f}]"
                row += f" {m['f1']:6.3f}" if "f1" in m else f" {'-':>6}"
                row += (f" {m['delta_f1']:+7.3f} {m['worse']:>3}/{m['better']:<3}" if "delta_f1" in m and name != "full"
                        else f" {'':>7} {'':>7}")
                lines.append(row + f" {m['speedup']:7.2f}x")
    for e in report.get("errors", []):
        lines.append(f"question {e['question']} skipped ({e.get('dataset', '')}): {e['error']}")
    lines.append("agree: the answer equals full prefill's once normalised (SQuAD); same_tok: the first "
                 f"{report.get('n_tokens', '?')} greedy tokens equal full prefill's; div_mrg: at the first divergence, "
                 "full prefill's own logit lead of its token over the method's (median; near 0 = a near-tie)")
    if has_f1:
        lines.append(f"em/f1: the answer's first line against the gold answers (SQuAD/HotpotQA normalisation), "
                     f"mean over questions, 95% bootstrap interval; dF1 paired with full prefill; w/b: questions "
                     f"worse/better than full prefill; answers end at the end of the turn or "
                     f"{report.get('max_new_tokens', '?')} tokens")
    best = pareto(methods)
    lines.append("pareto front (fastest first; no other method both faster and as faithful): "
                 + ", ".join(best["front"]))
    if best["dominated"]:
        lines.append("dominated: " + ", ".join(f"{name} (by {by})" for name, by in best["dominated"].items()))
    return "\n".join(lines)


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}f}"
