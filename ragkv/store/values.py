"""Small value types and pure checks shared by the interface and the backends: why a read missed
(``Miss``), the key alphabet every backend enforces (``check_key``), byte budgets
(``size_from_str``, ``budget_from``, ``typed_budget``), URIs safe to show (``redact_uri``, exported
by ``uri.py``; it lives here so that backends can use it without importing upwards)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

MIN_BUDGET = 1 << 20  # the smallest max_bytes a store URI or `ragkv evict` accepts
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
MISS_REASONS = ("absent", "corrupt", "unsupported", "error", "timeout")


@dataclass(frozen=True)
class Miss:
    """Why ``fetch_layers`` has no layer for a key. ``reason``: "absent" (not stored), "corrupt"
    (failed validation: counted and removed), "unsupported" (another format version: counted, left
    in place), "error" (I/O or connection trouble: counted; the entry may well exist), "timeout" (a
    reader gave up waiting for the store: ragkv.loader)."""

    reason: str

    def __post_init__(self):
        if self.reason not in MISS_REASONS:
            raise ValueError(f"Miss reason {self.reason!r}: valid are {MISS_REASONS}")


ABSENT, CORRUPT, UNSUPPORTED, ERROR, TIMEOUT = (Miss(r) for r in MISS_REASONS)


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


# ---- showing URIs (secrets never leave the store layer) ---------------------------------------

# a comma that starts the next URI of a tier list: followed by a scheme and '://', ',' or the end
_URI_SPLIT = re.compile(r",(?=\s*[A-Za-z][A-Za-z0-9+.\-]*\s*(?:://|,|$))")
_SECRET_PARAM = re.compile(r"pass|pwd|token|secret|auth|credential|api_?key", re.IGNORECASE)
_HOST_THEN_PATH = re.compile(r"[A-Za-z0-9._\-\[\]:%]*(?:[/?#]|$)")


def split_uris(uris: str) -> list[str]:
    """A comma-separated tier list -> its URIs (blank items dropped)."""
    return [u.strip() for u in _URI_SPLIT.split(uris) if u.strip()]


def redact_uri(uri: str) -> str:
    """``uri`` (or a tier list) with every secret shown as ``***``: the password of the userinfo
    (``user:***@host``; a userinfo without ':' is all secret: ``***@host``; the userinfo ends at
    the LAST '@' before the host, so '@' and ':' inside a password are covered) and the values of
    password-like query parameters (password, pass, pwd, token, secret, auth, ...)."""
    return ",".join(_redact_one(u) for u in _URI_SPLIT.split(uri))


def _redact_one(uri: str) -> str:
    if "://" not in uri:
        return uri
    scheme, rest = uri.split("://", 1)
    if scheme.strip().lower() not in ("disk", "memory"):  # only network URIs carry a userinfo
        at = _userinfo_end(rest)
        if at >= 0:
            user = rest[:at].split(":", 1)[0] + ":" if ":" in rest[:at] else ""
            rest = f"{user}***@{rest[at + 1 :]}"
    head, sep, query = rest.partition("?")
    if sep:
        params = []
        for p in query.split("&"):
            name, eq, _ = p.partition("=")
            params.append(f"{name}=***" if eq and _SECRET_PARAM.search(unquote(name)) else p)
        rest = head + "?" + "&".join(params)
    return f"{scheme}://{rest}"


def _userinfo_end(rest: str) -> int:
    """Index of the '@' that ends the userinfo of ``rest`` (the URI after '://'), or -1: the last
    '@' followed by a plausible host[:port] whose userinfo is not a query (an '@' inside a query
    value, e.g. ``?password=p@ss``, is not one)."""
    at = len(rest)
    while (at := rest.rfind("@", 0, at)) >= 0:
        before = rest[:at]
        query_like = "?" in before and "=" in before[before.index("?") :]
        if _HOST_THEN_PATH.match(rest, at + 1) and not query_like and not before.startswith("/"):
            return at
    return -1
