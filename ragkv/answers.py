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
    load_questions(path)        ``ragkv eval``'s questions: JSONL ``{"question", "contexts": [chunk, ...],
                                "answer"?: str | [str], "answers"?: [str], "id"?: str, "type"?: str}``,
                                every bad line named; each question carries its dataset (the file's
                                name) and type, by which ``ragkv eval`` breaks its report down

These follow the official evaluation scripts (SQuAD v1.1 ``evaluate-v1.1.py``, HotpotQA
``hotpot_evaluate_v1.py``), so scores compare with published ones.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ragkv.sources import lone_surrogate

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


@dataclass
class Question:
    question: str
    contexts: list[str]
    answers: tuple[str, ...] = ()  # gold answers (any one is right); none: no EM/F1
    id: str | None = None  # the dataset's own id, when the line gives one
    type: str | None = None  # e.g. HotpotQA's bridge / comparison: the report's breakdown
    dataset: str = ""  # the questions file it came from (its stem): the report's breakdown


def load_questions(path: str | Path, dataset: str | None = None) -> list[Question]:
    """Read a JSONL file of questions; every malformed line is an error naming the line. ``dataset``
    names them in reports (default: the file's stem, ``hotpotqa_dev`` for ``hotpotqa_dev.jsonl``)."""
    dataset = Path(path).stem if dataset is None else dataset
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
        q, ctx = row.get("question"), row.get("contexts")
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{path}:{n}: 'question' must be a non-empty string")
        if not isinstance(ctx, list) or not ctx or not all(isinstance(c, str) and c.strip() for c in ctx):
            raise ValueError(f"{path}:{n}: 'contexts' must be a non-empty list of non-empty strings")
        golds = _gold_answers(row, f"{path}:{n}")
        qid, qtype = row.get("id"), row.get("type")
        for name, value in (("id", qid), ("type", qtype)):
            if value is not None and (not isinstance(value, (str, int)) or isinstance(value, bool)):
                raise ValueError(f"{path}:{n}: {name!r} must be a string, got {type(value).__name__}")
        for name, value in (("question", q), *((f"contexts[{i}]", c) for i, c in enumerate(ctx)),
                            *((f"answer {i}", g) for i, g in enumerate(golds))):
            why = lone_surrogate(value)
            if why:
                raise ValueError(f"{path}:{n}: {name!r} holds {why}")
        out.append(Question(q, ctx, golds, None if qid is None else str(qid), None if qtype is None else str(qtype),
                            dataset))
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def _gold_answers(row: dict, where: str) -> tuple[str, ...]:
    """``answer`` (a string or a list of strings) or ``answers`` (the same), not both."""
    given = [k for k in ("answer", "answers") if row.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"{where}: give 'answer' or 'answers', not both")
    if not given:
        return ()
    value = row[given[0]]
    golds = [value] if isinstance(value, str) else value
    if not isinstance(golds, list) or not golds or not all(isinstance(g, str) and g.strip() for g in golds):
        raise ValueError(f"{where}: '{given[0]}' must be a non-empty string or a list of them")
    return tuple(golds)
