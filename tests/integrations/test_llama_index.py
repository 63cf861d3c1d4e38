"""LlamaIndex: the postprocessor's keys, the synthesizer's blended answers through query engines."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode

from ragkv.integrations.llama_index import node_text


def _nodes(texts):
    return [NodeWithScore(node=TextNode(text=t, metadata={"source": "x.md"}), score=1.0) for t in texts]


def test_node_without_text_is_refused():
    with pytest.raises(ValueError, match="has no text"):
        node_text(TextNode(text=""))


@pytest.mark.slow
def test_postprocessor_attaches_keys_and_keeps_text(make_gen):
    from integration_data import CONTEXTS

    from ragkv.integrations.llama_index import KEY_FIELD, RagKVNodePostprocessor

    gen = make_gen()
    pp = RagKVNodePostprocessor(gen)
    nodes = _nodes(CONTEXTS)
    before = [(n.node.text, n.node.get_content(MetadataMode.LLM), n.node.get_content(MetadataMode.EMBED))
              for n in nodes]
    out = pp.postprocess_nodes(nodes, query_str="q")
    assert out is nodes and pp.last_computed == 3
    for n, (text, llm, embed) in zip(out, before):
        key = n.node.metadata[KEY_FIELD]
        assert key == gen.engine.keys.chunk_key(gen.engine.template.chunk_ids(text))
        assert gen.engine.store.contains(key)
        assert (n.node.text, n.node.get_content(MetadataMode.LLM), n.node.get_content(MetadataMode.EMBED)) == (
            text, llm, embed)
        assert KEY_FIELD in n.node.excluded_llm_metadata_keys and KEY_FIELD in n.node.excluded_embed_metadata_keys
    asyncio.run(pp.apostprocess_nodes(nodes, query_str="q"))
    assert pp.last_computed == 0
    with pytest.raises(ValueError, match="has no text"):
        pp.postprocess_nodes([*_nodes(CONTEXTS[:1]), NodeWithScore(node=TextNode(text=" "))])
    with pytest.raises(ValueError, match="longer than the model's window"):
        pp.postprocess_nodes(_nodes(["lighthouse " * 9000]))


@pytest.mark.slow
def test_query_engines_answer_from_cached_chunks(make_gen, docs):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.query_engine import RetrieverQueryEngine

    from ragkv.integrations.embeddings import MiniLMEmbedding
    from ragkv.integrations.llama_index import (
        FaissRetriever,
        RagKVNodePostprocessor,
        RagKVSynthesizer,
        nodes_from_documents,
    )

    gen = make_gen()
    nodes = nodes_from_documents({k: docs[k] for k in ("lighthouse.md", "orbit.md")}, gen.engine.template, 128)
    embed = MiniLMEmbedding()
    pp, synth = RagKVNodePostprocessor(gen), RagKVSynthesizer(gen, max_new_tokens=2)

    faiss_engine = RetrieverQueryEngine(FaissRetriever(nodes, embed, similarity_top_k=2),
                                        response_synthesizer=synth, node_postprocessors=[pp])
    r1 = faiss_engine.query("Who designed the Harwick Point Lighthouse?")
    assert [n.node.metadata["source"] for n in r1.source_nodes] == ["lighthouse.md"] * 2
    assert pp.last_computed == 2  # the postprocessor computed them; the blend then hits
    assert (r1.metadata["ragkv"]["hits"], r1.metadata["ragkv"]["misses"]) == (2, 0)
    assert r1.response == synth.last_result.text

    # the standard one-liner over LlamaIndex's default vector store, async path
    engine = VectorStoreIndex(nodes, embed_model=embed).as_query_engine(
        llm=synth.llm, node_postprocessors=[pp], response_synthesizer=synth, similarity_top_k=2)
    r2 = asyncio.run(engine.aquery("How far away can the lighthouse's light be seen?"))
    new = {n.node.node_id for n in r2.source_nodes} - {n.node.node_id for n in r1.source_nodes}
    assert pp.last_computed == len(new) < 2  # only chunks never seen before are computed
    stats = r2.metadata["ragkv"]
    assert stats["hits"] == 2 and stats["misses"] == 0 and stats["ttft"] > 0
    for n in r2.source_nodes:
        assert n.node.metadata["ragkv_key"] == gen.engine.keys.chunk_key(gen.engine.template.chunk_ids(n.node.text))


@pytest.mark.slow
def test_streaming_synthesizer(make_gen):
    from integration_data import CONTEXTS

    from ragkv.integrations.llama_index import RagKVSynthesizer

    gen = make_gen()
    synth = RagKVSynthesizer(gen, streaming=True, max_new_tokens=3)
    resp = synth.synthesize("Who designed the lighthouse?", _nodes(CONTEXTS[:1]))
    text = "".join(resp.response_gen).strip()
    assert text == synth.last_result.text
    assert resp.metadata["ragkv"]["misses"] == 1
