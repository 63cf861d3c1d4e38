"""The read path: fuse stored chunk K/V at new positions and recompute the tokens that matter (CacheBlend).

    prompt = prefix | chunk_1 .. chunk_n | suffix            (ragkv.prompt)
    1. lookup      every segment by content key; prefill and write back what is missing
    2. ratio       the configured one, or the loading controller's ("auto")
    3. layers      the model's own decoder layers over the active rows, stored K/V fused and
                   re-rotated per layer, the selector narrowing the recomputed chunk tokens
                   (ragkv.blend.request, .select, .cache, .attention)
    4. handoff     logits of the last prompt token + a DynamicCache of the prompt minus its last
                   token, which ``model.generate`` continues (ragkv.integrations.hf generates)

ratio = 0 is naive reuse (no recompute but the suffix); ratio = 1 recomputes every chunk token in
every layer and equals full prefill. The prefix is cached as a true prefix (positions 0..P-1), so
its K/V are exact and it is never recomputed after the whole-prompt layers.
Under ``PrecomputePolicy.lead`` the first chunk is read from its lead entry (prefilled right
behind the template prefix: exact when the prompt's prefix is the template's); a store without one
serves its gap entry instead (``stats.lead`` False).

The write path shares this engine's keys, policy and encoding: ``prefill_chunks`` and
``write_entry`` are what both the write-back of misses and the precompute job use.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from ragkv.adapter import ModelAdapter, pad_token_id
from ragkv.blend.cache import Segment
from ragkv.blend.config import BlendConfig, check_ratio
from ragkv.blend.request import BlendRequest
from ragkv.blend.result import BlendResult, BlendStats
from ragkv.keys import chunk_key
from ragkv.models import fingerprint as model_fingerprint
from ragkv.neighbours import neighbour_contexts
from ragkv.policy import PREFIX_POLICY, PrecomputePolicy, StorageFormat, prefill_kv
from ragkv.prompt import Prompt, PromptTemplate
from ragkv.store.entry import EntryMeta, encode
from ragkv.store.errors import StoreError

log = logging.getLogger("ragkv.blend")


class BlendEngine:
    """CacheBlend over a ragkv store for one model.

    ``config`` (BlendConfig): how requests blend (ratio, selector, pipelined loading).
    ``policy`` (PrecomputePolicy) and ``namespace``: what a chunk's K/V and key are; every reader and
    writer of one store must agree on them. ``storage`` (StorageFormat): how entries this engine
    writes are encoded (default: the model's dtype).

    ``prefill(question, contexts)`` / ``prefill_prompt(prompt)`` return the next-token logits and a
    cache that ``model.generate`` continues (see ragkv.integrations.hf for generation).
    A model serves one request at a time: the engine points its attention at ragkv's for the
    duration of a layer call (ragkv.adapter).

    ``model``: a transformers model, or any model that carries its own implementation of the layer
    interface (``ModelAdapter.of``; ragkv.integrations.vllm's over vLLM's model). ``fingerprint``:
    the model's key digest (``ragkv.models.fingerprint(...).digest()``) when the caller has it
    without the weights being hashed here (a model that is not a transformers model must give it).
    """

    def __init__(self, model, tokenizer, store, config: BlendConfig | None = None, *,
                 template: PromptTemplate | None = None, policy: PrecomputePolicy | None = None,
                 storage: StorageFormat | None = None, namespace: str = "", fingerprint: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.config = config or BlendConfig()
        self.storage = storage or StorageFormat()
        self.adapter = ModelAdapter.of(model)
        self.config.selector.check(self.adapter.num_layers)
        self.template = template or PromptTemplate.for_tokenizer(tokenizer)
        self.policy = (policy or PrecomputePolicy()).resolve(model)
        self.namespace = namespace
        self.fingerprint = fingerprint or model_fingerprint(model, tokenizer).digest()
        self.policy_id = self.policy.policy_id(self.template)
        self.lead_id = self.policy.lead_id(self.template)
        self.sink_ids = self.policy.sink_ids(self.template)
        self.chunk_start = self.policy.chunk_start(self.template)  # stored start position of every chunk
        self.lead_start = len(self.sink_ids)  # ... and of every lead entry
        # with gap 0 (and so no context) the chunk entry already sits right behind the sink: it is its own lead
        self.lead = self.policy.lead and self.chunk_start != self.lead_start
        self.model_dtype = str(self.adapter.dtype).removeprefix("torch.")
        self._controller = None  # built on the first ratio="auto" (measures the model once)

    @property
    def pad_token_id(self) -> int | None:
        return pad_token_id(self.model, self.tokenizer)

    def with_config(self, **changes) -> BlendEngine:
        """A view of this engine (same model, store, policy, measurements) with other BlendConfig fields."""
        other = copy.copy(self)
        other.config = replace(self.config, **changes)
        other.config.selector.check(self.adapter.num_layers)
        return other

    # ------------------------------------------------------------------ keys and the write path

    def chunk_key(self, ids: Sequence[int]) -> str:
        return chunk_key(self.fingerprint, ids, self.policy_id, self.namespace)

    def lead_key(self, ids: Sequence[int]) -> str:
        """The key of a chunk's lead entry (PrecomputePolicy.lead)."""
        return chunk_key(self.fingerprint, ids, self.lead_id, self.namespace)

    def prefix_key(self, ids: Sequence[int]) -> str:
        return chunk_key(self.fingerprint, ids, PREFIX_POLICY, self.namespace)

    def entry_keys(self, ids: Sequence[int]) -> list[tuple[str, str]]:
        """(key, kind) of every entry the write path stores for one chunk: its gap/context entry and,
        under ``self.lead``, its lead entry."""
        keys = [(self.chunk_key(ids), "chunk")]
        if self.lead:
            keys.append((self.lead_key(ids), "lead"))
        return keys

    def layout(self, kind: str) -> tuple[int, str]:
        """(stored start position, policy id) of an entry of ``kind``: 'chunk' (behind the sink, the gap
        and the context), 'lead' (right behind the sink) or 'prefix' (the exact prefix, at 0)."""
        if kind == "chunk":
            return self.chunk_start, self.policy_id
        if kind == "lead":
            return self.lead_start, self.lead_id
        if kind == "prefix":
            return 0, PREFIX_POLICY
        raise ValueError(f"entry kind {kind!r}: valid are chunk, lead, prefix")

    def entry_meta(self, key: str, ids: Sequence[int], start: int, policy: str) -> EntryMeta:
        """The metadata of an entry this engine writes: ``ids`` prefilled from position ``start``
        under ``policy`` (``layout(kind)``), with the model's shape and fingerprint and this engine's
        storage."""
        a = self.adapter
        storage, axis = self.storage.resolve(self.model_dtype)
        return EntryMeta(
            key=key, token_ids=tuple(ids), start_pos=start, num_layers=a.num_layers,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, model_dtype=self.model_dtype,
            storage_dtype=storage, quant_axis=axis, fingerprint=self.fingerprint, policy=policy,
        )

    def prefill_chunks(self, chunks: Sequence[Sequence[int]], batch_tokens: int = 4096, kind: str = "chunk",
                       contexts: Sequence[Sequence[int]] | None = None):
        """Per chunk, per layer (K, V) of each chunk prefilled on its own as an entry of ``kind``
        (``layout``): 'chunk' behind the sink and the gap, and under ``context=k`` behind
        ``contexts[i]`` (``neighbour_contexts``: its k nearest chunks of the corpus the writer sees);
        'lead' right behind the sink; 'prefix' at position 0, behind nothing."""
        self.layout(kind)  # (a clear error for an unknown kind)
        if kind == "prefix":
            return prefill_kv(self.model, [], chunks, batch_tokens, gap=0)
        if kind == "lead":
            return prefill_kv(self.model, self.sink_ids, chunks, batch_tokens, gap=0)
        return prefill_kv(self.model, self.sink_ids, chunks, batch_tokens, gap=self.policy.gap,
                          contexts=contexts if self.policy.context else None)

    def write_entry(self, key: str, ids: Sequence[int], kv, kind: str = "chunk") -> int:
        """Encode and store one entry of ``kind`` (``layout``); -> bytes written (0: the store already
        held it). Raises StoreError when the store could not take it."""
        enc = encode(self.entry_meta(key, ids, *self.layout(kind)), kv)
        return enc.nbytes if self.store.put_encoded(key, enc) else 0

    def compute_and_store(self, segments: Sequence[Segment], write_back: bool = True,
                          pool: Sequence[Sequence[int]] | None = None) -> None:
        """Prefill segments on their own as entries of their kind (``seg.layers``) and write them
        back; a failed write-back (store down or full) is logged and never fails the request.
        ``pool``: the chunks neighbours are chosen from under ``context=k`` (the prompt's chunks)."""
        for kind in ("prefix", "lead", "chunk"):
            group = [s for s in segments if s.kind == kind]
            if not group:
                continue
            ids = [s.ids for s in group]
            contexts = None
            if kind == "chunk" and self.policy.context:
                contexts = neighbour_contexts(ids, ids if pool is None else pool, self.policy.context)
            kvs = self.prefill_chunks(ids, kind=kind, contexts=contexts)
            for seg, kv in zip(group, kvs):
                seg.layers, seg.stored_start = kv, self.layout(kind)[0]
                if not write_back:
                    continue
                try:
                    self.write_entry(seg.key, seg.ids, kv, kind)
                except StoreError as e:
                    log.warning("write-back of %s failed: %s", seg.key, e)

    def ensure(self, contexts: Sequence[str]) -> tuple[list[str], int]:
        """Make sure every context's chunk entries are in the store (under ``self.lead`` its lead
        entry too, as the precompute job writes them); return (the chunks' keys, number of chunks
        with an entry computed)."""
        chunks = self.template.chunks(contexts, self.adapter.max_positions)
        keys, missing, computed = [], [], 0
        for ids in chunks:
            entries = self.entry_keys(ids)  # (the chunk entry first)
            keys.append(entries[0][0])
            segs = [Segment(key, ids, 0, lead=kind == "lead") for key, kind in entries if not self.store.contains(key)]
            missing += segs
            computed += bool(segs)
        if missing:
            self.compute_and_store(missing, pool=chunks)
        return keys, computed

    # ------------------------------------------------------------------ the read path

    def build_prompt(self, question: str, contexts: Sequence[str]) -> Prompt:
        return self.template.build(question, contexts, self.adapter.max_positions)

    def prefill(self, question: str, contexts: Sequence[str], ratio: float | str | None = None) -> BlendResult:
        return self.prefill_prompt(self.build_prompt(question, contexts), ratio=ratio)

    @torch.inference_mode()
    def prefill_prompt(self, prompt: Prompt, ratio: float | str | None = None) -> BlendResult:
        """Blend one prompt. Its entries are pinned in the store for the whole request, so eviction
        never removes K/V a request is reading."""
        t0 = time.perf_counter()
        ratio = check_ratio(self.config.ratio if ratio is None else ratio)
        self.adapter.check_length(prompt.num_tokens)
        if not prompt.suffix_ids:
            raise ValueError("the suffix (question) must have at least one token")
        segments = self._segments(prompt)
        stats = BlendStats(chunks=len(prompt.chunk_ids), prompt_tokens=prompt.num_tokens,
                           selector=self.config.selector.name)
        pinned = [s.key for s in segments] + [self.chunk_key(s.ids) for s in segments if s.lead]  # (+ fallback)
        with self.store.pin(pinned):
            self._lookup(segments, stats)
            stats.t_lookup = time.perf_counter() - t0
            stats.reused_tokens = sum(len(s.ids) for s in segments if not s.is_prefix and s.layers is None)
            stats.ratio = self._resolve_ratio(ratio, segments, prompt)
            result = BlendRequest(self, prompt, segments, stats.ratio, stats).run()
        stats.t_total = time.perf_counter() - t0
        return result

    def _segments(self, prompt: Prompt) -> list[Segment]:
        segments = []
        if prompt.prefix_ids:
            segments.append(Segment(self.prefix_key(prompt.prefix_ids), prompt.prefix_ids, 0, is_prefix=True))
        for i, (ids, start) in enumerate(zip(prompt.chunk_ids, prompt.chunk_starts())):
            lead = i == 0 and self.lead
            segments.append(Segment(self.lead_key(ids) if lead else self.chunk_key(ids), ids, start, lead=lead))
        return segments

    def _lookup(self, segments: list[Segment], stats: BlendStats) -> None:
        """Find every segment's entry; prefill and write back the missing ones. A first chunk without
        its lead entry is served by its gap entry when the store holds that (a store written without
        ``lead``); only when neither is there is the lead entry computed."""
        missing = []
        for seg in segments:
            meta = self._stored_meta(seg)
            if meta is None and seg.lead:
                fallback = replace(seg, key=self.chunk_key(seg.ids), lead=False)
                if (meta := self._stored_meta(fallback)) is not None:
                    seg.key, seg.lead = fallback.key, False
            if meta is None:
                missing.append(seg)
            else:
                seg.stored_start = meta.start_pos
        stats.lead = any(s.lead for s in segments)
        stats.misses = sum(not s.is_prefix for s in missing)
        stats.hits = sum(not s.is_prefix for s in segments) - stats.misses
        if missing:
            self.compute_and_store(missing, pool=[s.ids for s in segments if not s.is_prefix])

    def _stored_meta(self, seg: Segment) -> EntryMeta | None:
        meta = self.store.get_meta(seg.key)
        return meta if meta is not None and self._meta_matches(meta, seg) else None

    def _meta_matches(self, meta: EntryMeta, seg: Segment) -> bool:
        a = self.adapter
        return (
            tuple(meta.token_ids) == tuple(seg.ids) and meta.num_layers == a.num_layers
            and meta.num_kv_heads == a.num_kv_heads and meta.head_dim == a.head_dim
            and meta.fingerprint == self.fingerprint
        )

    def _resolve_ratio(self, ratio: float | str, segments: list[Segment], prompt: Prompt) -> float:
        if ratio != "auto":
            return ratio
        stored = [s.key for s in segments if not s.is_prefix and s.layers is None]
        return self.auto_ratio(stored, sum(map(len, prompt.chunk_ids)), len(prompt.suffix_ids), prompt.num_tokens)

    def auto_ratio(self, keys: Sequence[str], chunk_tokens: int, suffix_tokens: int, total: int) -> float:
        """The loading controller's ratio for these stored chunks (ragkv.controller): recompute what
        one layer's load from the store hides, never below ``config.ratio_floor``."""
        from ragkv.controller import RatioController, measure_layer_cost, measure_layer_read

        if self._controller is None:
            self._controller = RatioController(measure_layer_cost(self.model, context_tokens=total))
        floor = self.config.ratio_floor
        if not keys:
            return floor
        nbytes, seconds = measure_layer_read(self.store, keys, layer=self.adapter.num_layers - 1)
        bandwidth = nbytes / seconds if nbytes and seconds > 0 else 0.0
        return self._controller.choose(nbytes, bandwidth, chunk_tokens, suffix_tokens, floor)
