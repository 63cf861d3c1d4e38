"""Content addresses for chunk K/V entries.

A key is a blake2b-256 digest (hex) over a canonical JSON encoding of
  - the model fingerprint (architecture, weight digest, dtype, shapes, rope parameters, tokenizer digest),
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

KEY_PREFIX = "ragkv1-"  # bump when the key derivation itself changes


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes two models' K/V interchangeable. Two models with equal fingerprints produce
    bit-identical K/V for the same tokens; anything else must get other keys."""

    architecture: str
    weights: str  # digest of the weights (or name@revision when the caller vouches for it)
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: dict = field(default_factory=dict)
    tokenizer: str = ""  # digest of the tokenizer's vocabulary; "" when unknown

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
