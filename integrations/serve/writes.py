"""Where the K/V a request computes goes, and how much of it (``--write-policy``, ``--write-store``).

The server reads the operator's store (``--store``: what ``ragkv precompute`` wrote) and never writes
into it. A chunk that store lacks is prefilled for the request and, as the write policy allows, kept
in a store of its own (``--write-store``, by default ``memory://?max_bytes=256M``) that reads fall
back to, so the next request with that document hits. Entries written for clients therefore live
within their own budget: they evict each other, never the precompute job's corpus.

    quota   keep at most --write-quota bytes per --write-window seconds (a sliding window); beyond
            that an entry serves its own request only (the default)
    all     keep every computed entry (the write store's own budget still bounds it)
    none    keep nothing

A write store must be bounded (memory/disk ``max_bytes``; redis ``ttl=``) and must not be a store of
``--store`` (its entries would share the corpus's budget). The store the engine reads is a
``ServeStore`` (ragkv.integrations.serve.store). Light to import (the CLI's options use it).
"""

from __future__ import annotations

import threading
import time
from collections import deque

POLICIES = ("quota", "all", "none")
DEFAULT_WRITE_STORE = "memory://?max_bytes=256M"


class WritePolicy:
    """How many bytes of request-computed entries may be kept; thread-safe. ``reserve(n)`` before a
    write returns its ticket (None: refused), ``settle(ticket, written)`` after it: a write that did
    not happen gives its reservation back."""

    def __init__(self, policy: str = "quota", quota: int = 256 << 20, window_s: float = 3600.0, clock=time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"write policy {policy!r}; valid: {', '.join(POLICIES)}")
        if policy == "quota" and (quota is None or quota < 0 or not window_s > 0):
            raise ValueError(f"a write quota needs a size >= 0 and a window > 0 s, got {quota!r} per {window_s!r} s")
        self.policy, self.quota, self.window_s, self._clock = policy, quota, window_s, clock
        self._lock = threading.Lock()
        self._recent: deque[_Ticket] = deque()  # the reservations in the window, oldest first
        self._used = 0
        self.written = self.written_bytes = self.refused = 0

    def describe(self) -> str:
        if self.policy == "quota":
            return f"quota: at most {self.quota} bytes per {self.window_s:g} s"
        return self.policy

    def reserve(self, nbytes: int) -> _Ticket | None:
        with self._lock:
            ticket = _Ticket(self._clock(), nbytes)
            if self.policy == "quota":
                while self._recent and ticket.when - self._recent[0].when >= self.window_s:
                    self._used -= self._recent.popleft().nbytes
                if self._used + nbytes > self.quota:
                    self.refused += 1
                    return None
                self._recent.append(ticket)
                self._used += nbytes
            elif self.policy == "none":
                self.refused += 1
                return None
            return ticket

    def settle(self, ticket: _Ticket, written: bool) -> None:
        with self._lock:
            if written:
                self.written += 1
                self.written_bytes += ticket.nbytes
                return
            for i, t in enumerate(self._recent):  # still in the window: given back
                if t is ticket:
                    del self._recent[i]
                    self._used -= ticket.nbytes
                    break


class _Ticket:
    __slots__ = ("nbytes", "when")

    def __init__(self, when: float, nbytes: int):
        self.when, self.nbytes = when, nbytes


def _place(store):
    """What makes two stores the same place: a disk root, a redis server + db + namespace."""
    root = getattr(store, "root", None)
    if root is not None:
        return ("disk", str(root))
    namespace = getattr(store, "namespace", None)
    if namespace is not None:
        return ("redis", store.uri.split("?", 1)[0], namespace)
    return None  # memory: a store of its own


def check_write_store(corpus, writes) -> None:
    """ValueError when ``writes`` is unbounded or shares a place with a store of ``corpus``."""
    places = {_place(t) for t in corpus.tiers} - {None}
    for t in writes.tiers:
        if _place(t) in places:
            raise ValueError(f"{t.uri} is also in --store: entries written for clients would share the corpus's "
                             "budget and evict it; give the write store a place of its own")
        if getattr(t, "namespace", None) is not None:
            if getattr(t, "ttl", None) is None:
                raise ValueError(f"{t.uri} has no ttl=: entries written for clients would never expire; give it "
                                 "one (and run Redis with maxmemory-policy volatile-lru so only they are evicted)")
        elif getattr(t, "max_bytes", None) is None:
            raise ValueError(f"{t.uri} is unbounded: give it max_bytes= so clients cannot fill it")
