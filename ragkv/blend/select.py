"""Which chunk tokens a blended request recomputes: selection strategies behind one small interface.

A strategy is one ``Selector`` subclass (a frozen dataclass: its fields are the strategy's settings)
and one entry in ``SELECTORS``. Per request the engine asks it for a ``Schedule``:

    start   chunk rows (indices into the prompt's chunk tokens, 0..C-1) recomputed from layer 0
    checks  {layer: rows to keep}: after computing that layer, keep the active chunk rows whose fresh
            K/V deviate most from the stored ones (scored by ``Schedule.score``), from the next layer on
    (the suffix is recomputed in every layer, the exact prefix in none, whatever the strategy)

``schedule(req)`` sees the prompt's layout and the resolved ratio (``SelectionRequest``); a
strategy that reads the question's attention calls ``req.probe(...)`` first (see ``SelectionRequest``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ragkv.kernels import dispatch as ops

SIGNALS = ("k", "v", "kv")
DEFAULT_CHECK_LAYERS = (1, 3, 6)  # gradual filtering; measured in benchmarks/blend

# fresh_k, cached_k, fresh_v, cached_v [kv_heads, n, head_dim] (None where unused) -> [n] scores
Scorer = Callable[[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class SelectionRequest:
    """What a strategy may look at: the prompt layout (absolute positions), the ratio, the model."""

    prefix_len: int  # P: positions [0, P) are the exact prefix
    chunk_len: int  # C: positions [P, P + C) are the chunk tokens (rows 0..C-1)
    total: int  # T: the suffix is [P + C, T)
    chunk_bounds: tuple[tuple[int, int], ...]  # (first row, rows) of each chunk, rows relative to P
    ratio: float  # fraction of chunk rows recomputed after selection (resolved, not "auto")
    num_layers: int
    kv_heads: int = 1
    lead: bool = False  # the first chunk's K/V are exactly full prefill's: its lead entry, prefilled behind this prefix
    # probe(observe): runs the suffix alone through every layer over the fused stored K/V, calling
    # observe(layer, probs [Hq, S, T], values [Hkv, T, D]) with its attention (and the values it
    # weights) in each; the engine keeps what it loaded
    probe: Callable | None = field(default=None, compare=False, repr=False)  # probe(observe, layers=None)

    @property
    def suffix_len(self) -> int:
        return self.total - self.prefix_len - self.chunk_len

    def keep(self, fraction: float) -> int:
        """Rows kept at ``fraction`` of the chunk tokens: ceil(fraction * C)."""
        return min(self.chunk_len, math.ceil(fraction * self.chunk_len - 1e-9))

    def chunk_offsets(self) -> torch.Tensor:
        """[C] int64: each chunk row's offset in its own chunk (0 at every chunk's first token)."""
        out = torch.zeros(self.chunk_len, dtype=torch.long)
        for first, n in self.chunk_bounds:
            out[first : first + n] = torch.arange(n)
        return out

    def exact_rows(self) -> int:
        """Chunk rows 0..n-1 whose stored K/V are already full prefill's (the first chunk read from
        its lead entry): recomputing them changes nothing."""
        return self.chunk_bounds[0][1] if self.lead and self.chunk_bounds else 0


@dataclass
class Schedule:
    start: torch.Tensor  # [n0] int64 sorted chunk rows active from layer 0
    checks: dict[int, int]  # layer -> chunk rows kept after it (by deviation)
    score: Scorer | None = None  # how deviation is scored at the check layers


class Selector(ABC):
    name: ClassVar[str]

    @abstractmethod
    def schedule(self, req: SelectionRequest) -> Schedule: ...

    def check(self, num_layers: int) -> None:  # noqa: B027 - optional hook
        """Raise ValueError when these settings cannot run on a model of ``num_layers`` layers."""


@dataclass(frozen=True)
class DeviationSelector(Selector):
    """CacheBlend's selection: every chunk token is computed up to the first check layer; at each
    check layer the active chunk tokens whose fresh K/V deviate most from the stored K/V are kept.
    Several check layers = gradual filtering: the kept fraction narrows geometrically from
    ``first_ratio`` (default 2 x ratio) at the first to ``ratio`` at the last.
    signal: which deviation selects tokens: "v" (the paper's choice), "k" or "kv"; normalize divides
    each token's deviation by its stored K/V energy."""

    name: ClassVar[str] = "deviation"
    check_layers: tuple[int, ...] | None = None  # None: (1, 3, 6), cut to the model's depth
    first_ratio: float | None = None
    signal: str = "v"
    normalize: bool = False

    def __post_init__(self):
        if self.signal not in SIGNALS:
            raise ValueError(f"signal {self.signal!r}: valid are {SIGNALS}")
        if self.check_layers is not None:
            layers = tuple(self.check_layers)
            if not layers or not all(isinstance(c, int) and not isinstance(c, bool) for c in layers):
                raise ValueError(f"check_layers must be a non-empty tuple of layer indices, got {self.check_layers!r}")
            if layers[0] < 0 or list(layers) != sorted(set(layers)):
                raise ValueError(f"check_layers must be strictly increasing and >= 0, got {layers}")
            object.__setattr__(self, "check_layers", layers)
        if self.first_ratio is not None and not 0.0 <= self.first_ratio <= 1.0:
            raise ValueError(f"first_ratio must lie in [ratio, 1], got {self.first_ratio}")

    def check(self, num_layers: int) -> None:
        self.layers_for(num_layers)

    def layers_for(self, num_layers: int) -> list[int]:
        """The check layers used on a model of ``num_layers`` layers."""
        if self.check_layers is None:
            return [c for c in DEFAULT_CHECK_LAYERS if c < num_layers - 1] or [min(1, num_layers - 1)]
        if self.check_layers[-1] >= num_layers:
            raise ValueError(f"check layer {self.check_layers[-1]} >= number of layers {num_layers}")
        return list(self.check_layers)

    def layer_ratios(self, ratio: float, n: int) -> list[float]:
        """Fraction of chunk tokens kept after each of ``n`` check layers (the last one is ``ratio``)."""
        if n == 1:
            return [ratio]
        # (a first_ratio below a per-request ratio acts as that ratio: filtering never widens)
        first = max(ratio, self.first_ratio if self.first_ratio is not None else min(1.0, 2 * ratio))
        if ratio == 0.0:
            return [first * (1 - i / (n - 1)) for i in range(n)]
        return [first * (ratio / first) ** (i / (n - 1)) for i in range(n)]

    def schedule(self, req: SelectionRequest) -> Schedule:
        everything = torch.arange(req.chunk_len)
        if req.ratio == 0.0 or req.chunk_len == 0:  # naive reuse: nothing recomputed but the suffix
            return Schedule(everything[:0], {})
        layers = self.layers_for(req.num_layers)
        keep = {li: req.keep(f) for li, f in zip(layers, self.layer_ratios(req.ratio, len(layers)))}
        return Schedule(everything, keep, self.score)

    def score(self, fresh_k, cached_k, fresh_v, cached_v) -> torch.Tensor:
        use_k, use_v = "k" in self.signal, "v" in self.signal
        return ops.kv_deviation(fresh_k if use_k else None, cached_k if use_k else None,
                                fresh_v if use_v else None, cached_v if use_v else None,
                                mode=self.signal, normalize=self.normalize)


@dataclass(frozen=True)
class QuerySelector(Selector):
    """Recompute the chunk tokens the question attends to most. A probe runs the suffix (question +
    assistant header) through every layer over the fused, re-rotated stored K/V; each chunk token is
    scored by the attention the suffix's queries give it, then the top ``ratio`` of chunk tokens (with
    the suffix) are recomputed in every layer, with no fully computed layer.

    rows: use the last ``rows`` suffix queries (None: all of them). heads: "mean" over query heads,
    or "max" within each KV group then mean. skip_layers: ignore the first layers' attention (it is
    mostly positional). depth: run the probe through the first ``depth`` layers only (None: all;
    a shallower probe costs less, the layers it skips are fused by the pass that follows).
    smooth: also credit a token with its neighbours' score within this distance (max-pooling).
    chunk_starts: ignore the first tokens of every chunk (attention sinks score high whatever the
    question). normalize: each layer's attention over the chunks sums to 1. full_layers: recompute
    every chunk token in the first ``full_layers`` layers (as CacheBlend does before its check
    layer), the selected ones after. value_norm: weight each token's attention by the norm of its
    value (what it adds to the suffix's output, not only how much it is looked at: attention sinks
    are looked at a lot and carry near-zero values). starts: also weight each token by where its
    stored K/V are stale: its score is multiplied by (1 + its offset in its chunk) ** -starts (0: off).
    A chunk's stored K/V were computed behind other text than its predecessors in this prompt, and
    its first tokens, which saw only that text, differ most (``StartsSelector``): the product ranks
    the tokens that the question reads *and* that are wrong. A first chunk read from its lead entry
    is exact: its tokens rank last whatever their score."""

    name: ClassVar[str] = "query"
    rows: int | None = 8  # rows=8 and starts=1: measured on the dev split (benchmarks/blend)
    heads: str = "mean"
    skip_layers: int = 0
    depth: int | None = None
    smooth: int = 0
    chunk_starts: int = 0
    normalize: bool = True
    full_layers: int = 0
    value_norm: bool = False
    starts: float = 1.0

    @classmethod
    def attention_only(cls, **settings) -> QuerySelector:
        """The question's attention alone, over every suffix row, no offset prior: the setting that
        ``hybrid`` and the benchmarks' exact-attention probe were measured with."""
        return cls(rows=None, starts=0.0, **settings)

    def __post_init__(self):
        if self.heads not in ("mean", "max"):
            raise ValueError(f"heads must be 'mean' or 'max', got {self.heads!r}")
        for name in ("skip_layers", "smooth", "chunk_starts", "full_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.rows is not None and self.rows < 1:
            raise ValueError(f"rows must be >= 1 or None, got {self.rows}")
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"depth must be >= 1 or None, got {self.depth}")
        if isinstance(self.starts, bool) or not isinstance(self.starts, (int, float)) or not 0 <= self.starts < math.inf:
            raise ValueError(f"starts must be a number >= 0, got {self.starts!r}")

    def check(self, num_layers: int) -> None:
        depth = num_layers if self.depth is None else self.depth
        if self.full_layers >= num_layers:
            raise ValueError(f"full_layers {self.full_layers} leaves no layer of {num_layers} to select in")
        if not self.skip_layers < depth <= num_layers:
            raise ValueError(f"the probe scores layers [{self.skip_layers}, {depth}) of {num_layers}: "
                             "need skip_layers < depth <= the model's layers")

    def schedule(self, req: SelectionRequest) -> Schedule:
        if req.ratio == 0.0 or req.chunk_len == 0:
            return Schedule(torch.arange(0), {})
        n = req.keep(req.ratio)
        if n == req.chunk_len:  # everything is recomputed: no probe needed
            return Schedule(torch.arange(req.chunk_len), {})
        scores = self.scores(req)
        if self.full_layers:  # every row through the first layers, then the top ones by the same score
            return Schedule(torch.arange(req.chunk_len), {self.full_layers - 1: n}, lambda *kv: scores)
        return Schedule(torch.topk(scores, n).indices.sort().values.cpu(), {})

    def scores(self, req: SelectionRequest) -> torch.Tensor:
        """[C] attention of the suffix to each chunk token, aggregated over rows, heads and layers."""
        if req.probe is None:
            raise RuntimeError("the query selector needs the engine's probe")
        total: list[torch.Tensor] = []
        P, C = req.prefix_len, req.chunk_len

        def observe(layer: int, probs: torch.Tensor, values: torch.Tensor) -> None:
            # probs [Hq, S, T] (heads of a KV group adjacent), values [Hkv, T, D]
            if layer < self.skip_layers:
                return
            hq, s, _ = probs.shape
            rows = s if self.rows is None else min(self.rows, s)
            per_head = probs[:, s - rows :, P : P + C].mean(1)  # [Hq, C]
            groups = per_head.view(req.kv_heads, hq // req.kv_heads, C)
            if self.value_norm:
                groups = groups * values[:, P : P + C].float().norm(dim=-1)[:, None, :]
                per_head = groups.view(hq, C)
            att = groups.amax(1).mean(0) if self.heads == "max" else per_head.mean(0)
            if self.normalize:
                att = att / att.sum().clamp_min(1e-12)
            total.append(att)

        req.probe(observe, self.depth)
        score = torch.stack(total).sum(0)
        if self.chunk_starts:
            for first, n in req.chunk_bounds:
                score[first : first + min(n, self.chunk_starts)] = 0.0
        if self.smooth:
            w = 2 * self.smooth + 1
            score = torch.nn.functional.max_pool1d(score[None, None], w, stride=1, padding=self.smooth)[0, 0]
        if self.starts:
            score = score * (1.0 + req.chunk_offsets().to(score.device, torch.float32)) ** -self.starts
        exact = req.exact_rows()
        if exact:  # (scores are >= 0: -1 ranks every exact row below every other)
            score[:exact] = -1.0
        return score


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Rank of each value, 0 = smallest (ties by position)."""
    out = torch.empty_like(x, dtype=torch.float32)
    out[torch.argsort(x)] = torch.arange(x.numel(), dtype=torch.float32, device=x.device)
    return out


FUSES = ("rank", "product", "deviation")


@dataclass(frozen=True)
class HybridSelector(Selector):
    """Both signals: the query probe preselects ``widen`` x the budget of chunk tokens (recomputed
    from layer 0), then at ``check_layer`` the budget is kept by the question's attention times the
    norm of the V deviation measured there (``fuse="product"``: to first order, what a stale value
    changes in the question's output is its attention weight times its error), by the sum of the two
    ranks (``fuse="rank"``), or by the deviation alone (``fuse="deviation"``)."""

    name: ClassVar[str] = "hybrid"
    widen: float = 3.0  # widen, check_layer, fuse: measured on the dev split (benchmarks/blend)
    check_layer: int = 2
    fuse: str = "product"
    # (measured without the offset prior; an exact lead chunk still ranks last in its preselection)
    query: QuerySelector = field(default_factory=QuerySelector.attention_only)
    deviation: DeviationSelector = field(default_factory=DeviationSelector)

    def __post_init__(self):
        if self.widen < 1.0:
            raise ValueError(f"widen must be >= 1, got {self.widen}")
        if self.fuse not in FUSES:
            raise ValueError(f"fuse must be one of {FUSES}, got {self.fuse!r}")

    def check(self, num_layers: int) -> None:
        self.query.check(num_layers)
        if not 0 <= self.check_layer < num_layers:
            raise ValueError(f"check_layer {self.check_layer} outside the model's {num_layers} layers")

    def schedule(self, req: SelectionRequest) -> Schedule:
        if req.ratio == 0.0 or req.chunk_len == 0:
            return Schedule(torch.arange(0), {})
        n = req.keep(req.ratio)
        wide = min(req.chunk_len, math.ceil(self.widen * n))
        if n == req.chunk_len:
            return Schedule(torch.arange(req.chunk_len), {})
        q = self.query.scores(req)
        start = torch.topk(q, wide).indices.sort().values
        prior = q[start]  # the active chunk rows at the check layer are exactly `start`, in order

        def score(fresh_k, cached_k, fresh_v, cached_v):
            dev = self.deviation.score(fresh_k, cached_k, fresh_v, cached_v)
            if self.fuse == "deviation":
                return dev
            if self.fuse == "product":
                return dev.float().sqrt() * prior.to(dev.device).float()  # dev is a squared norm
            return _ranks(dev) + _ranks(prior.to(dev.device))

        return Schedule(start.cpu(), {self.check_layer: n} if wide > n else {}, score)


@dataclass(frozen=True)
class StartsSelector(Selector):
    """Recompute the first tokens of every chunk, as many in each, in every layer: no probe, no
    whole-prompt layer, nothing to score, so the cheapest selection there is, for low ratios. A
    chunk's stored K/V were computed behind other text than its predecessors in the prompt (the
    template prefix, a gap, a neighbour chunk), and the difference is largest in its first tokens,
    which saw only that text; later tokens mostly attend within the chunk. A first chunk read from
    its lead entry is already exact: its rows come last. Measured against the true K/V error
    oracle in benchmarks/blend (RESULTS.md)."""

    name: ClassVar[str] = "starts"

    def schedule(self, req: SelectionRequest) -> Schedule:
        if req.ratio == 0.0 or req.chunk_len == 0:
            return Schedule(torch.arange(0), {})
        n, k = req.keep(req.ratio), len(req.chunk_bounds)
        # rank = (exact lead chunk last, offset in its chunk, chunk): the budget spreads evenly over the chunks
        chunk = torch.repeat_interleave(torch.arange(k), torch.tensor([size for _, size in req.chunk_bounds]))
        last = (torch.arange(req.chunk_len) < req.exact_rows()).long()
        rank = (last * req.chunk_len + req.chunk_offsets()) * k + chunk
        return Schedule(torch.argsort(rank)[:n].sort().values, {})


SELECTORS: dict[str, type[Selector]] = {
    DeviationSelector.name: DeviationSelector,
    QuerySelector.name: QuerySelector,
    HybridSelector.name: HybridSelector,
    StartsSelector.name: StartsSelector,
}


def make_selector(selector: Selector | str) -> Selector:
    """A Selector instance from an instance or a registered name (default settings)."""
    if isinstance(selector, Selector):
        return selector
    if isinstance(selector, str) and selector in SELECTORS:
        return SELECTORS[selector]()
    raise ValueError(f"unknown selector {selector!r}; valid: {', '.join(SELECTORS)}")
