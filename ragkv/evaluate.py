"""Faithfulness of blending to full prefill, measured on the user's own questions (``ragkv eval``).

For each question (``{"question", "contexts": [chunk, ...], "answer"?}``) and each method — full
prefill, and blending at each ratio (0 = naive reuse) — it measures:
  ttft_s    request -> first-token logits, chunk K/V in the store, loading included (median)
  fidelity  teacher-forced top-1 agreement with full prefill over the first ``n_tokens`` tokens of
            full prefill's greedy answer (1.0 for full prefill by definition)
  kl        KL(full || method) of the first generated token's distribution
  f1        token F1 of the method's greedy answer against ``answer`` (when given)
and the blend's time split (lookup, load, fuse/re-rotate, recompute).
"""

from __future__ import annotations

import json
import re
import statistics
import string
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from ragkv.blend import BlendEngine, BlendResult


@dataclass
class Question:
    question: str
    contexts: list[str]
    answer: str | None = None


def load_questions(path: str | Path) -> list[Question]:
    """Read a JSONL file of questions; every malformed line is an error naming the line."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected an object with 'question' and 'contexts'")
        q, ctx, ans = row.get("question"), row.get("contexts"), row.get("answer")
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{path}:{n}: 'question' must be a non-empty string")
        if not isinstance(ctx, list) or not ctx or not all(isinstance(c, str) and c.strip() for c in ctx):
            raise ValueError(f"{path}:{n}: 'contexts' must be a non-empty list of non-empty strings")
        if ans is not None and not isinstance(ans, str):
            raise ValueError(f"{path}:{n}: 'answer' must be a string when given")
        out.append(Question(q, ctx, ans))
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def _normalize(text: str) -> list[str]:
    text = text.lower()
    text = "".join(c for c in text if c not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(prediction: str, reference: str) -> float:
    p, r = _normalize(prediction), _normalize(reference)
    common = Counter(p) & Counter(r)
    same = sum(common.values())
    if not p or not r or same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(r)
    return 2 * prec * rec / (prec + rec)


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    lp = torch.log_softmax(ref_logits.float(), -1)
    lq = torch.log_softmax(logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


@torch.inference_mode()
def teacher_forced_agreement(model, res: BlendResult, target: torch.Tensor) -> float:
    """Fraction of positions where the method's greedy choice equals ``target`` (full prefill's greedy
    answer), feeding ``target`` itself as the continuation. Consumes ``res.cache``."""
    if target.numel() == 0:
        return 1.0
    ids = torch.cat([res.input_ids[0, -1:], target[:-1]])[None]
    past = res.cache.get_seq_length()
    out = model(ids, cache=res.cache, use_cache=True,
                position_ids=torch.arange(past, past + ids.shape[1], device=ids.device)[None])
    pred = out.logits[0].argmax(-1)
    return float((pred == target).float().mean())


@dataclass
class MethodStats:
    ttft_s: list[float] = field(default_factory=list)
    fidelity: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    f1: list[float] = field(default_factory=list)
    split: dict[str, list[float]] = field(default_factory=dict)
    recomputed: list[int] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        d = {
            "ttft_s": statistics.median(self.ttft_s),
            "fidelity": statistics.fmean(self.fidelity),
            "kl": statistics.fmean(self.kl),
        }
        if self.f1:
            d["f1"] = statistics.fmean(self.f1)
        for k, v in self.split.items():
            d[f"{k}_s"] = statistics.median(v)
        if self.recomputed:
            d["recomputed_tokens"] = statistics.fmean(self.recomputed)
            d["ratio"] = statistics.fmean(self.ratio)
        return d


def evaluate(
    engine: BlendEngine,
    questions: Sequence[Question],
    ratios: Sequence[float | str] = (0.0, 0.15, 0.3, 1.0),
    n_tokens: int = 32,
    max_new_tokens: int = 32,
    repeats: int = 1,
    progress=None,
) -> dict:
    """Run every method on every question; return ``{"methods": {"full": {...}, "0.15": {...}}, ...}``."""
    model = engine.model
    methods = {"full": MethodStats(), **{_label(r): MethodStats() for r in ratios}}
    for qi, q in enumerate(questions):
        engine.ensure(q.contexts)  # precompute what is missing: not timed
        prompt = engine.build_prompt(q.question, q.contexts)
        ids = torch.tensor([prompt.input_ids], device=engine.adapter.device)
        engine.adapter.check_length(ids.shape[1] + max_new_tokens)
        times = []
        with torch.inference_mode():
            for _ in range(repeats):  # HF's own prefill, building its cache as generate would
                t0 = time.perf_counter()
                cache = DynamicCache(config=model.config)
                full_logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()
                times.append(time.perf_counter() - t0)
            cache.crop(-1)  # generate recomputes the last prompt token
            full_out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                                      max_new_tokens=max(n_tokens, max_new_tokens), do_sample=False,
                                      temperature=None, top_p=None, top_k=None,
                                      pad_token_id=engine.pad_token_id)[0, ids.shape[1]:]
        target = full_out[:n_tokens]
        m = methods["full"]
        m.ttft_s.append(statistics.median(times))
        m.fidelity.append(1.0)
        m.kl.append(0.0)
        if q.answer is not None:
            m.f1.append(token_f1(engine.tokenizer.decode(full_out[:max_new_tokens], skip_special_tokens=True), q.answer))
        for r in ratios:
            m = methods[_label(r)]
            runs = [engine.prefill_prompt(prompt, ratio=r) for _ in range(repeats)]
            res = runs[-1]
            m.ttft_s.append(statistics.median(x.stats.t_total for x in runs))
            for k in ("lookup", "load", "load_io", "fuse", "compute"):
                m.split.setdefault(k, []).append(statistics.median(getattr(x.stats, f"t_{k}") for x in runs))
            if engine.config.pipelined:  # the same request with layers read in the compute thread
                sequential = engine.with_config(pipelined=False)
                seq = [sequential.prefill_prompt(prompt, ratio=r).stats.t_total for _ in range(repeats)]
                m.split.setdefault("ttft_sequential", []).append(statistics.median(seq))
            m.recomputed.append(res.stats.recomputed_tokens)
            m.ratio.append(res.stats.ratio)
            m.kl.append(kl_divergence(full_logits, res.logits))
            if q.answer is not None:
                gen = engine.generate_from(engine.prefill_prompt(prompt, ratio=r), max_new_tokens=max_new_tokens)
                m.f1.append(token_f1(engine.tokenizer.decode(gen, skip_special_tokens=True), q.answer))
            m.fidelity.append(teacher_forced_agreement(model, res, target))
        if progress is not None:
            progress(qi + 1, len(questions))
    return {
        "questions": len(questions),
        "n_tokens": n_tokens,
        "methods": {name: st.summary() for name, st in methods.items()},
    }


def _label(r: float | str) -> str:
    return r if isinstance(r, str) else f"{r:g}"


def format_table(report: dict) -> str:
    full = report["methods"]["full"]["ttft_s"]
    has_f1 = any("f1" in m for m in report["methods"].values())
    head = f"{'method':>8} {'ttft_s':>8} {'speedup':>8} {'fidelity':>9} {'kl':>8}" + (f" {'f1':>6}" if has_f1 else "")
    head += f" {'load_s':>7} {'fuse_s':>7} {'recomp_s':>8} {'seq_ttft':>8}"
    lines = [head, "-" * len(head)]
    for name, m in report["methods"].items():
        row = f"{name:>8} {m['ttft_s']:8.3f} {full / m['ttft_s']:7.2f}x {m['fidelity']:9.3f} {m['kl']:8.4f}"
        if has_f1:
            row += f" {m.get('f1', float('nan')):6.3f}"
        row += "".join(f" {m.get(k, float('nan')):{w}.3f}" for k, w in (("load_s", 7), ("fuse_s", 7), ("compute_s", 8),
                                                                   ("ttft_sequential_s", 8)))
        lines.append(row)
    return "\n".join(lines)
