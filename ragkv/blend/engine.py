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

Keys and the write path are the engine's ``keys`` (ragkv.keys.Keyspace) and ``prefiller``
(ragkv.prefill.Prefiller), the same that the precompute job writes with: misses are prefilled and
written back as the job would have stored them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from ragkv.blend.cache import Segment
from ragkv.blend.config import BlendConfig, check_ratio
from ragkv.blend.request import BlendRequest
from ragkv.blend.result import BlendResult, BlendStats
from ragkv.keys import ModelFingerprint
from ragkv.policy import PrecomputePolicy, StorageFormat
from ragkv.prefill import Prefiller
from ragkv.prompt import Prompt, PromptTemplate


class BlendEngine:
    """CacheBlend over a ragkv store for one model.

    ``model``: a transformers model, or one that brings ragkv's layer interface (``ModelAdapter.of``:
    ragkv.integrations.vllm's over vLLM's own model, which then also gives ``model_fingerprint``).
    ``config`` (BlendConfig): how requests blend (ratio, selector, pipelined loading).
    ``policy`` (PrecomputePolicy) and ``namespace``: what a chunk's K/V and key are; every reader and
    writer of one store must agree on them. ``storage`` (StorageFormat): how entries this engine
    writes back are encoded (default: the model's dtype).

    ``prefill(question, contexts)`` / ``prefill_prompt(prompt)`` return the next-token logits and a
    cache that ``model.generate`` continues (see ragkv.integrations.hf for generation).
    One request per model at a time: ``prefill_prompt`` holds ``exclusive()`` (the model's lock,
    shared by every engine over that model), and so must a caller that goes on to generate from the
    cache it returned.
    """

    def __init__(self, model, tokenizer, store, config: BlendConfig | None = None, *,
                 template: PromptTemplate | None = None, policy: PrecomputePolicy | None = None,
                 storage: StorageFormat | None = None, namespace: str = "",
                 model_fingerprint: ModelFingerprint | None = None):
        self.prefiller = Prefiller(model, tokenizer, store, template=template, policy=policy, storage=storage,
                                   namespace=namespace, model_fingerprint=model_fingerprint)
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.adapter = self.prefiller.adapter
        self.keys = self.prefiller.keys  # what every entry is called (ragkv.keys.Keyspace)
        self.template = self.prefiller.template
        self.config = config or BlendConfig()
        self.config.selector.check(self.adapter.num_layers)
        self._controller = None  # built on the first ratio="auto" (measures the model once)

    def exclusive(self):
        """The model's lock (re-entrant): hold it across a prefill and the generation that continues it."""
        return self.adapter.lock

    def with_config(self, **changes) -> BlendEngine:
        """A view of this engine (same model, store, keys, measurements) with other BlendConfig fields."""
        other = copy.copy(self)
        other.config = replace(self.config, **changes)
        other.config.selector.check(self.adapter.num_layers)
        return other

    def ensure(self, contexts: Sequence[str]) -> tuple[list[str], int]:
        """Store every context's entries that the store lacks (``Prefiller.ensure``)."""
        return self.prefiller.ensure(contexts)

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
        pinned = [s.key for s in segments] + [self.keys.chunk_key(s.ids) for s in segments if s.lead]  # (+ fallback)
        with self.exclusive(), self.store.pin(pinned):
            self._lookup(segments, stats)
            stats.t_lookup = time.perf_counter() - t0
            stats.reused_tokens = sum(len(s.ids) for s in segments if not s.is_prefix and s.layers is None)
            stats.ratio = self._resolve_ratio(ratio, segments, prompt)
            result = BlendRequest(self, prompt, segments, stats.ratio, stats).run()
        stats.t_total = time.perf_counter() - t0
        return result

    def _segments(self, prompt: Prompt) -> list[Segment]:
        keys, segments = self.keys, []
        if prompt.prefix_ids:
            segments.append(Segment(keys.prefix_key(prompt.prefix_ids), prompt.prefix_ids, 0, is_prefix=True))
        for i, (ids, start) in enumerate(zip(prompt.chunk_ids, prompt.chunk_positions())):
            lead = i == 0 and keys.lead
            segments.append(Segment(keys.key(ids, "lead" if lead else "chunk"), ids, start, lead=lead))
        return segments

    def _lookup(self, segments: list[Segment], stats: BlendStats) -> None:
        """Find every segment's entry; prefill and write back the missing ones. A first chunk without
        its lead entry is served by its chunk entry when the store holds that (a store written without
        ``lead``); only when neither is there is the lead entry computed."""
        missing = []
        for seg in segments:
            meta = self._stored_meta(seg.key, seg.ids)
            if meta is None and seg.lead and (meta := self._stored_meta(self.keys.chunk_key(seg.ids), seg.ids)):
                seg.key, seg.lead = self.keys.chunk_key(seg.ids), False
            if meta is None:
                missing.append(seg)
            else:
                seg.stored_start = meta.start_pos
        stats.lead = any(s.lead for s in segments)
        stats.misses = sum(not s.is_prefix for s in missing)
        stats.hits = sum(not s.is_prefix for s in segments) - stats.misses
        if missing:
            kvs = self.prefiller.compute([(s.key, s.ids, s.kind) for s in missing],
                                         pool=[s.ids for s in segments if not s.is_prefix])
            for seg, kv in zip(missing, kvs):
                seg.hold(kv, self.keys)

    def _stored_meta(self, key: str, ids: Sequence[int]):
        meta = self.store.get_meta(key)
        return meta if meta is not None and self.keys.matches(meta, ids) else None

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
