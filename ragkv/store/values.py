"""Small value types and pure checks shared by the interface and the backends: why a read missed
(``Miss``), the key alphabet every backend enforces (``check_key``), byte budgets
(``size_from_str``, ``budget_from``, ``typed_budget``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

MIN_BUDGET = 1 << 20  # the smallest max_bytes a store URI or `ragkv evict` accepts
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
    """'10G' / '512M' / '1GiB' / '123' -> bytes; None/'' / 'none' / 'inf' -> None (unbounded).
    Negative sizes are refused."""
    if s is None:
        return None
    if isinstance(s, bool):
        raise ValueError(f"bad size {s!r}: use bytes or a number with K, M, G or T")
    if isinstance(s, int):
        n = s
    else:
        t = s.strip().lower().replace("ib", "").rstrip("b")
        if t in ("", "none", "inf"):
            return None
        mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
        try:
            n = int(float(t[:-1]) * mult[t[-1]]) if t[-1] in mult else int(t)
        except (ValueError, OverflowError):
            raise ValueError(f"bad size {s!r}: use bytes or a number with K, M, G or T") from None
    if n < 0:
        raise ValueError(f"bad size {s!r}: must not be negative")
    return n


def budget_from(value: str | int | None, name: str = "max_bytes") -> int | None:
    """A constructor's byte budget: a size (see ``size_from_str``) or None; never negative."""
    try:
        return size_from_str(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def typed_budget(text: str, name: str = "max_bytes") -> int | None:
    """A budget a person typed (a store URI, ``ragkv evict``): none/inf for unbounded, else at
    least MIN_BUDGET. Below that it is a typo (``max_bytes=10`` meant 10G): evicting a shared store
    down to a few bytes is never what was asked for."""
    n = budget_from(text, name)
    if n is not None and n < MIN_BUDGET:
        t = str(text).strip()
        if n == 0:
            hint = "for no limit use none; to empty a store use `ragkv clear`"
        elif t.isdigit():
            hint = f"did you mean {t}G?"
        else:
            hint = "sizes take K, M, G or T"
        raise ValueError(f"{name}={t} is smaller than one entry (the smallest budget is 1M): {hint}")
    return n
