"""PromptLayout: a PromptTemplate prompt recognised from its token ids alone (no vLLM needed)."""

from __future__ import annotations

import pytest

from ragkv.integrations.vllm import PromptLayout

CONTEXTS = [
    "The lighthouse at Kerran Point was built in 1871 by the engineer Ada Morrow.\n\nIts lamp was "
    "converted to electricity in 1932.",  # a chunk with a paragraph break inside
    "Kerran Point lies on the north coast, twelve miles from the harbour town of Vell.",
    "Ferries to Vell leave twice a day in summer.",
]


@pytest.fixture(scope="module")
def layout(smollm2_template):
    return PromptLayout.for_template(smollm2_template)


def test_stored_chunks_are_recovered_exactly(layout, smollm2_template):
    prompt = smollm2_template.build("Who built the lighthouse?", CONTEXTS)
    stored = {tuple(c) for c in prompt.chunk_ids}
    asked = []

    def is_stored(ids):
        asked.append(len(ids))
        return tuple(ids) in stored

    parsed, flags = layout.parse(prompt.input_ids, is_stored)
    assert parsed == prompt and flags == [True, True, True]
    # the first chunk has a paragraph break inside: its half alone was asked about, and is not a chunk
    assert len(asked) > len(CONTEXTS)


def test_unstored_text_splits_at_every_separator_and_write_back_is_found_again(layout, smollm2_template):
    prompt = smollm2_template.build("Who built the lighthouse?", CONTEXTS)
    parsed, flags = layout.parse(prompt.input_ids, lambda ids: False)
    # a paragraph break inside a chunk tokenizes unlike the separator a chunk ends with, so even
    # with nothing stored the split is the template's
    assert parsed == prompt and flags == [False] * 3
    written = {tuple(c) for c in parsed.chunk_ids}  # what the write-back stores
    again, flags2 = layout.parse(prompt.input_ids, lambda ids: tuple(ids) in written)
    assert again == prompt and flags2 == [True] * 3


def test_partly_stored_prompt(layout, smollm2_template):
    prompt = smollm2_template.build("Where do ferries go?", CONTEXTS)
    stored = {tuple(prompt.chunk_ids[0]), tuple(prompt.chunk_ids[2])}
    parsed, flags = layout.parse(prompt.input_ids, lambda ids: tuple(ids) in stored)
    assert parsed.chunk_ids == prompt.chunk_ids and flags == [True, False, True]


def test_other_prompts_are_not_recognised(layout, smollm2_template, smollm2_tokenizer):
    tok = smollm2_tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                   tokenize=False)
    assert layout.parse(tok(chat, add_special_tokens=False)["input_ids"], lambda ids: True) is None
    prompt = smollm2_template.build("Who built it?", CONTEXTS)
    assert layout.parse(prompt.input_ids[:-1], lambda ids: True) is None  # tail cut
    # no user-turn header before the chunks (whatever system prompt or turns precede one may differ)
    assert layout.parse(prompt.input_ids[len(prompt.prefix_ids):], lambda ids: True) is None


def test_a_paragraph_longer_than_the_limit_is_not_recognised(layout, smollm2_template):
    prompt = smollm2_template.build("Who built it?", CONTEXTS)
    assert layout.parse(prompt.input_ids, lambda ids: False, max_chunk_tokens=5) is None


# ----------------------------------------------------------------------------- Qwen-style tokenizers
# Qwen2's pre-tokenizer keeps punctuation and the newlines after it together: a chunk ending in "."
# ends with the single token ".\n\n", not with the separator's own id.


def _recovered(template, contexts):
    layout = PromptLayout.for_template(template)
    prompt = template.build("Who built the lighthouse?", contexts)
    stored = {tuple(c) for c in prompt.chunk_ids}
    got = layout.parse(prompt.input_ids, lambda ids: tuple(ids) in stored)
    return prompt, got


def test_chunks_ending_in_a_merged_separator_token_are_recovered(chatml_tokenizer):
    from ragkv.prompt import PromptTemplate

    tok = chatml_tokenizer
    template = PromptTemplate.for_tokenizer(tok)
    prompt, got = _recovered(template, CONTEXTS)
    ends = [tok.convert_ids_to_tokens(c[-1]) for c in prompt.chunk_ids]
    assert ends == [".ĊĊ"] * 3  # (the premise: no chunk ends with the separator's own id)
    assert got is not None, "a Qwen-style prompt was not recognised"
    parsed, flags = got
    assert parsed == prompt and flags == [True, True, True]
    # nothing stored: the merged paragraph break inside the first chunk is a candidate end too, and a
    # write-back of that split is found again by the same rule
    layout = PromptLayout.for_template(template)
    parsed, flags = layout.parse(prompt.input_ids, lambda ids: False)
    assert parsed.chunk_ids[2:] == prompt.chunk_ids[1:] and len(parsed.chunk_ids) == 4 and flags == [False] * 4
    assert parsed.chunk_ids[0] + parsed.chunk_ids[1] == prompt.chunk_ids[0]
    written = {tuple(c) for c in parsed.chunk_ids}
    again, flags = layout.parse(prompt.input_ids, lambda ids: tuple(ids) in written)
    assert again == parsed and flags == [True] * 4



# ----------------------------------------------------------------------------- chats with documents
# PromptTemplate.chat (ragkv serve's layout for a request's documents, and ragkv's vLLM renderer's):
# the chat's own system prompt and earlier turns come before the last user header, the chunks after it.

CHAT = [{"role": "system", "content": "You answer from the documents only. " * 12},
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello! Ask away."},
        {"role": "user", "content": "Who built the lighthouse?"}]


def test_a_chat_with_its_own_system_prompt_and_earlier_turns_is_recognised(layout, smollm2_template):
    one_turn = smollm2_template.chat(CHAT[-1:], CONTEXTS)
    assert one_turn == smollm2_template.build("Who built the lighthouse?", CONTEXTS)  # the same ids and keys
    prompt = smollm2_template.chat(CHAT, CONTEXTS)
    assert prompt.chunk_ids == one_turn.chunk_ids and prompt.suffix_ids == one_turn.suffix_ids
    assert len(prompt.prefix_ids) > len(one_turn.prefix_ids) + 80
    stored = {tuple(c) for c in prompt.chunk_ids}
    assert layout.parse(prompt.input_ids, lambda ids: tuple(ids) in stored) == (prompt, [True, True, True])


def test_a_chat_on_a_chatml_tokenizer_is_recognised(chatml_tokenizer):
    from ragkv.prompt import PromptTemplate

    template = PromptTemplate.for_tokenizer(chatml_tokenizer)
    prompt = template.chat(CHAT, CONTEXTS)
    stored = {tuple(c) for c in prompt.chunk_ids}
    got = PromptLayout.for_template(template).parse(prompt.input_ids, lambda ids: tuple(ids) in stored)
    assert got == (prompt, [True, True, True])
