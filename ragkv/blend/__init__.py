"""The read path (CacheBlend): ``BlendEngine`` + ``BlendConfig``; selection strategies in
``ragkv.blend.select`` (``SELECTORS``). Rooms: engine (lookup, request steps), request (the layer
loop), select (which tokens are recomputed), attention (causal by original position), cache (the
fused K/V and the handoff), result (what a request returns)."""

from ragkv.blend.config import BlendConfig, check_ratio, parse_ratio
from ragkv.blend.engine import BlendEngine
from ragkv.blend.result import BlendResult, BlendStats
from ragkv.blend.select import (
           SELECTORS,
           DeviationSelector,
           QuerySelector,
           Selector,
           StartsSelector,
)

__all__ = ["SELECTORS", "BlendConfig", "BlendEngine", "BlendResult", "BlendStats", "DeviationSelector",
           "QuerySelector", "Selector", "StartsSelector", "check_ratio", "parse_ratio"]
