"""The loading controller: choose the recompute ratio that the store's load time can hide.

With layer-wise pipelined loading (ragkv.loader), layer i+1's chunk K/V is read while layer i is
recomputed, so a layer costs max(load, recompute) instead of their sum. Recomputing more tokens is
then free until the recompute of a layer takes as long as loading one: the controller picks that
ratio, never below a quality floor (``BlendConfig.ratio_floor``).

    load(layer)        = seconds to read one layer of every chunk from the tier (measured)
    recompute(layer,r) = c0 + c1 * (r * chunk_tokens + suffix_tokens)   (measured on the model)
    auto ratio         = max(floor, largest r with recompute(r) <= load), at most 1

The engine builds one controller per model on its first ``ratio="auto"`` request
(``measure_layer_cost``: c0, c1 by timing one decoder layer at two token counts) and measures the
store's bandwidth on every such request (``measure_layer_read``: one layer of the request's entries).
A non-positive measured slope (timer noise on a tiny model) means the recompute cost could not be
measured: the controller then keeps the floor instead of recomputing everything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerCost:
    """Seconds to recompute one decoder layer for n tokens: c0 + c1 * n."""

    c0: float
    c1: float

    def __call__(self, n_tokens: float) -> float:
        return self.c0 + self.c1 * n_tokens


class _WholeKV:
    """ragkv's cache contract for one layer (ModelAdapter.run_layer): whatever is written, attend
    over the whole given K/V."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv

    def update(self, layer_idx, key_states, value_states, positions):
        return self.kv, self.kv


@torch.inference_mode()
def measure_layer_cost(model, context_tokens: int = 2048, sizes: Sequence[int] = (64, 512), reps: int = 3) -> LayerCost:
    """Time one decoder layer of ``model`` recomputing ``n`` tokens that attend over
    ``context_tokens`` cached positions, for two n; fit c0 + c1 * n."""
    from ragkv.adapter import ModelAdapter

    a = ModelAdapter.of(model)
    li = a.num_layers // 2
    times = []
    for n in sizes:
        total = max(context_tokens, n)
        k = torch.randn(1, a.num_kv_heads, total, a.head_dim, dtype=a.dtype, device=a.device)
        h = a.embed(torch.zeros(1, n, dtype=torch.long, device=a.device)).normal_()
        pos = torch.arange(total - n, total, device=a.device)
        mask = torch.zeros(1, 1, n, total, dtype=a.dtype, device=a.device)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            a.run_layer(li, h, pos, _WholeKV(k), attention_mask=mask)
            best = min(best, time.perf_counter() - t)
        times.append(best)
    (n0, n1), (t0, t1) = sizes, times
    c1 = max(0.0, (t1 - t0) / (n1 - n0))
    if c1 == 0.0:
        logging.getLogger("ragkv.controller").warning(
            "recompute cost per token measured as <= 0 (%d tokens: %.4f s, %d tokens: %.4f s); "
            "ratio='auto' will use the floor", n0, t0, n1, t1)
    return LayerCost(max(0.0, t0 - c1 * n0), c1)


def measure_layer_read(store, keys: Sequence[str], layer: int = 0) -> tuple[int, float]:
    """(bytes, seconds) to read one layer of each of ``keys`` from ``store``."""
    nbytes, t = 0, time.perf_counter()
    for key in keys:
        got = store.get_layer(key, layer)
        if got is not None:
            nbytes += got.nbytes
    return nbytes, time.perf_counter() - t


@dataclass
class RatioController:
    """Chooses ratios for one model from a measured layer cost and a tier's measured bandwidth."""

    cost: LayerCost

    def load_seconds(self, layer_bytes: int, bandwidth: float) -> float:
        return float("inf") if bandwidth <= 0 else layer_bytes / bandwidth

    def hidden_ratio(self, layer_bytes: int, bandwidth: float, chunk_tokens: int, suffix_tokens: int) -> float:
        """The largest ratio whose per-layer recompute fits inside one layer's load (may be 0)."""
        load = self.load_seconds(layer_bytes, bandwidth)
        if chunk_tokens <= 0 or self.cost.c1 <= 0:  # nothing to recompute, or a cost we could not measure
            return 0.0
        if load == float("inf"):
            return 1.0
        r = (load - self.cost(suffix_tokens)) / (self.cost.c1 * chunk_tokens)
        return min(1.0, max(0.0, r))

    def choose(self, layer_bytes: int, bandwidth: float, chunk_tokens: int, suffix_tokens: int,
               floor: float) -> float:
        """The auto ratio: recompute what the load hides, never below the quality ``floor``."""
        return max(floor, self.hidden_ratio(layer_bytes, bandwidth, chunk_tokens, suffix_tokens))
