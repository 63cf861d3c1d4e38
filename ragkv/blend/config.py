"""The read path's settings. How chunks are written (precompute policy, storage format) is the write
path's and lives in ``ragkv.policy``."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.blend.select import DeviationSelector, Selector, make_selector

DEFAULT_RATIO = 0.15
# one default for every layout and entry point (the engine, `ragkv eval`, the HF wrapper, `ragkv serve`,
# the vLLM connector): `query` gives full prefill's answer more often than `deviation` on each of the
# three multi-hop QA sets (benchmarks/qa/RESULTS.md), is more faithful in chats with a system prompt of
# their own and at parity in ragkv's own layout (benchmarks/blend/RESULTS.md)
DEFAULT_SELECTOR = "query"
CHAT_SELECTOR = DEFAULT_SELECTOR  # what the chat servers select with: the same
DEFAULT_RATIO_FLOOR = 0.15  # the quality floor of ratio="auto"


def check_ratio(ratio, what: str = "ratio") -> float | str:
    """A recompute ratio in [0, 1] or "auto"; anything else is a ValueError naming it."""
    if ratio == "auto":
        return ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{what} must be a number in [0, 1] or 'auto', got {ratio!r}")
    return float(ratio)


def parse_ratio(text: str, what: str = "ratio") -> float | str:
    """A ratio written as text (a CLI option, a request field): "auto" or a number in [0, 1]."""
    text = str(text).strip()
    if text == "auto":
        return text
    try:
        return check_ratio(float(text), what)
    except ValueError:
        raise ValueError(f"{what} must be a number in [0, 1] or 'auto', got {text!r}") from None


@dataclass(frozen=True)
class BlendConfig:
    """ratio: fraction of the reused (chunk) tokens recomputed, or "auto" (the loading controller
    recomputes what the store's load hides, never below ``ratio_floor``; ragkv.controller).
    selector: which tokens are recomputed, a ``Selector`` or a registered name (ragkv.blend.select).
    pipelined: read layer i+1 from the store while layer i computes (ragkv.loader); a layer that
    does not arrive within ``load_timeout_s`` is recomputed, and the request writes nothing back to
    that store."""

    ratio: float | str = DEFAULT_RATIO
    ratio_floor: float = DEFAULT_RATIO_FLOOR
    selector: Selector | str = DEFAULT_SELECTOR
    pipelined: bool = True
    load_timeout_s: float = 10.0

    def __post_init__(self):
        object.__setattr__(self, "ratio", check_ratio(self.ratio))
        floor = check_ratio(self.ratio_floor, "ratio_floor")
        if floor == "auto":
            raise ValueError("ratio_floor must be a number in [0, 1], got 'auto'")
        object.__setattr__(self, "selector", make_selector(self.selector))
        if not self.load_timeout_s > 0:
            raise ValueError(f"load_timeout_s must be > 0, got {self.load_timeout_s}")
        sel = self.selector
        if isinstance(sel, DeviationSelector) and sel.first_ratio is not None:
            low = 0.0 if self.ratio == "auto" else self.ratio
            if sel.first_ratio < low:
                raise ValueError(f"first_ratio must lie in [ratio, 1], got {sel.first_ratio} < {low}")
