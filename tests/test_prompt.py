"""PromptTemplate on ChatML (Qwen2.5) templates: prefix / chunks / suffix as the chat template lays them out."""

from __future__ import annotations

import pytest

from ragkv.prompt import PromptTemplate

CONTEXTS = [
    "Ed Wood (film)\nEd Wood is a 1994 American biographical period comedy-drama film directed by Tim Burton.",
    "Scott Derrickson\nScott Derrickson (born July 16, 1966) is an American director; he lives in Los Angeles!",
    "Doctor Strange\nDoctor Strange is a 2016 film. Who directed it?",
]
QUESTION = "Were Scott Derrickson and Ed Wood of the same nationality?"


def check_chatml_layout(tok, system_default: str) -> None:
    template = PromptTemplate.for_tokenizer(tok)
    assert tok.decode(template.prefix_ids) == f"<|im_start|>system\n{system_default}<|im_end|>\n<|im_start|>user\n"
    assert tok.decode(template.tail_ids) == "<|im_end|>\n<|im_start|>assistant\n"
    prompt = template.build(QUESTION, CONTEXTS)
    # the ids are the chat template's own text for one user turn holding the chunks and the question
    user = "".join(c + template.separator for c in CONTEXTS) + template.question_format.format(question=QUESTION)
    chat = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
    assert tok.decode(prompt.input_ids) == chat
    # each chunk tokenized alone is exactly what the whole prompt tokenizes to at its place
    assert prompt.input_ids == tok(chat, add_special_tokens=False)["input_ids"]
    for ids, text in zip(prompt.chunk_ids, CONTEXTS):
        assert tok.decode(ids) == text + template.separator
    assert template.chunk_ids(CONTEXTS[0]) == prompt.chunk_ids[0]  # position-independent: the cache key's ids


def test_chatml_template_with_a_default_system_prompt(chatml_tokenizer):
    check_chatml_layout(chatml_tokenizer, "You are a helpful assistant.")


@pytest.mark.qwen
def test_qwen_chat_template(qwen05_tokenizer):
    check_chatml_layout(qwen05_tokenizer, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
