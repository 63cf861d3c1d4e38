"""Split documents into chunks of at most N tokens on paragraph, then sentence, boundaries.

The one chunker of ragkv: the precompute job, the read path's helpers and the integrations all use
it, so a chunk of the same document always has the same text, hence the same token ids and key.
Token counts are those of ``PromptTemplate.chunk_ids`` (text + separator), the ids that are cached.

Every chunk is an exact substring of the document (``text[start:end]``, trimmed of surrounding
whitespace): paragraphs and sentences that share a chunk keep the document's own spacing, and a run
of text too long for one chunk (no paragraph or sentence break) is cut between tokens at character
boundaries, preferably at whitespace, never inside a multi-byte character.
"""

from __future__ import annotations

import re

_PARA = re.compile(r"\n\s*\n")
_SENT = re.compile(r"(?<=[.!?。！？])\s+|\n")
_SPACE = re.compile(r"\s")


def _trim(text: str, s: int, e: int) -> tuple[int, int] | None:
    """(s, e) narrowed to exclude surrounding whitespace; None when only whitespace is left."""
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return (s, e) if s < e else None


def _split(text: str, s: int, e: int, pattern: re.Pattern) -> list[tuple[int, int]]:
    """Non-empty trimmed spans of text[s:e] between matches of ``pattern``."""
    out, pos = [], s
    for m in pattern.finditer(text, s, e):
        if (span := _trim(text, pos, m.start())) is not None:
            out.append(span)
        pos = m.end()
    if (span := _trim(text, pos, e)) is not None:
        out.append(span)
    return out


class _Counter:
    """Cached-token counts of spans of one document (``PromptTemplate.chunk_ids`` length)."""

    def __init__(self, text: str, template, max_tokens: int):
        self.text, self.template, self.max_tokens = text, template, max_tokens
        self.overhead = len(template.chunk_ids("x")) - 1  # the separator's tokens

    def __call__(self, s: int, e: int) -> int:
        return len(self.template.chunk_ids(self.text[s:e]))

    def fits(self, s: int, e: int) -> bool:
        return self(s, e) <= self.max_tokens


def _windows(count: _Counter, s: int, e: int) -> list[tuple[int, int]]:
    """Cut a span without usable breaks into pieces that fit, between tokens (character boundaries:
    a cut never lands inside a character), preferring whitespace in the last quarter of a window."""
    text, tok = count.text, count.template.tokenizer
    budget = max(1, count.max_tokens - count.overhead)
    starts = _token_starts(tok, text, s, e)  # character offset where each token begins
    out: list[tuple[int, int]] = []
    a, j = s, 0
    while a < e:
        while j < len(starts) and starts[j] < a:
            j += 1
        step = budget
        while True:
            cut = e if j + step >= len(starts) else max(starts[j + step], a + 1)
            if cut < e:  # prefer a whitespace boundary near the end of the window
                lo = a + (cut - a) * 3 // 4
                ws = [m.start() for m in _SPACE.finditer(text, lo, cut)]
                if ws:
                    cut = max(ws[-1], a + 1)
            span = _trim(text, a, cut)
            if span is None or count.fits(*span) or cut - a <= 1:
                break
            step = max(1, step - max(1, (count(*span) - count.max_tokens)))  # re-tokenizing shifted it
        if span is not None:
            out.append(span)
        a = cut
    return out


def _token_starts(tok, text: str, s: int, e: int) -> list[int]:
    """Absolute character offset where each token of text[s:e] starts, one entry per token (the
    byte tokens of one multi-byte character share its offset), from one tokenization. Tokenizers
    without offsets fall back to one entry per character: the windows then fit by re-counting."""
    try:
        enc = tok(text[s:e], add_special_tokens=False, return_offsets_mapping=True)
        return [s + a for a, _ in enc["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError):
        return list(range(s, e))


def _pieces(count: _Counter, text: str, progress=None) -> list[tuple[tuple[int, int], int]]:
    """Spans that each fit, with their token counts: paragraphs, else their sentences, else token
    windows. ``progress(chars)`` is told how far into the text it got, paragraph by paragraph."""
    out: list[tuple[tuple[int, int], int]] = []
    for ps, pe in _split(text, 0, len(text), _PARA):
        if progress is not None:
            progress(ps)
        if (n := count(ps, pe)) <= count.max_tokens:
            out.append(((ps, pe), n))
            continue
        for ss, se in _split(text, ps, pe, _SENT):
            if (n := count(ss, se)) <= count.max_tokens:
                out.append(((ss, se), n))
            else:
                out.extend((w, count(*w)) for w in _windows(count, ss, se))
    return out


def chunk_spans(text: str, template, max_tokens: int = 512, progress=None) -> list[tuple[int, int]]:
    """(start, end) character offsets of each chunk of ``text`` (see ``chunk_document``);
    ``progress(chars)``, if given, hears how many characters were chunked so far."""
    if not isinstance(text, str):
        raise TypeError(f"chunk_document: text must be a string, got {type(text).__name__}")
    if not isinstance(max_tokens, int) or max_tokens < 16:
        raise ValueError(f"max_tokens must be an integer >= 16, got {max_tokens!r}")
    count = _Counter(text, template, max_tokens)
    pieces = _pieces(count, text, progress)
    chunks: list[tuple[int, int]] = []
    i = 0
    while i < len(pieces):
        j = _last_fitting(count, pieces, i)
        chunks.append((pieces[i][0][0], pieces[j][0][1]))
        i = j + 1
    return chunks


def _last_fitting(count: _Counter, pieces, i: int) -> int:
    """The largest j such that pieces i..j (one span of the document) fit in one chunk. Token counts
    of neighbouring pieces nearly add up (each piece's count includes the separator once), so the
    sum guesses j and exact counts of the joined span confirm it: a few tokenizations per chunk
    instead of one per piece."""
    total, j = pieces[i][1], i
    while j + 1 < len(pieces) and total + pieces[j + 1][1] - count.overhead <= count.max_tokens:
        j += 1
        total += pieces[j][1] - count.overhead
    start = pieces[i][0][0]
    while j > i and not count.fits(start, pieces[j][0][1]):  # the guess was too long
        j -= 1
    while j + 1 < len(pieces) and count.fits(start, pieces[j + 1][0][1]):  # ... or too short
        j += 1
    return j


def chunk_document(text: str, template, max_tokens: int = 512) -> list[str]:
    """Chunks of ``text``, each at most ``max_tokens`` cached tokens and each an exact substring of
    ``text``: paragraphs are kept whole when they fit and neighbours share a chunk while it stays
    within the budget; longer paragraphs split at sentences, longer sentences between tokens."""
    return [text[s:e] for s, e in chunk_spans(text, template, max_tokens)]
