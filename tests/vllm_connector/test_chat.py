"""Chat requests with ``documents``: ragkv's renderer (registered by its vLLM plugin) lays each
document out as one chunk, exactly as ``ragkv serve`` does (PromptTemplate.chat), and the connector
blends them. In process with vLLM's offline ``LLM.chat`` (the same renderer vLLM's OpenAI server uses)."""

from __future__ import annotations

import pytest
from vllm_data import DOCS, SYSTEM

QUESTION = "Who built the lighthouse at Kerran Point?"


def chat(llm, messages, documents, ratio=None, **kw):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"ragkv_ratio": ratio}} if ratio is not None else None
    return llm.chat(messages, SamplingParams(max_tokens=16, temperature=0, extra_args=extra), use_tqdm=False,
                    chat_template_kwargs={"documents": documents, **kw})[0]


def test_chat_documents_are_ragkv_chunks_and_blended(vllm_env):
    llm, engine = vllm_env
    engine.ensure(DOCS[:3])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hello! What would you like to know?"},
                {"role": "user", "content": QUESTION}]
    docs = [DOCS[1], {"text": DOCS[0]}, {"title": "Ferries", "text": DOCS[2]}]
    out = chat(llm, messages, docs)
    texts = [DOCS[1], DOCS[0], "Ferries\n" + DOCS[2]]
    assert out.prompt_token_ids == engine.template.chat(messages, texts).input_ids  # ragkv serve's ids
    info = out.kv_transfer_params["ragkv"]
    assert info["recognised"] and info["chunks"] == 3
    # the titled document is a new chunk: vLLM prefills this prompt, the connector writes it back
    assert info["hits"] == 2 and info["misses"] == 1 and not info["offered"]
    assert "Ada Morrow" in out.outputs[0].text
    out = chat(llm, messages, docs[::-1])  # all three stored now, in any order
    info = out.kv_transfer_params["ragkv"]
    assert info["offered"] and info["blend"]["hits"] == 3 and "Ada Morrow" in out.outputs[0].text
    # a single user turn gives PromptTemplate.build's ids: what `ragkv precompute` keyed
    out = chat(llm, [{"role": "user", "content": QUESTION}], DOCS[:3], ratio=0.15)
    assert out.prompt_token_ids == engine.build_prompt(QUESTION, DOCS[:3]).input_ids
    assert out.kv_transfer_params["ragkv"]["offered"]
    # without documents: vLLM's own rendering (the connector does not recognise it)
    from vllm import SamplingParams

    plain = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert not plain.kv_transfer_params["ragkv"]["recognised"]


@pytest.mark.parametrize("messages, documents, error", [
    ([{"role": "user", "content": QUESTION}], [{"text": DOCS[0], "url": "x"}], r"documents\[0\] has unknown fields \['url'\]"),
    ([{"role": "user", "content": QUESTION}], [DOCS[0], "  "], r"documents\[1\] needs a non-empty text"),
    ([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "It was"}], [DOCS[0]],
     r"the last message \(messages\[1\]\) must be the user's question"),
])
def test_bad_documents_are_refused_by_name(vllm_env, messages, documents, error):
    llm, _ = vllm_env
    with pytest.raises(ValueError, match=error):
        chat(llm, messages, documents)
