"""Answer quality against gold answers: the SQuAD / HotpotQA metrics, in one place.

    answer_text(generated)      the answer scored: the first non-empty line of the generated text,
                                stripped, without a leading "Answer:" label
    normalize_answer(text)      SQuAD's normalisation: lower case, punctuation removed, the articles
                                a / an / the removed, whitespace collapsed
    exact_match(pred, gold)     1.0 when the normalised strings are equal
    token_f1(pred, gold)        F1 over the normalised tokens (bag of words); HotpotQA's special case:
                                when either side normalises to yes / no / noanswer and they differ, 0.
                                Both empty: 1.0; one empty: 0.0 (SQuAD v2)
    best(metric, pred, golds)   the maximum over several gold answers (SQuAD's rule)

These follow the official evaluation scripts (SQuAD v1.1 ``evaluate-v1.1.py``, HotpotQA
``hotpot_evaluate_v1.py``), so scores compare with published ones.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_LABEL = re.compile(r"^\s*answer\s*:\s*", re.IGNORECASE)
_SPECIAL = ("yes", "no", "noanswer")


def answer_text(generated: str) -> str:
    """The part of a generated answer that is scored: its first non-empty line, stripped, without a
    leading "Answer:" label (what a model adds after a "Question: ..." prompt). The rest (an
    explanation on later lines, the end-of-turn token) is not scored."""
    for line in generated.splitlines():
        line = _LABEL.sub("", line).strip()
        if line:
            return line
    return ""


def normalize_answer(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction), normalize_answer(gold)
    if (p in _SPECIAL or g in _SPECIAL) and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    if not pt or not gt:
        return float(pt == gt)
    same = sum((Counter(pt) & Counter(gt)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pt), same / len(gt)
    return 2 * precision * recall / (precision + recall)


def best(metric: Callable[[str, str], float], prediction: str, golds: Sequence[str]) -> float:
    """``metric`` against the closest of several gold answers."""
    if not golds:
        raise ValueError("no gold answer to score against")
    return max(metric(prediction, g) for g in golds)
