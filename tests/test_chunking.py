"""The chunker: every chunk fits its token budget and is an exact substring of the document."""

from __future__ import annotations

import random

import pytest

from ragkv.chunking import chunk_document, chunk_spans


def _check(text, tpl, max_tokens):
    chunks = chunk_document(text, tpl, max_tokens)
    assert chunks and all(len(tpl.chunk_ids(c)) <= max_tokens for c in chunks)
    pos = 0
    for c in chunks:  # exact substrings, in document order, never overlapping
        at = text.find(c, pos)
        assert at >= 0, f"not a substring of the document: {c[:60]!r}"
        pos = at + len(c)
    return chunks


def test_unpunctuated_multibyte_text_is_cut_at_character_boundaries(smollm2_template):
    rng = random.Random(0)
    alphabet = ["😀", "🎉", "👍🏽", "é", "ß", " "]
    text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) if rng.random() < 0.8 else rng.choice(alphabet)
                   for _ in range(6000))
    chunks = _check(text, smollm2_template, 64)
    assert len(chunks) > 20
    assert not any("\ufffd" in c for c in chunks)  # no multi-byte character split into halves
    assert "".join("".join(chunks).split()) == "".join(text.split())  # only whitespace left out


def test_paragraphs_and_sentences_keep_the_documents_own_spacing(smollm2_template):
    short = [" ".join(f"Fact {p}.{i} is about topic {p * 7 + i}." for i in range(2)) for p in range(6)]
    long = " ".join(f"Sentence {i} of the long paragraph mentions item {i * 3}." for i in range(40))
    text = "\n   \n".join([*short, long])  # blank lines with spaces: the old chunker wrote "\n\n"
    chunks = _check(text, smollm2_template, 96)
    assert len(chunks) > 3
    assert "\n   \n" in chunks[0]  # short paragraphs share a chunk with their own separator
    assert any("mentions item 3. Sentence 2" in c for c in chunks)  # sentences keep their spaces
    spans = chunk_spans(text, smollm2_template, 96)
    assert [text[s:e] for s, e in spans] == chunks


@pytest.mark.parametrize("bad", [8, 15, 3.5, "512"])
def test_bad_budgets_are_refused(smollm2_template, bad):
    with pytest.raises(ValueError, match="max_tokens"):
        chunk_document("some text", smollm2_template, bad)


def test_non_text_is_refused(smollm2_template):
    with pytest.raises(TypeError, match="must be a string"):
        chunk_document(b"bytes", smollm2_template)
