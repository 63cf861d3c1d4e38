"""Small value types and pure checks shared by the interface and the backends: why a read missed
(``Miss``), the key alphabet every backend enforces (``check_key``), byte budgets
(``size_from_str``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
MISS_REASONS = ("absent", "corrupt", "unsupported", "error")


@dataclass(frozen=True)
class Miss:
    """Why ``fetch_layers`` has no layer for a key. ``reason``: "absent" (not stored), "corrupt"
    (failed validation: counted and removed), "unsupported" (another format version: counted, left
    in place), "error" (I/O or connection trouble: counted; the entry may well exist)."""

    reason: str

    def __post_init__(self):
        if self.reason not in MISS_REASONS:
            raise ValueError(f"Miss reason {self.reason!r}: valid are {MISS_REASONS}")


ABSENT, CORRUPT, UNSUPPORTED, ERROR = (Miss(r) for r in MISS_REASONS)


def is_key(key) -> bool:
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


def check_key(key: str) -> str:
    """The key alphabet every backend enforces: [A-Za-z0-9._-], starting with a letter or digit, at
    most 200 chars (no path separators, traversal, NUL, glob or hash-tag characters)."""
    if not is_key(key):
        raise ValueError(f"invalid store key {key!r}: [A-Za-z0-9._-], starting alphanumeric, at most 200 chars")
    return key


def size_from_str(s: str | int | None) -> int | None:
    """'10G' / '512M' / '1GiB' / '123' -> bytes; None/'' / 'none' -> None (unbounded)."""
    if s is None or isinstance(s, int):
        return s
    t = s.strip().lower().replace("ib", "").rstrip("b")
    if t in ("", "none", "inf", "0"):
        return None if t != "0" else 0
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    try:
        if t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"bad size {s!r}: use bytes or a number with K, M, G or T") from None
