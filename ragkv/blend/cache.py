"""The fused cache a blended request's decoder layers write into, and its handoff to generation.

Per layer it holds the prompt's K/V ``[1, kv_heads, T, head_dim]``: stored entries copied in at
their prompt positions (keys re-rotated from their stored positions, int8 dequantized on the fly),
then the fresh K/V of the rows a layer recomputes scattered over them. The layer's attention then
reads the whole fused K/V. After the last layer the first T-1 positions become a ``DynamicCache``
(views, no copy) that ``generate`` continues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.kernels import dispatch as ops
from ragkv.store.entry import StoredLayer


@dataclass
class Segment:
    """One cached piece of the prompt: the exact prefix or one chunk."""

    key: str
    ids: list[int]
    start: int  # position in this prompt
    is_prefix: bool = False
    lead: bool = False  # the prompt's first chunk, read from its lead entry (PrecomputePolicy.lead)
    stored_start: int = 0  # position of its first token when it was prefilled
    layers: list | None = None  # computed during this request: [(K, V)] per layer, model dtype

    @property
    def end(self) -> int:
        return self.start + len(self.ids)

    @property
    def kind(self) -> str:
        """How its entry was prefilled: 'prefix', 'lead' or 'chunk' (ragkv.keys.Keyspace.layout)."""
        return "prefix" if self.is_prefix else "lead" if self.lead else "chunk"

    def hold(self, kv: list, keys) -> None:
        """K/V computed during this request, prefilled as an entry of its kind is (``keys``: the Keyspace)."""
        self.layers, self.stored_start = kv, keys.layout(self.kind)[0]


class FusedCache:
    """ragkv's side of the cache contract (``ModelAdapter.run_layer``): ``update(li, k, v, positions)``."""

    def __init__(self, adapter, total: int):
        self.adapter, self.total = adapter, total
        # read once: the model's dtype/device properties walk its parameters on every access
        self.dtype, self.device = adapter.dtype, adapter.device
        self.inv_freq = adapter.inv_freq.to(self.device)
        self.keys: list[torch.Tensor | None] = [None] * adapter.num_layers
        self.values: list[torch.Tensor | None] = [None] * adapter.num_layers
        # the re-rotation of the plain keys: the same deltas in every layer, so the per-token deltas
        # and the kernel's tables are built once per request (per set of fused segments)
        self._rotation: tuple | None = None  # (key, delta [hi - lo], tables)

    def fuse(self, li: int, parts: Sequence[tuple[Segment, StoredLayer | tuple]]) -> None:
        """Build layer li's fused K/V from (segment, its layer li) pairs: a StoredLayer read from the
        store or the (K, V) computed during this request. Positions no part covers stay
        uninitialised: the caller recomputes every one of them in this layer."""
        a = self.adapter
        shape = (1, a.num_kv_heads, self.total, a.head_dim)
        k_all = torch.empty(shape, dtype=self.dtype, device=self.device)
        v_all = torch.empty(shape, dtype=self.dtype, device=self.device)
        inv = self.inv_freq
        lo, hi, deltas = self.total, 0, []  # the span of plain (unquantized) keys still to re-rotate
        for seg, item in parts:
            n = len(seg.ids)
            dst_k, dst_v = k_all[0, :, seg.start : seg.end], v_all[0, :, seg.start : seg.end]
            if isinstance(item, StoredLayer):
                k, v, k_scale, v_scale = item.k, item.v, item.k_scale, item.v_scale
            else:
                (k, v), k_scale, v_scale = item, None, None
            k, v = k.to(self.device), v.to(self.device)
            shift = seg.start - seg.stored_start
            if k_scale is not None:  # dequantize and re-rotate in one pass
                delta = torch.full((n,), shift, dtype=torch.long, device=self.device)
                dst_k.copy_(ops.rope_shift(k, delta, inv, scale=k_scale.to(self.device), out_dtype=self.dtype))
            else:
                dst_k.copy_(k)
                if shift:
                    lo, hi = min(lo, seg.start), max(hi, seg.end)
                    deltas.append((seg.start, n, shift))
            if v_scale is not None:
                dst_v.copy_(v.float() * v_scale.to(self.device))
            else:
                dst_v.copy_(v)
        if deltas:  # one rope_shift over the span, in place: the chunks sit side by side, each with its own delta
            delta, tables = self._rotation_for(lo, hi, deltas)
            span = k_all[0, :, lo:hi]
            ops.rope_shift(span, delta, inv, out_dtype=self.dtype, tables=tables, out=span)
        self.keys[li], self.values[li] = k_all, v_all

    def _rotation_for(self, lo: int, hi: int, deltas: list[tuple[int, int, int]]):
        """(delta [hi - lo], rope tables) of the span [lo, hi) whose segments (start, n, shift) move by
        shift; built when the fused segments change (a layer that fuses fewer of them), else reused."""
        key = (lo, hi, tuple(deltas))
        if self._rotation is None or self._rotation[0] != key:
            delta = torch.zeros(hi - lo, dtype=torch.long, device=self.device)
            for start, n, shift in deltas:
                delta[start - lo : start - lo + n] = shift
            self._rotation = (key, delta, ops.rope_tables(delta, self.inv_freq))
        return self._rotation[1:]

    def update(self, li: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor, positions: torch.Tensor):
        """The fresh K/V [1, kv_heads, n, head_dim] of the rows at ``positions`` [n], scattered over
        layer li's fused K/V; -> the whole fused K/V [1, kv_heads, T, head_dim] to attend over."""
        ops.scatter_rows(self.keys[li][0], fresh_k[0], positions)
        ops.scatter_rows(self.values[li][0], fresh_v[0], positions)
        return self.keys[li], self.values[li]

    def handoff(self, length: int):
        """A DynamicCache over the first ``length`` positions (views of the fused K/V, no copy)."""
        return self.adapter.cache_from([k[:, :, :length] for k in self.keys],
                                       [v[:, :, :length] for v in self.values])
