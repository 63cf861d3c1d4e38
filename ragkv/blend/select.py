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
    # observe(layer, probs [Hq, S, T]) with its attention in each; the request keeps what it loaded
    probe: Callable | None = field(default=None, compare=False, repr=False)

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
    signal: which deviation selects tokens: "v" (the paper's choice), "k" or "kv"."""

    name: ClassVar[str] = "deviation"
    check_layers: tuple[int, ...] | None = None  # None: (1, 3, 6), cut to the model's depth
    first_ratio: float | None = None
    signal: str = "v"

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
                                fresh_v if use_v else None, cached_v if use_v else None, mode=self.signal)


@dataclass(frozen=True)
class QuerySelector(Selector):
    """Recompute the chunk tokens the question reads and whose stored K/V are stale. A probe runs the
    suffix (question + assistant header) through every layer over the fused, re-rotated stored K/V;
    each chunk token is scored by the attention its last ``rows`` queries give it (mean over heads,
    each layer's attention over the chunks normalised to 1, summed over layers), times
    ``(1 + its offset in its chunk) ** -offset_decay``: a chunk's stored K/V were computed behind
    other text than its predecessors in this prompt, and its first tokens, which saw only that text,
    differ most (``StartsSelector``). The top ``ratio`` of chunk tokens (with the suffix) are then
    recomputed in every layer, with no fully computed layer. A first chunk read from its lead entry
    is exact: its tokens rank last whatever their score.

    rows: the last suffix queries read (None: all of them). offset_decay: 0 = the attention alone.
    rows=8 and offset_decay=1: measured on the dev split (benchmarks/blend/RESULTS.md)."""

    name: ClassVar[str] = "query"
    rows: int | None = 8
    offset_decay: float = 1.0

    def __post_init__(self):
        if self.rows is not None and (isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1):
            raise ValueError(f"rows must be an integer >= 1 or None, got {self.rows!r}")
        d = self.offset_decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < math.inf:
            raise ValueError(f"offset_decay must be a number >= 0, got {d!r}")

    def schedule(self, req: SelectionRequest) -> Schedule:
        if req.ratio == 0.0 or req.chunk_len == 0:
            return Schedule(torch.arange(0), {})
        n = req.keep(req.ratio)
        if n == req.chunk_len:  # everything is recomputed: no probe needed
            return Schedule(torch.arange(req.chunk_len), {})
        return Schedule(torch.topk(self.scores(req), n).indices.sort().values.cpu(), {})

    def scores(self, req: SelectionRequest) -> torch.Tensor:
        """[C] the question's attention to each chunk token, weighted by its offset in its chunk."""
        if req.probe is None:
            raise RuntimeError("the query selector needs the engine's probe")
        total: list[torch.Tensor] = []
        P, C = req.prefix_len, req.chunk_len

        def observe(layer: int, probs: torch.Tensor) -> None:  # probs [Hq, S, T]
            rows = probs.shape[1] if self.rows is None else min(self.rows, probs.shape[1])
            att = probs[:, -rows:, P : P + C].mean(1).mean(0)  # [C]
            total.append(att / att.sum().clamp_min(1e-12))

        req.probe(observe)
        score = torch.stack(total).sum(0)
        if self.offset_decay:
            score = score * (1.0 + req.chunk_offsets().to(score.device, torch.float32)) ** -self.offset_decay
        exact = req.exact_rows()
        if exact:  # (scores are >= 0: -1 ranks every exact row below every other)
            score[:exact] = -1.0
        return score


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


# the strategies a user chooses from, each justified by a measurement (benchmarks/blend/RESULTS.md,
# benchmarks/qa/RESULTS.md): query (the default, ragkv.blend.config.DEFAULT_SELECTOR: full prefill's
# answers most often on multi-hop QA, and the most faithful in chats), deviation (CacheBlend's; at
# parity in fidelity in ragkv's own layout in fp32), starts (nothing to choose at run time: the
# fastest, for low ratios)
SELECTORS: dict[str, type[Selector]] = {
    DeviationSelector.name: DeviationSelector,
    QuerySelector.name: QuerySelector,
    StartsSelector.name: StartsSelector,
}


def parse_selector(spec: str) -> Selector:
    """A selector from text: a registered name, optionally with settings as ``name:field=value:...``
    (``query:rows=32:offset_decay=0``); values are read as int, float, ``none`` or ``all`` (None), or
    text. Unknown names and fields, and values the selector refuses, are ValueErrors naming them."""
    import dataclasses

    name, *settings = spec.strip().split(":")
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; valid: {', '.join(SELECTORS)}")
    cls = SELECTORS[name]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    kwargs = {}
    for item in settings:
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"selector {name!r}: {item!r} is not a setting (valid: {', '.join(sorted(fields)) or 'none'})")
        kwargs[key] = _setting(value)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"selector {name!r}: {e}") from None


def _setting(text: str):
    if text.lower() in ("none", "all"):
        return None
    if "," in text:
        return tuple(_setting(t) for t in text.split(",") if t)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def selector_label(selector: Selector) -> str:
    """The selector's name with the settings that differ from its defaults, as ``parse_selector``
    reads them back (``query:rows=32``)."""
    import dataclasses

    if not dataclasses.is_dataclass(selector):
        return selector.name
    parts = [selector.name]
    for f in dataclasses.fields(selector):
        value = getattr(selector, f.name)
        if f.default is not dataclasses.MISSING and value != f.default:
            text = ",".join(map(str, value)) + ("," if len(value) == 1 else "") if isinstance(value, tuple) else value
            parts.append(f"{f.name}={'none' if value is None else text}")
    return ":".join(parts)


def make_selector(selector: Selector | str) -> Selector:
    """A Selector instance from an instance or a registered name (default settings)."""
    if isinstance(selector, Selector):
        return selector
    if isinstance(selector, str) and selector in SELECTORS:
        return SELECTORS[selector]()
    raise ValueError(f"unknown selector {selector!r}; valid: {', '.join(SELECTORS)}")
