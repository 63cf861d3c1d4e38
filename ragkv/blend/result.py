"""What a blended request returns: next-token logits, the cache generation continues, and stats."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlendStats:
    chunks: int = 0
    hits: int = 0  # chunks found in the store at lookup
    misses: int = 0  # chunks prefilled (and written back) at lookup
    lead: bool = False  # the first chunk came from (or was computed as) its lead entry
    # entries that failed while their layers were read, each then recomputed for this request:
    corrupt: int = 0  # damaged (or in an unsupported format): the store's verdict
    vanished: int = 0  # gone since the lookup (evicted or deleted by another process)
    store_errors: int = 0  # the store raised or was unreachable
    timeouts: int = 0  # a layer did not arrive within the loader's timeout
    prompt_tokens: int = 0
    reused_tokens: int = 0  # chunk tokens served from the store
    recomputed_tokens: int = 0  # chunk tokens recomputed in the last layer
    # chunk tokens read from the store and not recomputed in the last layer (an entry that failed
    # mid-request and was computed instead does not count): what `ragkv serve` reports as
    # usage.prompt_tokens_details.cached_tokens. 0 at ratio 1 (every chunk token recomputed).
    cached_tokens: int = 0
    t_lookup: float = 0.0
    t_load: float = 0.0  # time the compute thread waited for stored layers
    t_load_io: float = 0.0  # the loader's own read time
    t_fuse: float = 0.0
    t_select: float = 0.0  # choosing the tokens before the layer loop (a query-aware selector's probe)
    t_compute: float = 0.0
    t_total: float = 0.0
    ratio: float = 0.0  # the recompute ratio used (resolved when "auto")
    selector: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BlendResult:
    input_ids: torch.Tensor  # [1, T]
    logits: torch.Tensor  # [vocab] fp32, next-token logits after the whole prompt
    cache: object  # transformers DynamicCache holding the prompt minus its last token
    stats: BlendStats
    selected: torch.Tensor | None = None  # absolute positions of the chunk tokens recomputed in the last layer
