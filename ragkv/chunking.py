"""Split documents into chunks of at most N tokens on paragraph, then sentence, boundaries.

The one chunker of ragkv: the precompute job, the read path's helpers and the integrations all use
it, so a chunk of the same document always has the same text, hence the same token ids and key.
Token counts are those of ``PromptTemplate.chunk_ids`` (text + separator), the ids that are cached.
"""

from __future__ import annotations

import re

_PARA = re.compile(r"\n\s*\n")
_SENT = re.compile(r"(?<=[.!?。！？])\s+|\n")


def _pieces(text: str, fits, count, tokenizer) -> list[str]:
    """Break text into pieces that each fit: paragraphs, else sentences, else token windows."""
    out: list[str] = []
    for para in _PARA.split(text):
        para = para.strip()
        if not para:
            continue
        if fits(para):
            out.append(para)
            continue
        for sent in _SENT.split(para):
            sent = sent.strip()
            if not sent:
                continue
            if fits(sent):
                out.append(sent)
                continue
            ids = tokenizer(sent, add_special_tokens=False)["input_ids"]  # one huge sentence: token windows
            step = max(1, count.max_tokens - count.overhead - 2)
            out.extend(tokenizer.decode(ids[i : i + step]).strip() for i in range(0, len(ids), step))
    return [p for p in out if p]


class _Counter:
    def __init__(self, template, max_tokens: int):
        self.template, self.max_tokens = template, max_tokens
        self.overhead = len(template.chunk_ids("x")) - 1

    def __call__(self, text: str) -> int:
        return len(self.template.chunk_ids(text))


def chunk_document(text: str, template, max_tokens: int = 512) -> list[str]:
    """Chunks of ``text``, each at most ``max_tokens`` cached tokens; paragraphs are kept whole when
    they fit, joined with a blank line while the chunk stays within the budget."""
    if max_tokens < 16:
        raise ValueError(f"max_tokens must be >= 16, got {max_tokens}")
    if not isinstance(text, str):
        raise TypeError("chunk_document: text must be a string")
    count = _Counter(template, max_tokens)
    pieces = _pieces(text, lambda s: count(s) <= max_tokens, count, template.tokenizer)
    chunks: list[str] = []
    cur = ""
    for piece in pieces:
        cand = f"{cur}\n\n{piece}" if cur else piece
        if cur and count(cand) > max_tokens:
            chunks.append(cur)
            cand = piece
        cur = cand
    if cur:
        chunks.append(cur)
    return chunks
