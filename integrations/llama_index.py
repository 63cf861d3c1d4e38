"""LlamaIndex components that answer from retrieved nodes with blended chunk K/V.

    gen = BlendedGenerator(model, tokenizer, store)
    pp = RagKVNodePostprocessor(gen)                  # K/V of every retrieved node in the store
    synth = RagKVSynthesizer(gen, max_new_tokens=64)  # one node = one cached chunk, blended answer
    engine = RetrieverQueryEngine(retriever, response_synthesizer=synth, node_postprocessors=[pp])
    # or: index.as_query_engine(llm=synth.llm, node_postprocessors=[pp], response_synthesizer=synth)
    response = engine.query("...")     # response.metadata["ragkv"]: hits, misses, ttft, ...

Why a synthesizer of our own: LlamaIndex's default (COMPACT) repacks node texts into new strings, and
the stock synthesizers prepend node metadata to the text (MetadataMode.LLM). Either changes the chunk's
tokens, hence its cache key, and nothing would ever hit. Here every node's text is used as is
(``node_text``: MetadataMode.NONE), the same text the postprocessor keyed and the precompute job
chunked (``nodes_from_documents`` uses ``ragkv.chunking.chunk_document``).

Hooks LlamaIndex calls (llama-index-core 0.12-0.14):
    RagKVNodePostprocessor._postprocess_nodes / _apostprocess_nodes   after retrieval, per query
    RagKVSynthesizer.synthesize / asynthesize                          the answer (get_response /
                                                                       aget_response for raw texts)
    FaissRetriever._retrieve / _aretrieve                              top-k nodes by inner product
    RagKVLLM.complete / stream_complete                                plain generation, no blending
The async variants run the sync path in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from threading import Thread
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TextNode

from ragkv.blend import BlendEngine
from ragkv.chunking import chunk_document

from .hf import BlendedGenerator, GenerationResult

KEY_FIELD = "ragkv_key"


def _engine_of(obj) -> BlendEngine:
    if isinstance(obj, BlendEngine):
        return obj
    if isinstance(obj, BlendedGenerator):
        return obj.engine
    raise TypeError(f"expected a BlendedGenerator or BlendEngine, got {type(obj).__name__}")


def node_text(node: BaseNode | NodeWithScore) -> str:
    """The chunk text of a node as cached: its content without metadata. Raises on a node without text."""
    node = node.node if isinstance(node, NodeWithScore) else node
    text = node.get_content(metadata_mode=MetadataMode.NONE)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"node {node.node_id} ({type(node).__name__}) has no text; ragkv caches text chunks only")
    return text


def _exclude(node: BaseNode, field: str) -> None:
    for lst in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
        if field not in lst:
            lst.append(field)


def nodes_from_documents(docs: dict[str, str] | Sequence[str], template, max_tokens: int = 512) -> list[TextNode]:
    """One TextNode per chunk of ``ragkv.chunking.chunk_document`` (the precompute job's chunker).
    ``docs``: {name: text} (the name goes to metadata "source", excluded from LLM/embed text) or texts."""
    items = docs.items() if isinstance(docs, dict) else ((str(i), t) for i, t in enumerate(docs))
    nodes = []
    for name, text in items:
        for i, chunk in enumerate(chunk_document(text, template, max_tokens)):
            node = TextNode(text=chunk, id_=f"{name}#{i}", metadata={"source": name, "chunk": i})
            node.excluded_llm_metadata_keys = ["source", "chunk"]
            node.excluded_embed_metadata_keys = ["source", "chunk"]
            nodes.append(node)
    return nodes


class RagKVNodePostprocessor(BaseNodePostprocessor):
    """Makes sure every node's chunk K/V is in the store (prefilled and written back on a miss) and
    records its cache key in ``node.metadata[key_field]``, excluded from LLM and embedding text.
    Nodes, their order and their text are unchanged. ``last_computed``: chunks computed by the last call."""

    key_field: str = KEY_FIELD
    last_computed: int = 0
    _engine: BlendEngine = PrivateAttr()

    def __init__(self, generator: BlendedGenerator | BlendEngine, **kwargs: Any):
        super().__init__(**kwargs)
        self._engine = _engine_of(generator)

    @classmethod
    def class_name(cls) -> str:
        return "RagKVNodePostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        texts = [node_text(n) for n in nodes]  # validate all before computing anything
        if not texts:
            self.last_computed = 0
            return nodes
        self._check_window(nodes, texts)
        keys, self.last_computed = self._engine.ensure(texts)
        for n, key in zip(nodes, keys):
            n.node.metadata[self.key_field] = key
            _exclude(n.node, self.key_field)
        return nodes

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore],
                                  query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._postprocess_nodes, nodes, query_bundle)

    def _check_window(self, nodes: list[NodeWithScore], texts: list[str]) -> None:
        self._engine.template.chunks(texts, self._engine.adapter.max_positions,
                                     names=[f"node {n.node.node_id}" for n in nodes])


class RagKVLLM(CustomLLM):
    """The wrapped model as a plain LlamaIndex LLM (chat template, no blending). The query engines
    want an ``llm`` even when the synthesizer does the answering; this one keeps them off Settings.llm."""

    max_new_tokens: int = 64
    _generator: BlendedGenerator = PrivateAttr()

    def __init__(self, generator: BlendedGenerator, **kwargs: Any):
        super().__init__(**kwargs)
        self._generator = generator

    @classmethod
    def class_name(cls) -> str:
        return "RagKVLLM"

    @property
    def metadata(self) -> LLMMetadata:
        cfg = self._generator.model.config
        return LLMMetadata(context_window=getattr(cfg, "max_position_embeddings", 2048),
                           num_output=self.max_new_tokens, model_name=getattr(cfg, "_name_or_path", "") or "ragkv")

    def _ids(self, prompt: str):
        tok, model = self._generator.tokenizer, self._generator.model
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tok(prompt, return_tensors="pt")["input_ids"]
        return ids.to(model.device)

    def _generate(self, ids, kwargs: dict):
        gen = self._generator
        with gen.engine.exclusive():  # the model serves one request at a time (blended or not)
            return gen.engine.adapter.generate(ids, None, gen.tokenizer, **{"max_new_tokens": self.max_new_tokens,
                                                                             **kwargs})

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        new = self._generate(self._ids(prompt), kwargs)
        return CompletionResponse(text=self._generator.tokenizer.decode(new, skip_special_tokens=True).strip())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(self._generator.tokenizer, skip_prompt=True, skip_special_tokens=True)
        Thread(target=self._generate, args=(self._ids(prompt), {**kwargs, "streamer": streamer}),
               daemon=True).start()

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in streamer:
                text += piece
                yield CompletionResponse(text=text, delta=piece)

        return gen()


class RagKVSynthesizer(BaseSynthesizer):
    """Answers from the nodes with the blended cache: each node is ONE chunk, in retrieval order.
    ``generate_kwargs`` (max_new_tokens, do_sample, ...) go to ``BlendedGenerator.generate``.
    Response metadata: ``{node_id: node.metadata, ..., "ragkv": {hits, misses, ttft, ...}}``;
    with ``streaming=True`` "ragkv" is filled in when the stream ends."""

    def __init__(self, generator: BlendedGenerator, streaming: bool = False, ratio: float | None = None,
                 **generate_kwargs: Any):
        self._generator = generator
        self._ratio = ratio
        self._generate_kwargs = generate_kwargs
        self._llm_wrapper = RagKVLLM(generator, max_new_tokens=generate_kwargs.get("max_new_tokens", 64))
        super().__init__(llm=self._llm_wrapper, streaming=streaming)
        self.last_result: GenerationResult | None = None

    @property
    def llm(self) -> RagKVLLM:
        return self._llm_wrapper

    def _get_prompts(self) -> dict:
        return {}

    def _update_prompts(self, prompts: dict) -> None:
        pass

    # raw-text entry points (LlamaIndex's abstract API): texts are chunks, as is
    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> str:
        self.last_result = self._generate(query_str, list(text_chunks), response_kwargs)
        return self.last_result.text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> str:
        return await asyncio.to_thread(self.get_response, query_str, text_chunks, **response_kwargs)

    def _generate(self, query: str, texts: list[str], kwargs: dict) -> GenerationResult:
        return self._generator.generate(query, texts, ratio=self._ratio, **{**self._generate_kwargs, **kwargs})

    # node entry points: node text without metadata, so the chunk keys are the postprocessor's
    def synthesize(self, query, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None, **response_kwargs: Any):
        if isinstance(query, str):
            query = QueryBundle(query_str=query)
        if not nodes:
            if self._streaming:
                return StreamingResponse(response_gen=self._empty_response_generator())
            return Response(self._empty_response)
        texts = [node_text(n) for n in nodes]
        source_nodes = list(nodes) + list(additional_source_nodes or [])
        metadata = self._get_metadata_for_response([n.node for n in source_nodes]) or {}
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: query.query_str}) as event:
            if self._streaming:
                response = StreamingResponse(self._stream(query.query_str, texts, response_kwargs, metadata),
                                             source_nodes=source_nodes, metadata=metadata)
            else:
                self.last_result = self._generate(query.query_str, texts, response_kwargs)
                metadata["ragkv"] = self.last_result.stats_dict()
                response = Response(self.last_result.text, source_nodes=source_nodes, metadata=metadata)
            event.on_end(payload={EventPayload.RESPONSE: response})
        return response

    async def asynthesize(self, query, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None, **response_kwargs: Any):
        return await asyncio.to_thread(self.synthesize, query, nodes, additional_source_nodes, **response_kwargs)

    def _stream(self, query: str, texts: list[str], kwargs: dict, metadata: dict):
        from transformers import TextIteratorStreamer

        streamer = TextIteratorStreamer(self._generator.tokenizer, skip_prompt=True, skip_special_tokens=True)
        errors: list[BaseException] = []

        def run():
            try:
                self.last_result = self._generate(query, texts, {**kwargs, "streamer": streamer})
                metadata["ragkv"] = self.last_result.stats_dict()
            except BaseException as e:  # surfaced to the consumer below
                errors.append(e)
                streamer.end()

        thread = Thread(target=run, daemon=True)
        thread.start()
        yield from streamer
        thread.join()
        if errors:
            raise errors[0]


class FaissRetriever(BaseRetriever):
    """Top-k nodes by inner product over unit embeddings (faiss ``IndexFlatIP``): cosine similarity."""

    def __init__(self, nodes: Sequence[BaseNode], embed_model, similarity_top_k: int = 3, **kwargs: Any):
        import faiss
        import numpy as np

        super().__init__(**kwargs)
        if not nodes:
            raise ValueError("FaissRetriever needs at least one node")
        self._nodes = list(nodes)
        self._embed = embed_model
        self._top_k = similarity_top_k
        texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in self._nodes]
        vecs = np.asarray(embed_model.get_text_embedding_batch(texts), dtype=np.float32)  # [N, D]
        faiss.normalize_L2(vecs)
        self._index = faiss.IndexFlatIP(vecs.shape[1])
        self._index.add(vecs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        import faiss
        import numpy as np

        q = query_bundle.embedding or self._embed.get_query_embedding(query_bundle.query_str)
        q = np.asarray([q], dtype=np.float32)
        faiss.normalize_L2(q)
        scores, idx = self._index.search(q, min(self._top_k, len(self._nodes)))
        return [NodeWithScore(node=self._nodes[i], score=float(s)) for s, i in zip(scores[0], idx[0]) if i >= 0]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)
