"""RAG with LlamaIndex over blended chunk K/V.

    .venv/bin/python examples/llama_index_rag.py [--store disk:///path]

documents -> ragkv.precompute (chunk + prefill + store, once) -> FAISS retrieval over all-MiniLM-L6-v2
embeddings -> RagKVNodePostprocessor (keys; computes any chunk still missing) -> RagKVSynthesizer
(each node is one cached chunk, blended answer). Nodes come from the same chunker as the precompute
job, so every retrieved chunk hits.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from llama_index.core.query_engine import RetrieverQueryEngine

from ragkv import models
from ragkv.blend import BlendConfig
from ragkv.integrations.embeddings import MiniLMEmbedding
from ragkv.integrations.hf import BlendedGenerator
from ragkv.integrations.llama_index import (
    FaissRetriever,
    RagKVNodePostprocessor,
    RagKVSynthesizer,
    nodes_from_documents,
)
from ragkv.precompute import precompute
from ragkv.store import open_store

DOCS = Path(__file__).parent / "data" / "docs"
CHUNK_TOKENS = 128
QUESTIONS = [
    "Who designed the Harwick Point Lighthouse?",
    "When was the Kestrel-3 satellite launched?",
    "How much does chess club membership cost for adults?",
]


def main(store_uri: str) -> None:
    model, tokenizer = models.load("smollm2-135m")
    gen = BlendedGenerator(model, tokenizer, open_store(store_uri), BlendConfig(ratio=0.15))

    summary = precompute(gen.engine.prefiller, paths=[DOCS], chunk_tokens=CHUNK_TOKENS)
    print(f"precompute: {summary.docs} docs, {summary.chunks} chunks, {summary.new} new, "
          f"{summary.skipped} already stored, {summary.seconds:.1f} s")

    docs = {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}
    nodes = nodes_from_documents(docs, gen.engine.template, max_tokens=CHUNK_TOKENS)
    retriever = FaissRetriever(nodes, MiniLMEmbedding(), similarity_top_k=2)
    pp = RagKVNodePostprocessor(gen)
    synth = RagKVSynthesizer(gen, max_new_tokens=32)
    engine = RetrieverQueryEngine(retriever, response_synthesizer=synth, node_postprocessors=[pp])

    for q in QUESTIONS:
        r = engine.query(q)
        s = r.metadata["ragkv"]
        print(f"\nQ: {q}\nA: {r.response}")
        print(f"  sources {[n.node.node_id for n in r.source_nodes]}, computed by postprocessor "
              f"{pp.last_computed}, hits {s['hits']}, misses {s['misses']}, reused {s['reused_tokens']} "
              f"recomputed {s['recomputed_tokens']} tokens, TTFT {s['ttft'] * 1000:.0f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="store URI (default: a disk store in a temporary directory)")
    args = ap.parse_args()
    if args.store:
        main(args.store)
    else:
        with tempfile.TemporaryDirectory(prefix="ragkv-llamaindex-") as tmp:
            main(f"disk://{tmp}")
