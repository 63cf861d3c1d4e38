"""Recognise a prompt that ragkv's ``PromptTemplate`` built from its token ids alone.

    ids = prefix | chunk_1 .. chunk_n | suffix          (ragkv.prompt)

The template fixes the end of the prefix (the user-turn header: whatever system prompt and earlier
turns precede it, as ``PromptTemplate.chat`` lays out a chat with documents), the head of the question
(``question_format`` up to ``{question}``) and the tail (end of the user turn + assistant header),
and every chunk is ``tokenize(text.strip() + separator)``. So the prefix and the suffix are found by
their ids, and a chunk can only end right after the separator's ids, or after a token whose text ends
with the separator (tokenizers such as Qwen2's merge punctuation with the newlines after it: a
chunk ending in "." ends with the one token ".\n\n"). No marker string is added to the prompt: the
separator is the template's own paragraph break, which a chunk may also contain inside.

Which of those candidate boundaries are real chunk boundaries is read from the store: the split that
covers the most tokens with stored entries wins (fewest segments on ties); text not covered by a
stored entry is split at every candidate boundary, so a write-back of that text is found again by the
same rule on the next request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ragkv.prompt import Prompt, PromptTemplate, around_last_user


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return list(a[:n])


def _find_last(seq: Sequence[int], sub: Sequence[int], start: int) -> int:
    """Index of the last occurrence of ``sub`` in ``seq[start:]``, or -1."""
    n = len(sub)
    for i in range(len(seq) - n, start - 1, -1):
        if list(seq[i:i + n]) == list(sub):
            return i
    return -1


def _user_head(template: PromptTemplate) -> tuple[int, ...]:
    """The ids every user turn's content follows (the common end of the template's text before it
    with and without a system message), or () for a tokenizer without a chat template."""
    tok = template.tokenizer
    if not getattr(tok, "chat_template", None):
        return ()
    heads = [tok(around_last_user(tok, history)[0], add_special_tokens=False)["input_ids"][::-1]
             for history in ([], [{"role": "system", "content": "Zebra 42."}])]
    return tuple(_common_prefix(*heads)[::-1])


@dataclass(frozen=True)
class PromptLayout:
    """The ids a template puts around and between chunks, found once per tokenizer."""

    template: PromptTemplate
    head_ids: tuple[int, ...]  # the question format's ids before the question
    sep_ids: tuple[int, ...]  # the separator's ids at the end of every chunk
    sep_end_ids: frozenset[int] = frozenset()  # single tokens whose text ends with the separator
    user_head_ids: tuple[int, ...] = ()  # the chat template's ids right before a user turn's content

    @classmethod
    def for_template(cls, template: PromptTemplate) -> PromptLayout:
        a, b = template.suffix_ids("a"), template.suffix_ids("Zebra 42?")
        head = _common_prefix(a, b)
        tok = template.tokenizer
        plain = tok("word", add_special_tokens=False)["input_ids"]
        with_sep = tok("word" + template.separator, add_special_tokens=False)["input_ids"]
        if not head or with_sep[:len(plain)] != plain or len(with_sep) == len(plain):
            raise ValueError("this tokenizer merges the template's question head or separator with its "
                             "neighbours; chunk boundaries cannot be recognised from token ids")
        texts = tok.batch_decode([[i] for i in range(len(tok))])  # once per tokenizer (~1 s at 150k ids)
        ends = frozenset(i for i, text in enumerate(texts) if text.endswith(template.separator))
        return cls(template, tuple(head), tuple(with_sep[len(plain):]), ends, _user_head(template))

    def ends_chunk(self, ids: Sequence[int], j: int) -> bool:
        """Whether a chunk can end right before position ``j``: after the separator's ids, or after
        one token whose text ends with the separator."""
        n = len(self.sep_ids)
        return j > 0 and (ids[j - 1] in self.sep_end_ids or (j >= n and list(ids[j - n:j]) == list(self.sep_ids)))

    def regions(self, ids: Sequence[int]) -> tuple[int, int] | None:
        """(start, end) of the chunk region of ``ids``, or None when ``ids`` is not this template's
        prompt (prefix, question head, tail or a separator at the region's end missing)."""
        tail = list(self.template.tail_ids)
        if tail and list(ids[len(ids) - len(tail):]) != tail:
            return None
        s = _find_last(ids, self.head_ids, 0)
        p = self.chunks_start(ids, s)
        if p is None or s <= p or not self.ends_chunk(ids, s):
            return None
        return p, s

    def chunks_start(self, ids: Sequence[int], end: int) -> int | None:
        """Where the chunks of ``ids`` begin: right after the last user-turn header before ``end``
        (any system prompt or earlier turns before it), or, without a chat template, after the
        template's exact prefix."""
        if self.user_head_ids:
            i = _find_last(ids[:end], self.user_head_ids, 0)
            return None if i < 0 else i + len(self.user_head_ids)
        p = len(self.template.prefix_ids)
        return p if list(ids[:p]) == list(self.template.prefix_ids) else None

    def boundaries(self, ids: Sequence[int], start: int, end: int) -> list[int]:
        """Candidate chunk ends in ids[start:end]: right after each separator (and ``end``)."""
        region = list(ids[start:end])  # a separator before ``start`` ends no chunk of the region
        return [start, *[start + j for j in range(1, end - start) if self.ends_chunk(region, j)], end]

    def parse(self, ids: Sequence[int], stored: Callable[[list[int]], bool],
              max_chunk_tokens: int | None = None) -> tuple[Prompt, list[bool]] | None:
        """The ``Prompt`` of ``ids`` and, per chunk, whether ``stored(chunk_ids)``; None when ``ids``
        is not this template's prompt. ``stored`` is asked about spans between candidate boundaries
        (at most ``max_chunk_tokens`` long)."""
        ids = [int(t) for t in ids]
        reg = self.regions(ids)
        if reg is None:
            return None
        start, end = reg
        cuts = self.boundaries(ids, start, end)
        k = len(cuts)
        # best[j] = (stored tokens, -segments) of the best split of ids[start:cuts[j]]
        best: list[tuple[int, int]] = [(0, 0)] + [(-1, 0)] * (k - 1)
        back: list[tuple[int, bool]] = [(0, False)] * k
        for j in range(1, k):
            for i in range(j - 1, -1, -1):
                span = cuts[j] - cuts[i]
                if max_chunk_tokens is not None and span > max_chunk_tokens:
                    break
                if best[i][0] < 0:
                    continue
                hit = stored(ids[cuts[i]:cuts[j]])
                if not hit and i != j - 1:
                    continue  # text no entry covers is split at every boundary
                score = (best[i][0] + (span if hit else 0), best[i][1] - 1)
                if score > best[j]:
                    best[j], back[j] = score, (i, hit)
        if best[k - 1][0] < 0:
            return None  # a paragraph longer than max_chunk_tokens
        chunks, flags, j = [], [], k - 1
        while j > 0:
            i, hit = back[j]
            chunks.append(ids[cuts[i]:cuts[j]])
            flags.append(hit)
            j = i
        chunks.reverse()
        flags.reverse()
        return Prompt(ids[:start], chunks, ids[end:]), flags
