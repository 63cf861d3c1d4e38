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
from ragkv.models import fingerprint
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
    """

    def __init__(self, model, tokenizer, store, config: BlendConfig | None = None, *,
                 template: PromptTemplate | None = None, policy: PrecomputePolicy | None = None,
                 storage: StorageFormat | None = None, namespace: str = ""):
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
        self.fingerprint = fingerprint(model, tokenizer).digest()
        self.policy_id = self.policy.policy_id(self.template)
        self.sink_ids = self.policy.sink_ids(self.template)
        self.chunk_start = self.policy.chunk_start(self.template)  # stored start position of every chunk
        self.model_dtype = str(model.dtype).removeprefix("torch.")
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

    def prefix_key(self, ids: Sequence[int]) -> str:
        return chunk_key(self.fingerprint, ids, PREFIX_POLICY, self.namespace)

    def entry_meta(self, key: str, ids: Sequence[int], start: int, policy: str) -> EntryMeta:
        """The metadata of an entry this engine writes: ``ids`` prefilled from position ``start``
        under ``policy`` (``self.policy_id`` at ``self.chunk_start`` for chunks, PREFIX_POLICY at 0
        for the exact prefix), with the model's shape and fingerprint and this engine's storage."""
        a = self.adapter
        storage, axis = self.storage.resolve(self.model_dtype)
        return EntryMeta(
            key=key, token_ids=tuple(ids), start_pos=start, num_layers=a.num_layers,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, model_dtype=self.model_dtype,
            storage_dtype=storage, quant_axis=axis, fingerprint=self.fingerprint, policy=policy,
        )

    def prefill_chunks(self, chunks: Sequence[Sequence[int]], batch_tokens: int = 4096, prefix: bool = False,
                       contexts: Sequence[Sequence[int]] | None = None):
        """Per chunk, per layer (K, V) of each chunk prefilled on its own under the precompute policy
        (the exact prefix: at position 0, behind nothing); under ``context=k``, behind ``contexts[i]``
        (``neighbour_contexts``: its k nearest chunks of the corpus the writer sees)."""
        if prefix:
            return prefill_kv(self.model, [], chunks, batch_tokens, gap=0)
        return prefill_kv(self.model, self.sink_ids, chunks, batch_tokens, gap=self.policy.gap,
                          contexts=contexts if self.policy.context else None)

    def write_entry(self, key: str, ids: Sequence[int], kv, prefix: bool = False) -> int:
        """Encode and store one chunk's K/V; -> bytes written (0: the store already held it).
        Raises StoreError when the store could not take it."""
        start, policy = (0, PREFIX_POLICY) if prefix else (self.chunk_start, self.policy_id)
        enc = encode(self.entry_meta(key, ids, start, policy), kv)
        return enc.nbytes if self.store.put_encoded(key, enc) else 0

    def compute_and_store(self, segments: Sequence[Segment], write_back: bool = True,
                          pool: Sequence[Sequence[int]] | None = None) -> None:
        """Prefill segments on their own under the policy (``seg.layers``) and write them back; a
        failed write-back (store down or full) is logged and never fails the request. ``pool``: the
        chunks neighbours are chosen from under ``context=k`` (the prompt's chunks)."""
        for prefix in (True, False):
            group = [s for s in segments if s.is_prefix == prefix]
            if not group:
                continue
            ids = [s.ids for s in group]
            contexts = None
            if not prefix and self.policy.context:
                contexts = neighbour_contexts(ids, ids if pool is None else pool, self.policy.context)
            kvs = self.prefill_chunks(ids, prefix=prefix, contexts=contexts)
            for seg, kv in zip(group, kvs):
                seg.layers, seg.stored_start = kv, 0 if prefix else self.chunk_start
                if not write_back:
                    continue
                try:
                    self.write_entry(seg.key, seg.ids, kv, prefix)
                except StoreError as e:
                    log.warning("write-back of %s failed: %s", seg.key, e)

    def ensure(self, contexts: Sequence[str]) -> tuple[list[str], int]:
        """Make sure every context's chunk K/V is in the store; return (keys, number computed)."""
        chunks = self.template.chunks(contexts, self.adapter.max_positions)
        segs = [Segment(self.chunk_key(ids), ids, 0) for ids in chunks]
        missing = [s for s in segs if not self.store.contains(s.key)]
        if missing:
            self.compute_and_store(missing, pool=chunks)
        return [s.key for s in segs], len(missing)

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
        with self.store.pin([s.key for s in segments]):
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
        for ids, start in zip(prompt.chunk_ids, prompt.chunk_starts()):
            segments.append(Segment(self.chunk_key(ids), ids, start))
        return segments

    def _lookup(self, segments: list[Segment], stats: BlendStats) -> None:
        """Find every segment's entry; prefill and write back the missing ones."""
        missing = []
        for seg in segments:
            meta = self.store.get_meta(seg.key)
            if meta is None or not self._meta_matches(meta, seg):
                missing.append(seg)
            else:
                seg.stored_start = meta.start_pos
        stats.misses = sum(not s.is_prefix for s in missing)
        stats.hits = sum(not s.is_prefix for s in segments) - stats.misses
        if missing:
            self.compute_and_store(missing, pool=[s.ids for s in segments if not s.is_prefix])

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
