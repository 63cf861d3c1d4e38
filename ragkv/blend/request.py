"""One blended request: the layer loop over the model's own decoder layers.

    schedule = selector.schedule(...)       which chunk rows are recomputed from layer 0, and where
                                            the active set narrows (ragkv.blend.select); a query-aware
                                            selector first runs the probe: the suffix alone through
                                            every layer over the fused stored K/V, its attention read
    per layer li:
        fuse      stored K/V of every segment not entirely recomputed in this layer (or scored
                  here), re-rotated to its prompt positions (ragkv.blend.cache)
        narrow    at a check layer, the K/V of every active row first (ModelAdapter.layer_kv), scored
                  against the stored ones; the chunk rows the selector scores highest are kept and
                  only they (with the suffix) run the rest of that layer and the next ones
        compute   the decoder layer over the active rows: the chosen chunk tokens + the suffix
                  (+ the prefix while every chunk token is active and the kernel takes is_causal,
                  so those layers run as a plain causal prefill); attention causal by original
                  position (ragkv.blend.attention)
    handoff   logits of the last token, and the fused cache minus its last position

A stored layer that fails to arrive (vanished, corrupt, store error, timeout) makes that segment
computed now, for this request; it is written back unless the store is failing.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import replace

import torch

from ragkv.blend.attention import LayerCalls
from ragkv.blend.cache import FusedCache, Segment
from ragkv.blend.result import BlendResult, BlendStats
from ragkv.blend.select import Schedule, SelectionRequest
from ragkv.kernels import dispatch as ops
from ragkv.loader import Miss, make_loader, read_layer
from ragkv.prompt import Prompt
from ragkv.store.entry import StoredLayer

_COUNTERS = {"corrupt": "corrupt", "unsupported": "corrupt", "absent": "vanished", "error": "store_errors",
             "timeout": "timeouts"}


class BlendRequest:
    """One request's state: its segments, the fused cache, the active rows, the loader. It reads its
    engine's collaborators once (adapter, config, store, prefiller) and never calls back into it."""

    def __init__(self, engine, prompt: Prompt, segments: list[Segment], ratio: float, stats: BlendStats):
        self.prompt, self.segments, self.stats = prompt, segments, stats
        self.config, self.store, self.prefiller = engine.config, engine.store, engine.prefiller
        a = self.adapter = engine.adapter
        self.P, self.C, self.T = len(prompt.prefix_ids), sum(map(len, prompt.chunk_ids)), prompt.num_tokens
        chunk_rows = [(s.start - self.P, len(s.ids)) for s in segments if not s.is_prefix]
        # the first chunk is exact when read from its lead entry and that was prefilled behind this very
        # prefix (the template sink; under sink 'bos'/'none' it sat behind less)
        exact_first = any(s.lead for s in segments) and list(prompt.prefix_ids) == list(engine.keys.sink_ids)
        self.selection = SelectionRequest(self.P, self.C, self.T, tuple(chunk_rows), ratio, a.num_layers,
                                          a.num_kv_heads, lead=exact_first)
        self.positions = torch.arange(self.T, device=a.device)
        self.cache = FusedCache(a, self.T)
        self.calls = LayerCalls(a, self.T)
        self.write_back = True  # off once the store fails or hangs during this request
        self.input_ids = torch.tensor([prompt.input_ids], device=a.device)
        self.from_store = [s.key for s in segments if s.layers is None]
        self._loader = None

    # ------------------------------------------------------------------ the request

    def run(self) -> BlendResult:
        stats, a = self.stats, self.adapter
        with ExitStack() as stack:  # the loader thread is closed on every exit
            self._stack = stack
            ts = time.perf_counter()
            schedule = self.config.selector.schedule(replace(self.selection, probe=self._probe))
            stats.t_select = time.perf_counter() - ts
            self._set_active(self._initial(schedule.start))
            hidden = a.embed(self.input_ids[:, self.active])
            first = 0 if schedule.start.numel() < self.C else min(schedule.checks, default=a.num_layers)
            for li in range(a.num_layers):
                loaded = None if self.cache.keys[li] is not None else self._take(li, first)
                hidden = self._layer(li, hidden, schedule, loaded)
        stats.t_load_io = self._loader.io_seconds if self._loader is not None else 0.0
        tc = time.perf_counter()
        logits = a.logits(hidden)
        handoff = self.cache.handoff(self.T - 1)
        stats.t_compute += time.perf_counter() - tc
        selected = self.active[(self.active >= self.P) & (self.active < self.P + self.C)]
        stats.recomputed_tokens = int(selected.numel())
        stats.cached_tokens = self._cached_tokens(selected)
        return BlendResult(self.input_ids, logits, handoff, stats, selected)

    def _take(self, li: int, first: int) -> dict | None:
        """Layer li of every stored entry from the request's loader (started on first use, reading
        from layer ``first`` on); None below that layer or when nothing comes from the store."""
        if not self.from_store or li < first:
            return None
        if self._loader is None:
            cfg = self.config
            self._loader = self._stack.enter_context(
                make_loader(cfg.pipelined, self.store, self.from_store, range(first, self.adapter.num_layers),
                            timeout_s=cfg.load_timeout_s))
        tw = time.perf_counter()
        loaded = dict(zip(self._loader.keys, self._loader.layer(li)))
        self.stats.t_load += time.perf_counter() - tw
        if self._loader.timed_out:
            self.write_back = False
        for seg in self.segments:  # an entry that failed is recomputed now, needed in this layer or not
            if seg.layers is None and isinstance(loaded.get(seg.key), Miss):
                self._recover(seg, loaded[seg.key])
        return loaded

    def _probe(self, observe) -> None:
        """The suffix alone through every layer over the fused stored K/V (stale: not yet corrected),
        ``observe(layer, probs)`` seeing its attention in each. The fused layers are kept for the pass
        that follows (the store is read once)."""
        a, suffix = self.adapter, self.positions[self.P + self.C :]
        self._set_active(suffix)
        hidden = a.embed(self.input_ids[:, suffix])
        for li in range(a.num_layers):
            self._fuse(li, self._take(li, 0), checks={})
            hidden = a.run_layer(li, hidden, suffix, self.cache, **self.calls(suffix, capture=observe))

    def _fuse(self, li: int, loaded: dict | None, checks: dict) -> None:
        tf = time.perf_counter()
        parts = [(seg, self._stored(seg, li, loaded)) for seg in self.segments if self._needs_stored(seg, li, checks)]
        self.cache.fuse(li, parts)
        self.stats.t_fuse += time.perf_counter() - tf

    def _layer(self, li: int, hidden: torch.Tensor, schedule: Schedule, loaded: dict | None) -> torch.Tensor:
        if self.cache.keys[li] is None:  # (a probe fused it already)
            self._fuse(li, loaded, schedule.checks)
        tc = time.perf_counter()
        if li in schedule.checks:
            hidden = self._narrow(li, hidden, schedule.score, schedule.checks[li])
        active = self.active
        if li == self.adapter.num_layers - 1 and active.numel() > 1:
            # the last layer: every active row's K/V (generation attends to them), but its output is
            # read for the last token only (the logits), so only that row runs attention and the MLP
            self.cache.update(li, *self.adapter.layer_kv(li, hidden, active, self.calls.rope(active)), active)
            active, hidden = active[-1:], hidden[:, -1:]
        hidden = self.adapter.run_layer(li, hidden, active, self.cache, **self.calls(active))
        self.stats.t_compute += time.perf_counter() - tc
        return hidden

    def _narrow(self, li: int, hidden: torch.Tensor, score, keep_rows: int) -> torch.Tensor:
        """Check layer li: every active row's K/V (only that much of the layer), scored against the
        stored K/V and scattered; the ``keep_rows`` chunk rows scored highest and the suffix stay
        active (``self.active``) and run the rest of the layer. -> their hidden states."""
        active = self.active
        score_rows = torch.nonzero((active >= self.P) & (active < self.P + self.C)).flatten()
        if keep_rows >= score_rows.numel():  # nothing to drop
            return hidden
        k, v = self.adapter.layer_kv(li, hidden, active, self.calls.rope(active))  # [1, Hkv, n, D]
        idx = active[score_rows]
        stored_k, stored_v = self.cache.keys[li][0], self.cache.values[li][0]  # [Hkv, T, D]
        scores = score(k[0][:, score_rows], stored_k[:, idx], v[0][:, score_rows], stored_v[:, idx])
        self.cache.update(li, k, v, active)
        top = ops.select_topk(scores, keep_rows)
        keep = torch.cat([score_rows[top], torch.nonzero(active >= self.P + self.C).flatten()]).sort().values
        self._set_active(active[keep])  # (prefix rows, active only in whole-prompt layers, drop out)
        return hidden[:, keep]

    # ------------------------------------------------------------------ helpers

    def _cached_tokens(self, selected: torch.Tensor) -> int:
        """Chunk tokens whose K/V came from the store and were not recomputed in the last layer."""
        stored = torch.zeros(self.T, dtype=torch.bool)
        for seg in self.segments:
            if not seg.is_prefix and seg.layers is None:
                stored[seg.start : seg.end] = True
        stored[selected.cpu()] = False
        return int(stored.sum())

    def _initial(self, chunk_rows: torch.Tensor) -> torch.Tensor:
        """Positions active from layer 0: the chunk rows (relative to P) + the suffix, + the prefix
        when every chunk row is active and the kernel takes is_causal (a plain causal prefill)."""
        P, C = self.P, self.C
        rows = torch.cat([chunk_rows.to(self.positions.device) + P, self.positions[P + C :]])
        if C and chunk_rows.numel() == C and self.calls.is_causal:
            rows = torch.cat([self.positions[:P], rows])
        return rows

    def _set_active(self, rows: torch.Tensor) -> None:
        """The one place the active rows (absolute positions computed in the next layers) change."""
        self.active = rows
        covered = torch.zeros(self.T, dtype=torch.bool, device=rows.device)
        covered[rows] = True
        # segments whose every token is recomputed in the layers this active set runs (read once here,
        # not per layer: a host sync per segment and layer costs more than the check)
        self._recomputed = {id(seg) for seg in self.segments if bool(covered[seg.start : seg.end].all())}

    def _needs_stored(self, seg: Segment, li: int, checks: dict) -> bool:
        """A segment's stored K/V are read in layer li unless all of its tokens are recomputed there
        and none is scored against them."""
        return id(seg) not in self._recomputed or (li in checks and not seg.is_prefix)

    def _stored(self, seg: Segment, li: int, loaded: dict | None) -> StoredLayer | tuple:
        if seg.layers is not None:  # computed during this request
            return seg.layers[li]
        got = loaded.get(seg.key) if loaded is not None else None
        if got is None:  # a layer the loader does not cover (the exact prefix, early layers)
            tl = time.perf_counter()
            got = read_layer(self.store, [seg.key], li)[0]
            self.stats.t_load += time.perf_counter() - tl
        if isinstance(got, Miss):
            self._recover(seg, got)
            return seg.layers[li]
        return got

    def _recover(self, seg: Segment, miss: Miss) -> None:
        """An entry that failed since the lookup: counted by cause and computed now for this request;
        written back unless the store itself is failing or stuck."""
        counter = _COUNTERS[miss.reason]
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        if miss.reason in ("error", "timeout"):
            self.write_back = False  # do not wait on a failing store again
        (kv,) = self.prefiller.compute([(seg.key, seg.ids, seg.kind)], write_back=self.write_back,
                                       pool=self.prompt.chunk_ids)
        seg.hold(kv, self.prefiller.keys)
