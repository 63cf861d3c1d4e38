"""Faithfulness of blending to full prefill, measured on the user's own questions (``ragkv eval``).

For each question (``{"question", "contexts": [chunk, ...], "answer"?: str | [str], "answers"?: [str],
"type"?: str}``) and each method — full prefill, and blending with each selector at each ratio (0 =
naive reuse) — it measures:
  ttft_s     request -> first-token logits, chunk K/V in the store, loading included (median)
  agreement  share of questions whose answer equals full prefill's once both are normalised (the
             SQuAD normalisation of the scored line): what a user sees change; with a 95% interval
  fidelity   teacher-forced top-1 agreement with full prefill over the first ``n_tokens`` tokens of
             full prefill's greedy answer (1.0 for full prefill by definition)
  same_answer  share of questions whose greedy tokens equal full prefill's over those tokens;
             ``agree_tokens``: mean number of tokens before the first divergence
  div_margin at each question's first divergence, full prefill's own logit lead of its token over
             the one the method chose (the log of their probability ratio under full prefill); median
             over the diverging questions. Near 0: full prefill itself was undecided there (a near-tie
             that any small error flips); large: the method changed a decision full prefill was sure of
             (a lower bound when the method's token is not among full prefill's top ``TOP_TF``)
  kl         KL(full || method) of the first generated token's distribution, over full prefill's top
             ``TOP_FIRST`` tokens and one bin for the rest (a lower bound of the exact KL, within
             rounding of it when those tokens hold nearly all the mass)
  em, f1     answer quality against the gold answers (when the questions carry them): exact match and
             token F1 with the SQuAD / HotpotQA normalisation (``ragkv.answers``), best over the gold
             answers, mean over questions with a 95% bootstrap interval; ``delta_f1`` paired with full
             prefill per question (with its interval), and how many questions got ``worse``/``better``.
             The answer is the method's greedy continuation up to the end of the turn or
             ``max_new_tokens`` (default 64), of which the first non-empty line is scored
and the blend's time split (lookup, load, fuse/re-rotate, recompute), and the ``pareto`` front of
fidelity against TTFT. Everything is reported over all questions and per dataset (the questions'
file) and per question type (``ragkv.evalreport``). A question that cannot run (e.g. longer than the
model's window) is reported in ``errors`` and the others go on.

Every question's results are records in an ``EvalCache`` (``ragkv.evalcache``), written as soon as
they are computed: full prefill's reference once per question, model, dtype and machine, and each
method's outcome once per setting. A rerun computes only what is not there, so a killed run resumes
where it stopped and a run with one new method computes that method alone.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ragkv import answers
from ragkv._version import __version__
from ragkv.answers import Question
from ragkv.blend import BlendEngine, BlendResult
from ragkv.blend.select import Selector, make_selector, selector_label
from ragkv.evalcache import EVAL_FORMAT, EvalCache, digest, machine_id
from ragkv.evalreport import agreeing_prefix, bootstrap_ci, format_table, pareto, summarize

__all__ = ["agreeing_prefix", "bootstrap_ci", "divergence_margin", "evaluate", "format_table", "kl_divergence",
           "methods_of", "pareto", "parse_methods", "sample_questions"]

TOP_FIRST = 256  # full prefill's first-token log-probs kept for KL
TOP_TF = 16  # full prefill's teacher-forced logits kept per answer position for the divergence margin


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """The exact KL(ref || other) of two next-token distributions given as logits."""
    lp = torch.log_softmax(ref_logits.float(), -1)
    lq = torch.log_softmax(logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


def divergence_margin(ref_logits: torch.Tensor, answer: torch.Tensor, target: torch.Tensor) -> float | None:
    """Full prefill's own logit lead of its token over ``answer``'s at the first position where
    ``answer`` leaves ``target`` (full prefill's greedy answer; ``ref_logits``: its teacher-forced
    logits, ``teacher_forced_logits``), exact. None when ``answer`` follows ``target`` throughout, or
    stops before it. (``ragkv eval`` reads the same from the top logits it keeps, ``margin_from_top``.)"""
    k = agreeing_prefix(answer.tolist(), target.tolist())
    if k >= min(answer.numel(), target.numel()):
        return None
    return float((ref_logits[k, target[k]] - ref_logits[k, answer[k]]).clamp_min(0.0))


def kl_from_top(ref_top: Sequence[Sequence], logits: torch.Tensor) -> float:
    """KL(full || method) over full prefill's top tokens (``ref_top`` = [ids, log-probs]) and one bin
    for the rest of the vocabulary: a lower bound of the exact KL (merging outcomes never raises it)."""
    ids, lp = torch.tensor(ref_top[0]), torch.tensor(ref_top[1], dtype=torch.float64)
    lq_all = torch.log_softmax(logits.double().flatten(), -1)
    lq = lq_all[ids]
    kl = float((lp.exp() * (lp - lq)).sum())
    rest = torch.ones_like(lq_all, dtype=torch.bool)
    rest[ids] = False
    p_rest = 1.0 - float(lp.exp().sum())
    if rest.any() and p_rest > 1e-9:
        kl += p_rest * (math.log(p_rest) - float(torch.logsumexp(lq_all[rest], 0)))
    return max(kl, 0.0)


def top_logprobs(logits: torch.Tensor, k: int = TOP_FIRST) -> list[list]:
    """[ids, log-probs] of the ``k`` likeliest next tokens, likeliest first."""
    lp = torch.log_softmax(logits.double().flatten(), -1)
    top = torch.topk(lp, min(k, lp.numel()))
    return [top.indices.tolist(), top.values.tolist()]


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


def methods_of(selectors: Sequence[Selector | str], ratios: Sequence[float | str]) -> dict[str, tuple]:
    """label -> (selector, ratio). One selector: labelled by ratio alone ("0.15"); several:
    "<selector>@<ratio>" (the selector with its non-default settings, ``selector_label``), with ratio
    0 (naive reuse) and 1 (everything recomputed) run once."""
    sels = [make_selector(s) for s in selectors]
    if not sels:
        raise ValueError("give at least one selector")
    out: dict[str, tuple] = {}
    for r in ratios:
        shared = len(sels) == 1 or r in (0, 1)
        for sel in sels[:1] if shared else sels:
            out[_label(r) if shared else f"{selector_label(sel)}@{_label(r)}"] = (sel, r)
    return out


def parse_methods(text: str) -> dict[str, tuple]:
    """label -> (selector, ratio) from explicit methods, space-separated: ``0`` (naive reuse), ``1``
    (everything recomputed), ``<selector>@<ratio>`` with the selector as ``parse_selector`` reads it
    (``query:rows=16@0.15``). Labels are as ``methods_of`` gives them for several selectors."""
    from ragkv.blend.config import DEFAULT_SELECTOR, parse_ratio
    from ragkv.blend.select import parse_selector

    out: dict[str, tuple] = {}
    for item in text.split():
        spec, at, r = item.rpartition("@")
        ratio = parse_ratio(r, f"the ratio of method {item!r}")
        if not at:
            if ratio not in (0.0, 1.0):
                raise ValueError(f"method {item!r}: name its selector (<selector>@{r}); only 0 and 1 stand alone")
            out[_label(ratio)] = (make_selector(DEFAULT_SELECTOR), ratio)
            continue
        sel = parse_selector(spec)
        out[f"{selector_label(sel)}@{_label(ratio)}"] = (sel, ratio)
    if not out:
        raise ValueError("give at least one method")
    return out


def sample_questions(questions: Sequence[Question], n: int | None, seed: int = 0) -> list[Question]:
    """``n`` questions drawn without replacement (seeded), in their original order; all when ``n``
    is None or at least their number."""
    if n is None or n >= len(questions):
        return list(questions)
    if n < 1:
        raise ValueError(f"sample size must be >= 1, got {n}")
    keep = sorted(random.Random(seed).sample(range(len(questions)), n))
    return [questions[i] for i in keep]


def evaluate(
    engine: BlendEngine,
    questions: Sequence[Question],
    ratios: Sequence[float | str] = (0.0, 0.15, 0.3, 1.0),
    n_tokens: int = 32,
    max_new_tokens: int = 64,
    repeats: int = 1,
    progress: Callable[[int, int, bool], None] | None = None,
    selectors: Sequence[Selector | str] | None = None,
    cache: EvalCache | None = None,
    time_sequential: bool = False,
    methods: dict[str, tuple] | None = None,
) -> dict:
    """Run every method on every question; return ``{"methods": {"full": {...}, "0.15": {...}},
    "groups": {...}, ...}``. Each method generates one greedy answer per question, up to the end of
    the turn or ``max(n_tokens, max_new_tokens)`` tokens (``n_tokens`` for a question without gold
    answers): its first ``n_tokens`` are compared with full prefill's, the whole is scored against the
    gold answers. ``cache``: where records are kept (default: in memory, for this call only).
    ``progress(i, n, computed)`` after each question (``computed``: not all from the cache).
    ``time_sequential``: also time each blend with layers read in the compute thread. ``methods``:
    label -> (selector, ratio) (``parse_methods``), instead of ``selectors`` x ``ratios``."""
    if repeats < 1 or n_tokens < 1 or max_new_tokens < 1:
        raise ValueError("repeats, n_tokens and max_new_tokens must be >= 1")
    methods = methods or methods_of(selectors or [engine.config.selector], ratios)
    for selector, _ in methods.values():
        selector.check(engine.adapter.num_layers)
    cache = cache or EvalCache(None)
    n_new = max(n_tokens, max_new_tokens)  # a question without gold answers needs only n_tokens
    run = _Run(engine, methods, cache, n_tokens, repeats, time_sequential)
    errors, done = [], []
    for qi, q in enumerate(questions):
        computed = False
        try:  # a question that cannot run (too long for the model, bad text) is reported; the rest go on
            prompt = engine.build_prompt(q.question, q.contexts)
            budget = n_new if q.answers else n_tokens
            engine.adapter.check_length(prompt.num_tokens + budget)
        except ValueError as e:
            errors.append({"question": qi + 1, "dataset": q.dataset, "error": str(e)})
        else:
            writes = cache.writes
            done.append((q, prompt.num_tokens, run.question(q, prompt, budget)))
            computed = cache.writes > writes
        if progress is not None:
            progress(qi + 1, len(questions), computed)
    report = summarize(done, ["full", *methods], n_tokens, answers)
    report.update({"questions": len(done), "n_tokens": n_tokens, "max_new_tokens": n_new,
                   "question_format": engine.template.question_format, "errors": errors,
                   "method_settings": {label: [selector_label(sel), r] for label, (sel, r) in methods.items()},
                   "machine": run.ref_base["machine"], "cache": {"root": None if cache.root is None else str(cache.root),
                                                      "hits": cache.hits, "writes": cache.writes}})
    return report


class _Run:
    """One evaluation's settings and the work per question: each record read from the cache or
    computed and written at once."""

    def __init__(self, engine: BlendEngine, methods: dict, cache: EvalCache, n_tokens: int, repeats: int,
                 time_sequential: bool):
        self.engine, self.methods, self.cache = engine, methods, cache
        self.n_tokens, self.repeats, self.time_sequential = n_tokens, repeats, time_sequential
        adapter = engine.adapter
        self.ref_base = {"format": EVAL_FORMAT, "ragkv": __version__, "model": engine.keys.digest,
                         "dtype": str(adapter.dtype), "machine": machine_id(), "repeats": repeats}
        store = getattr(engine.store, "uri", type(engine.store).__name__)
        self.method_base = {"policy": engine.keys.policy_id, "lead": engine.keys.lead, "store": store,
                            "storage": repr(engine.prefiller.storage), "pipelined": engine.config.pipelined,
                            "sequential": time_sequential}

    def question(self, q: Question, prompt, budget: int) -> dict:
        rkey = digest({**self.ref_base, "ids": prompt.input_ids, "n_tokens": self.n_tokens, "n_new": budget})
        ref = self.cache.get("ref", rkey) or self.cache.put("ref", rkey, self._reference(prompt, budget))
        out, ensured = {"full": ref}, False
        for label, (selector, r) in self.methods.items():
            # (naive reuse is one method whatever selector names it: nothing is selected at ratio 0)
            mkey = digest({**self.method_base, "ref": rkey, "selector": "none" if r == 0 else repr(selector), "ratio": r})
            rec = self.cache.get("method", mkey)
            if rec is None:
                if not ensured:  # precompute what is missing: not timed
                    self.engine.ensure(q.contexts)
                    ensured = True
                rec = self.cache.put("method", mkey, self._method(prompt, selector, r, ref, budget))
            out[label] = rec
        return out

    @torch.inference_mode()
    def _reference(self, prompt, budget: int) -> dict:
        adapter, tok = self.engine.adapter, self.engine.tokenizer
        ids = torch.tensor([prompt.input_ids], device=adapter.device)
        times = []
        for _ in range(self.repeats):  # HF's own prefill, building its cache as generate would
            t0 = time.perf_counter()
            logits, kv = adapter.forward(ids, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
        first = logits[0, -1].float()
        kv.crop(-1)  # generate recomputes the last prompt token
        out = adapter.generate(ids, kv, tok, max_new_tokens=budget, do_sample=False)
        target = out[: self.n_tokens]
        adapter.truncate(kv, prompt.num_tokens - 1)  # generation appended to it
        tf = teacher_forced_logits(adapter, ids[0, -1:], kv, target)
        top = torch.topk(tf, min(TOP_TF, tf.shape[-1]), dim=-1)
        return {"times": times, "ids": out.tolist(), "text": _text(tok, out), "first": top_logprobs(first),
                "tf": [[i, [round(v, 4) for v in vals]] for i, vals in zip(top.indices.tolist(), top.values.tolist())],
                "prompt_tokens": prompt.num_tokens}

    def _method(self, prompt, selector: Selector, r, ref: dict, budget: int) -> dict:
        engine = self.engine
        eng = engine if selector == engine.config.selector else engine.with_config(selector=selector)
        adapter, tok = engine.adapter, engine.tokenizer
        runs = [eng.prefill_prompt(prompt, ratio=r) for _ in range(self.repeats)]
        res = runs[-1]
        split = {k: statistics.median(getattr(x.stats, f"t_{k}") for x in runs)
                 for k in ("lookup", "load", "load_io", "fuse", "compute")}
        if self.time_sequential and eng.config.pipelined:  # the same request with layers read in the compute thread
            sequential = eng.with_config(pipelined=False)
            split["ttft_sequential"] = statistics.median(
                sequential.prefill_prompt(prompt, ratio=r).stats.t_total for _ in range(self.repeats))
        with torch.inference_mode():
            answer = adapter.generate(res.input_ids, res.cache, tok, max_new_tokens=budget, do_sample=False)
            adapter.truncate(res.cache, prompt.num_tokens - 1)  # generation appended to it; teacher forcing starts over
            target = torch.tensor(ref["ids"][: self.n_tokens], dtype=torch.long, device=adapter.device)
            fidelity = teacher_forced_agreement(adapter, res, target)
        return {"times": [x.stats.t_total for x in runs], "ids": answer.tolist(), "text": _text(tok, answer),
                "fidelity": fidelity, "kl": kl_from_top(ref["first"], res.logits),
                "split": split, "recomputed": res.stats.recomputed_tokens, "ratio": res.stats.ratio}


def _text(tok, ids: torch.Tensor) -> str:
    return answers.answer_text(tok.decode(ids, skip_special_tokens=True)) if tok is not None else ""


def _label(r: float | str) -> str:
    return r if isinstance(r, str) else f"{r:g}"
