"""How a chunk is prefilled on its own (the precompute policy), and the prefill itself.

A chunk computed alone at position 0 makes its first token an attention sink: every later token of
the chunk dumps attention mass on it, and those K/V are far from what the same tokens get inside a
real prompt. The policy therefore prefills each chunk *behind a sink*, a fixed run of tokens whose
K/V are discarded:

    sink="template" (default)  the prompt template's prefix (system prompt + user header): a chunk sees
                               what a first chunk sees in a real prompt
    sink="bos"                 only the BOS / first template token
    sink="none"                the chunk alone at position 0 (what naive implementations do)

With ``gap``, the chunk starts ``gap`` positions after the sink instead of right behind it. In a
real prompt most chunks sit hundreds or thousands of positions after the prefix; a chunk prefilled at
such a distance from its sink attends to it the way it will in the prompt (RoPE makes attention
depend on distance), so its K/V deviate less once fused. Measured on SmolLM2 (benchmarks/blend):
naive reuse fidelity 0.82 (no sink) -> 0.88 (template sink, gap 1024); blended at r = 0.15 0.90 -> 0.93.
The default gap is ``min(1024, max_position_embeddings // 4)``.

With ``context`` = k > 0 (default 1), a chunk is also prefilled behind its k most similar other
chunks of the corpus the writer sees (ragkv.neighbours; the most similar one nearest), placed in the
gap right before the chunk, and their K/V are discarded too: the stored K/V then already carry
attention to text of the kind RAG retrieves beside the chunk (FusionRAG's neighbour-conditioned
caches), which the read path's recompute otherwise has to restore. Zero cost at query time; the
precompute job computes the neighbours' rows too. Measured in benchmarks/blend (RESULTS.md).

With ``lead`` (default on), every chunk also gets a *lead entry*: the chunk prefilled right behind
the sink at position ``len(sink)``, with no gap and no context. Under the template sink that is
exactly the K/V the chunk has when it is the first chunk of a prompt (the prompt's prefix is the
template prefix), so the read path takes it for the prompt's first chunk and the first chunk needs no
correction at all; the other chunks read their gap/context entry. The first chunk is where a fused
cache errs most (its gap entry was prefilled ~1000 positions from a sink it sits right behind), and
the error of its K/V reaches every later token. Measured in benchmarks/blend (RESULTS.md). Cost: a
second entry per chunk (2x storage; +35% precompute time measured, benchmarks/precompute); no more
work at query time. A reader with ``lead`` over a store written without it falls back to the gap
entry (stats.lead = False).

The chunk is stored with ``start_pos = len(sink) + gap`` (a lead entry: ``len(sink)``); the read path
re-rotates its keys from there. The policy id (sink, gap, context, version, digest of the sink ids) is
part of every chunk key, and the lead id (sink, version, digest) part of every lead entry's key, so
entries made under another policy are never mixed in. ``lead`` does not change either id: a store
written with lead entries serves readers without them, and the other way round.
``benchmarks/blend`` measures the variants.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

POLICY_VERSION = 1
SINKS = ("template", "bos", "none")
MAX_CONTEXT = 4  # neighbour chunks a chunk may be prefilled behind
PREFIX_POLICY = f"prefix-v{POLICY_VERSION}"
DEFAULT_GAP = 1024


@dataclass(frozen=True)
class PrecomputePolicy:
    """``sink``: what each chunk is prefilled behind (its K/V are discarded). ``gap``: the chunk's first
    position is ``len(sink) + gap`` (a chunk far from the sink, as most chunks are in a real prompt).
    ``context``: how many neighbour chunks fill the end of the gap right before the chunk (at most
    ``gap`` tokens of them, the nearest kept); 0 = none (stores written by ragkv 0.1 had none:
    read such a store with ``context=0``). ``lead``: also store every chunk prefilled right behind
    the sink (no gap, no context), read for a prompt's first chunk."""

    sink: str = "template"
    gap: int | None = None  # None: min(1024, max_position_embeddings // 4), fixed by ``resolve``
    context: int = 1
    lead: bool = True

    def __post_init__(self):
        if self.sink not in SINKS:
            raise ValueError(f"unknown sink {self.sink!r}; valid: {', '.join(SINKS)}")
        if self.gap is not None and self.gap < 0:
            raise ValueError(f"gap must be >= 0, got {self.gap}")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or not 0 <= self.context <= MAX_CONTEXT:
            raise ValueError(f"context must be an integer from 0 to {MAX_CONTEXT} (neighbour chunks), got {self.context!r}")
        if not isinstance(self.lead, bool):
            raise ValueError(f"lead must be True or False, got {self.lead!r}")
        if self.context and self.gap == 0:
            raise ValueError(f"context={self.context} puts neighbour chunks in the gap before each chunk, and gap 0 "
                             "leaves no room: give a gap > 0, or context=0 (--context 0)")

    def resolve(self, max_positions: int | None) -> PrecomputePolicy:
        """This policy with its default gap fixed for a model of ``max_positions`` positions."""
        if self.gap is not None:
            return self
        return replace(self, gap=min(DEFAULT_GAP, (max_positions or 4096) // 4))

    def sink_ids(self, template) -> list[int]:
        if self.sink == "none":
            return []
        if self.sink == "bos":
            return list(template.prefix_ids[:1])
        return list(template.prefix_ids)

    def _digest(self, template) -> str:
        return hashlib.blake2b(b",".join(str(t).encode() for t in self.sink_ids(template)), digest_size=8).hexdigest()

    def policy_id(self, template) -> str:
        if self.gap is None:
            raise ValueError("resolve() the policy for a model before using it")
        gap = f"-gap{self.gap}" if self.gap else ""
        context = f"-ctx{self.context}" if self.context else ""
        return f"sink-{self.sink}{gap}{context}-v{POLICY_VERSION}-{self._digest(template)}"

    def lead_id(self, template) -> str:
        """The policy id of lead entries: the chunk right behind the sink (gap and context play no part)."""
        return f"sink-{self.sink}-lead-v{POLICY_VERSION}-{self._digest(template)}"

    def chunk_start(self, template) -> int:
        if self.gap is None:
            raise ValueError("resolve() the policy for a model before using it")
        return len(self.sink_ids(template)) + self.gap


@dataclass(frozen=True)
class StorageFormat:
    """How entries are encoded (not part of their key): ``dtype`` None = the model's dtype, or one of
    float32/float16/bfloat16/int8; ``quant_axis`` (int8 only) token | channel | auto (K per channel,
    V per token; the default for int8)."""

    dtype: str | None = None
    quant_axis: str | None = None

    def __post_init__(self):
        from ragkv.store.quant import QUANT_AXES, STORAGE_DTYPES

        if self.dtype is not None and self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype {self.dtype!r}: valid are {', '.join(STORAGE_DTYPES)}")
        if self.quant_axis is not None:
            if self.dtype != "int8":
                raise ValueError("quant_axis is only meaningful with storage dtype int8")
            if self.quant_axis not in QUANT_AXES:
                raise ValueError(f"quant_axis {self.quant_axis!r}: valid are {', '.join(QUANT_AXES)}")

    def resolve(self, model_dtype: str) -> tuple[str, str | None]:
        """(storage dtype, quant axis) of an entry of a model in ``model_dtype``."""
        dtype = self.dtype or model_dtype
        return dtype, ((self.quant_axis or "auto") if dtype == "int8" else None)
