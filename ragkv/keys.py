"""Content addresses for chunk K/V entries.

A key is a blake2b-256 digest (hex) over a canonical JSON encoding of
  - the model fingerprint (architecture, weight digest, dtype, shapes, rope parameters; ragkv.fingerprint),
  - the precompute policy (name + version: how a chunk was prefilled, e.g. behind which sink tokens),
  - an optional namespace ("cache salt") that keeps tenants sharing one store apart,
  - the chunk's token ids.
It never uses Python's ``hash()`` (salted per process) and never depends on where the chunk later
sits in a prompt: re-positioning is the read path's job.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ragkv.policy import PREFIX_POLICY

KEY_PREFIX = "ragkv2-"  # bump when the key derivation itself changes
# ragkv1-: ragkv <= 0.3, whose fingerprint hashed every weight and the tokenizer's vocabulary; such
# entries are never read by this version (``ragkv stats`` counts them as stale)
STALE_PREFIXES = ("ragkv1-",)


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes two models' K/V interchangeable. Two models with equal fingerprints produce
    bit-identical K/V for the same tokens; anything else must get other keys. The tokenizer plays no
    part: K/V depend on token ids, and a chunk's ids are in its key."""

    architecture: str
    weights: str  # digest of the checkpoint's tensors as run in ``dtype`` (ragkv.fingerprint)
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: dict = field(default_factory=dict)

    def digest(self) -> str:
        return hashlib.blake2b(_canonical(asdict(self)), digest_size=16).hexdigest()


def chunk_key(
    fingerprint: ModelFingerprint | str,
    token_ids: Sequence[int],
    policy: str,
    namespace: str = "",
) -> str:
    """Stable content address of one chunk's K/V.

    ``fingerprint`` is a ModelFingerprint or its ``digest()``; ``policy`` names the precompute
    policy and its version (see ragkv.policy); ``namespace`` is the optional cache salt.
    """
    fp = fingerprint.digest() if isinstance(fingerprint, ModelFingerprint) else str(fingerprint)
    if not token_ids:
        raise ValueError("chunk_key: a chunk needs at least one token")
    ids = [int(t) for t in token_ids]
    if any(t < 0 for t in ids):
        raise ValueError("chunk_key: token ids must be non-negative")
    h = hashlib.blake2b(digest_size=32)
    h.update(_canonical({"fp": fp, "policy": policy, "ns": namespace, "n": len(ids)}))
    h.update(b"\x00")
    # token ids as fixed-width little-endian int32: canonical and fast for long chunks
    h.update(b"".join(t.to_bytes(4, "little") for t in ids))
    return KEY_PREFIX + h.hexdigest()


KINDS = ("chunk", "lead", "prefix")


@dataclass(frozen=True)
class Keyspace:
    """What one model's entries are called and how they were prefilled: the key and the layout of
    every kind of entry, shared by the write path (ragkv.prefill, the precompute job) and the read
    path (ragkv.blend). It needs no model: a fingerprint, a resolved precompute policy and the
    template's sink ids are enough (``for_template``), so a process that only looks keys up (vLLM's
    scheduler) never loads weights.

    kinds: 'chunk' (behind the sink, the policy's gap and context), 'lead' (right behind the sink,
    read for a prompt's first chunk), 'prefix' (the exact template prefix at position 0)."""

    fingerprint: ModelFingerprint
    policy_id: str
    lead_id: str
    sink_ids: tuple[int, ...]
    chunk_start: int  # stored start position of every chunk entry
    lead: bool  # lead entries are written and read (PrecomputePolicy.lead, and gap > 0)
    context: int  # neighbour chunks a chunk entry was prefilled behind (PrecomputePolicy.context)
    namespace: str = ""

    @classmethod
    def for_template(cls, fingerprint: ModelFingerprint, template, policy, namespace: str = "") -> Keyspace:
        """``policy``: a PrecomputePolicy resolved for the model (``resolve(max_positions)``)."""
        sink = tuple(policy.sink_ids(template))
        start = policy.chunk_start(template)
        return cls(fingerprint, policy.policy_id(template), policy.lead_id(template), sink, start,
                   # with gap 0 (and so no context) a chunk entry already sits right behind the sink
                   policy.lead and start != len(sink), policy.context, namespace)

    @property
    def digest(self) -> str:
        return self.fingerprint.digest()

    @property
    def lead_start(self) -> int:
        return len(self.sink_ids)

    def key(self, ids: Sequence[int], kind: str = "chunk") -> str:
        return chunk_key(self.digest, ids, self.layout(kind)[1], self.namespace)

    def chunk_key(self, ids: Sequence[int]) -> str:
        return self.key(ids, "chunk")

    def lead_key(self, ids: Sequence[int]) -> str:
        return self.key(ids, "lead")

    def prefix_key(self, ids: Sequence[int]) -> str:
        return self.key(ids, "prefix")

    def entry_keys(self, ids: Sequence[int]) -> list[tuple[str, str]]:
        """(key, kind) of every entry the write path stores for one chunk: its chunk entry first and,
        under ``lead``, its lead entry."""
        return [(self.key(ids, kind), kind) for kind in (("chunk", "lead") if self.lead else ("chunk",))]

    def layout(self, kind: str) -> tuple[int, str]:
        """(stored start position, policy id) of an entry of ``kind``."""
        if kind == "chunk":
            return self.chunk_start, self.policy_id
        if kind == "lead":
            return self.lead_start, self.lead_id
        if kind == "prefix":
            return 0, PREFIX_POLICY
        raise ValueError(f"entry kind {kind!r}: valid are {', '.join(KINDS)}")

    def meta(self, key: str, ids: Sequence[int], kind: str, storage: tuple[str, str | None] | None = None):
        """The EntryMeta of an entry of ``kind`` holding ``ids``, encoded as ``storage`` ((dtype, quant
        axis), ``StorageFormat.resolve``; None: the model's dtype)."""
        from ragkv.store.entry import EntryMeta

        fp = self.fingerprint
        start, policy = self.layout(kind)
        storage = storage or (fp.dtype, None)
        return EntryMeta(key=key, token_ids=tuple(ids), start_pos=start, num_layers=fp.num_layers,
                         num_kv_heads=fp.num_kv_heads, head_dim=fp.head_dim, model_dtype=fp.dtype,
                         storage_dtype=storage[0], quant_axis=storage[1], fingerprint=self.digest, policy=policy)

    def matches(self, meta, ids: Sequence[int]) -> bool:
        """Whether a stored entry's metadata is one of this keyspace's, for exactly ``ids``."""
        fp = self.fingerprint
        return (tuple(meta.token_ids) == tuple(ids) and meta.num_layers == fp.num_layers
                and meta.num_kv_heads == fp.num_kv_heads and meta.head_dim == fp.head_dim
                and meta.fingerprint == self.digest)
