"""Faithfulness of blending to full prefill, measured on the user's own questions (``ragkv eval``).

For each question (``{"question", "contexts": [chunk, ...], "answer"?: str | [str], "answers"?: [str]}``)
and each method — full prefill, and blending with each selector at each ratio (0 = naive reuse) — it
measures:
  ttft_s     request -> first-token logits, chunk K/V in the store, loading included (median)
  fidelity   teacher-forced top-1 agreement with full prefill over the first ``n_tokens`` tokens of
             full prefill's greedy answer (1.0 for full prefill by definition)
  same_answer  share of questions whose free-running greedy answer equals full prefill's over those
             tokens; ``agree_tokens``: mean number of tokens before the first divergence
  div_margin at each question's first divergence, full prefill's own logit lead of its token over
             the one the method chose (the log of their probability ratio under full prefill); median
             over the diverging questions. Near 0: full prefill itself was undecided there (a near-tie
             that any small error flips); large: the method changed a decision full prefill was sure of
  kl         KL(full || method) of the first generated token's distribution
  em, f1     answer quality against the gold answers (when the questions carry them): exact match and
             token F1 with the SQuAD / HotpotQA normalisation (``ragkv.answers``), best over the gold
             answers, mean over questions with a 95% bootstrap interval (``em_ci``, ``f1_ci``). The
             answer is the method's greedy continuation up to the end of the turn (the model's EOS /
             end-of-turn token) or ``max_new_tokens`` (default 64), of which the first non-empty line
             is scored (``answers.answer_text``); each question's text is in ``per_question.answer``
and the blend's time split (lookup, load, fuse/re-rotate, recompute), and the ``pareto`` front of
fidelity against TTFT over the methods: which selector and ratio to run on this machine and data
(the fastest selection differs with the CPU and the dtype). A question that cannot run (e.g. longer
than the model's window) is reported in ``errors`` and the others go on.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ragkv import answers
from ragkv.answers import Question
from ragkv.blend import BlendEngine, BlendResult
from ragkv.blend.select import Selector, make_selector


def bootstrap_ci(values: Sequence[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean, resampling questions with replacement (seeded)."""
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    lp = torch.log_softmax(ref_logits.float(), -1)
    lq = torch.log_softmax(logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


@torch.inference_mode()
def teacher_forced_logits(adapter, last_id: torch.Tensor, cache, target: torch.Tensor) -> torch.Tensor:
    """Next-token logits [len(target), vocab] at every answer position, feeding ``target`` itself as
    the continuation of a prompt whose last token ``last_id`` ([1]) is not yet in ``cache``. Consumes
    ``cache``."""
    ids = torch.cat([last_id, target[:-1]])[None]
    past = cache.get_seq_length()
    logits, _ = adapter.forward(ids, cache, torch.arange(past, past + ids.shape[1], device=ids.device)[None])
    return logits[0].float()


def teacher_forced_agreement(adapter, res: BlendResult, target: torch.Tensor) -> float:
    """Fraction of positions where the method's greedy choice equals ``target`` (full prefill's greedy
    answer), feeding ``target`` itself as the continuation. Consumes ``res.cache``."""
    if target.numel() == 0:
        return 1.0
    logits = teacher_forced_logits(adapter, res.input_ids[0, -1:], res.cache, target)
    return float((logits.argmax(-1) == target).float().mean())


def divergence_margin(ref_logits: torch.Tensor, answer: torch.Tensor, target: torch.Tensor) -> float | None:
    """Full prefill's own logit lead of its token over ``answer``'s at the first position where
    ``answer`` leaves ``target`` (full prefill's greedy answer; ``ref_logits``: its teacher-forced
    logits, ``teacher_forced_logits``). None when ``answer`` follows ``target`` throughout, or stops
    before it (there is no second token to compare)."""
    k = agreeing_prefix(answer, target)
    if k >= min(answer.numel(), target.numel()):
        return None
    lead = ref_logits[k, target[k]] - ref_logits[k, answer[k]]
    return float(lead.clamp_min(0.0))  # target is full prefill's argmax there: >= 0 but for rounding


def agreeing_prefix(answer: torch.Tensor, target: torch.Tensor) -> int:
    """Number of leading tokens of ``answer`` equal to ``target`` (at most len(target))."""
    n = min(answer.numel(), target.numel())
    diff = (answer[:n] != target[:n]).nonzero()
    return int(diff[0, 0]) if diff.numel() else n


@dataclass
class MethodStats:
    ttft_s: list[float] = field(default_factory=list)
    fidelity: list[float] = field(default_factory=list)
    same_answer: list[float] = field(default_factory=list)
    agree_tokens: list[int] = field(default_factory=list)
    div_margin: list[float | None] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    em: list[float | None] = field(default_factory=list)  # None: the question has no gold answer
    f1: list[float | None] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    split: dict[str, list[float]] = field(default_factory=dict)
    recomputed: list[int] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        d = {"ttft_s": statistics.median(self.ttft_s), "fidelity": statistics.fmean(self.fidelity),
             "same_answer": statistics.fmean(self.same_answer), "agree_tokens": statistics.fmean(self.agree_tokens),
             "kl": statistics.fmean(self.kl)}
        leads = [m for m in self.div_margin if m is not None]
        d["div_margin"] = statistics.median(leads) if leads else None
        d["fidelity_ci"] = bootstrap_ci(self.fidelity)
        for name in ("em", "f1"):
            scored = [x for x in getattr(self, name) if x is not None]
            if scored:
                d[name], d[f"{name}_ci"] = statistics.fmean(scored), bootstrap_ci(scored)
        for k, v in self.split.items():
            d[f"{k}_s"] = statistics.median(v)
        if self.recomputed:
            d["recomputed_tokens"] = statistics.fmean(self.recomputed)
            d["ratio"] = statistics.fmean(self.ratio)
        d["per_question"] = {"fidelity": list(self.fidelity), "same_answer": list(self.same_answer),
                             "div_margin": list(self.div_margin), "ttft_s": list(self.ttft_s),
                             "em": list(self.em), "f1": list(self.f1), "answer": list(self.answer)}
        return d


def methods_of(selectors: Sequence[Selector | str], ratios: Sequence[float | str]) -> dict[str, tuple]:
    """label -> (selector, ratio). One selector: labelled by ratio alone ("0.15"); several:
    "<selector>@<ratio>", with ratio 0 (naive reuse) and 1 (everything recomputed) run once."""
    sels = [make_selector(s) for s in selectors]
    if not sels:
        raise ValueError("give at least one selector")
    out: dict[str, tuple] = {}
    for r in ratios:
        shared = len(sels) == 1 or r in (0, 1)
        for sel in sels[:1] if shared else sels:
            out[_label(r) if shared else f"{sel.name}@{_label(r)}"] = (sel, r)
    return out


def evaluate(
    engine: BlendEngine,
    questions: Sequence[Question],
    ratios: Sequence[float | str] = (0.0, 0.15, 0.3, 1.0),
    n_tokens: int = 32,
    max_new_tokens: int = 64,
    repeats: int = 1,
    progress=None,
    selectors: Sequence[Selector | str] | None = None,
) -> dict:
    """Run every method on every question; return ``{"methods": {"full": {...}, "0.15": {...}}, ...}``.
    Each method generates one greedy answer per question, up to the end of the turn or
    ``max(n_tokens, max_new_tokens)`` tokens (``n_tokens`` for a question without gold answers): its
    first ``n_tokens`` are compared with full prefill's, the whole is scored against the gold answers."""
    if repeats < 1 or n_tokens < 1 or max_new_tokens < 1:
        raise ValueError("repeats, n_tokens and max_new_tokens must be >= 1")
    methods = methods_of(selectors or [engine.config.selector], ratios)
    for selector, _ in methods.values():
        selector.check(engine.adapter.num_layers)
    stats = {"full": MethodStats(), **{label: MethodStats() for label in methods}}
    errors, prompt_tokens = [], []
    n_new = max(n_tokens, max_new_tokens)  # a question without gold answers needs only n_tokens
    for qi, q in enumerate(questions):
        try:  # a question that cannot run (too long for the model, bad text) is reported; the rest go on
            prompt = engine.build_prompt(q.question, q.contexts)
            engine.adapter.check_length(prompt.num_tokens + (n_new if q.answers else n_tokens))
        except ValueError as e:
            errors.append({"question": qi + 1, "error": str(e)})
        else:
            prompt_tokens.append(prompt.num_tokens)
            _evaluate_one(engine, q, prompt, methods, stats, n_tokens, n_new if q.answers else n_tokens, repeats)
        if progress is not None:
            progress(qi + 1, len(questions))
    done = len(questions) - len(errors)
    summaries = {name: st.summary() for name, st in stats.items()} if done else {}
    return {
        "questions": done,
        "n_tokens": n_tokens,
        "max_new_tokens": n_new,
        "question_format": engine.template.question_format,
        "prompt_tokens": prompt_tokens,
        "errors": errors,
        "methods": summaries,
        "pareto": pareto(summaries),
    }


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


def _evaluate_one(engine: BlendEngine, q: Question, prompt, methods: dict, stats: dict, n_tokens: int, n_new: int,
                  repeats: int) -> None:
    adapter, tok = engine.adapter, engine.tokenizer
    gen = {"max_new_tokens": n_new, "do_sample": False}  # up to a stop id (ragkv.decode.generation_kwargs)
    engine.ensure(q.contexts)  # precompute what is missing: not timed
    ids = torch.tensor([prompt.input_ids], device=adapter.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):  # HF's own prefill, building its cache as generate would
            t0 = time.perf_counter()
            logits, cache = adapter.forward(ids, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
        full_logits = logits[0, -1].float()
        cache.crop(-1)  # generate recomputes the last prompt token
        full_out = adapter.generate(ids, cache, tok, **gen)
    target = full_out[:n_tokens]
    adapter.truncate(cache, prompt.num_tokens - 1)  # generation appended to it
    ref_logits = teacher_forced_logits(adapter, ids[0, -1:], cache, target)  # full prefill's, for div_margin
    _record(stats["full"], q, tok, times, 1.0, target, target, 0.0, full_out, ref_logits)
    for label, (selector, r) in methods.items():
        eng = engine if selector == engine.config.selector else engine.with_config(selector=selector)
        runs = [eng.prefill_prompt(prompt, ratio=r) for _ in range(repeats)]
        res, m = runs[-1], stats[label]
        for k in ("lookup", "load", "load_io", "fuse", "compute"):
            m.split.setdefault(k, []).append(statistics.median(getattr(x.stats, f"t_{k}") for x in runs))
        if eng.config.pipelined:  # the same request with layers read in the compute thread
            sequential = eng.with_config(pipelined=False)
            seq = [sequential.prefill_prompt(prompt, ratio=r).stats.t_total for _ in range(repeats)]
            m.split.setdefault("ttft_sequential", []).append(statistics.median(seq))
        m.recomputed.append(res.stats.recomputed_tokens)
        m.ratio.append(res.stats.ratio)
        answer = adapter.generate(res.input_ids, res.cache, tok, **gen)
        adapter.truncate(res.cache, prompt.num_tokens - 1)  # generation appended to it; teacher forcing starts over
        fidelity = teacher_forced_agreement(adapter, res, target)
        _record(m, q, tok, [x.stats.t_total for x in runs], fidelity, answer, target,
                kl_divergence(full_logits, res.logits), answer, ref_logits)


def _record(m: MethodStats, q: Question, tok, times, fidelity, answer, target, kl, generated, ref_logits) -> None:
    m.ttft_s.append(statistics.median(times))
    m.fidelity.append(fidelity)
    answer = answer[: target.numel()]
    agree = agreeing_prefix(answer, target)
    m.agree_tokens.append(agree)
    m.same_answer.append(float(agree == target.numel()))
    m.div_margin.append(divergence_margin(ref_logits, answer, target))
    m.kl.append(kl)
    text = answers.answer_text(tok.decode(generated, skip_special_tokens=True)) if tok is not None else ""
    m.answer.append(text)
    m.em.append(answers.best(answers.exact_match, text, q.answers) if q.answers else None)
    m.f1.append(answers.best(answers.token_f1, text, q.answers) if q.answers else None)


def _label(r: float | str) -> str:
    return r if isinstance(r, str) else f"{r:g}"


def format_table(report: dict) -> str:
    if not report["methods"]:
        return "no question could be evaluated"
    full = report["methods"]["full"]["ttft_s"]
    has_f1 = any("f1" in m for m in report["methods"].values())
    width = max(8, *(len(k) for k in report["methods"]))
    head = (f"{'method':>{width}} {'ttft_s':>8} {'speedup':>8} {'fidelity':>9} {'same_ans':>8} {'agree':>6}"
            f" {'div_mrg':>7} {'kl':>8}"
            + (f" {'em':>5} {'f1 [95% CI]':>18}" if has_f1 else ""))
    head += f" {'load_s':>7} {'fuse_s':>7} {'recomp_s':>8} {'seq_ttft':>8}"
    lines = [head, "-" * len(head)]
    for name, m in report["methods"].items():
        row = (f"{name:>{width}} {m['ttft_s']:8.3f} {full / m['ttft_s']:7.2f}x {m['fidelity']:9.3f} "
               f"{m['same_answer']:8.2f} {m['agree_tokens']:6.1f} {_num(m['div_margin'], 7, 2)} {m['kl']:8.4f}")
        if has_f1:
            lo, hi = m["f1_ci"]
            row += f" {m['em']:5.3f} {m['f1']:5.3f} [{lo:.3f}, {hi:.3f}]"
        row += "".join(f" {m.get(k, float('nan')):{w}.3f}" for k, w in (("load_s", 7), ("fuse_s", 7), ("compute_s", 8),
                                                                   ("ttft_sequential_s", 8)))
        lines.append(row)
    for e in report.get("errors", []):
        lines.append(f"question {e['question']} skipped: {e['error']}")
    lines.append("div_mrg: at the first divergence, full prefill's own logit lead of its token over the method's "
                 "(median; near 0 = a near-tie full prefill itself barely decided; - = no divergence)")
    if has_f1:
        lines.append(f"em/f1: the answer's first line against the gold answers (SQuAD/HotpotQA normalisation), "
                     f"mean over questions, 95% bootstrap interval; greedy answers end at the end of the turn or "
                     f"{report.get('max_new_tokens', '?')} tokens")
    best = pareto(report["methods"])
    lines.append("pareto front (fastest first; no other method both faster and as faithful): "
                 + ", ".join(best["front"]))
    if best["dominated"]:
        lines.append("dominated: " + ", ".join(f"{name} (by {by})" for name, by in best["dominated"].items()))
    return "\n".join(lines)


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}f}"
