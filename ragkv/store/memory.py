"""In-process LRU store within a byte budget (thread-safe).

Holds encoded entries (header bytes + one immutable blob per layer). Bytes never leave the
process, so reads skip checksum/finiteness checks (entries are verified when ``put_encoded`` brings
them in from elsewhere); every read copies the blob, so callers own the tensors they get."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from ragkv.store.base import KVStore, Loaded, wants_all
from ragkv.store.entry import EncodedEntry, Layout, check_layer_index
from ragkv.store.values import budget_from


class MemoryStore(KVStore):
    verify_reads = False

    def __init__(self, max_bytes: int | str | None = 1 << 30):
        super().__init__()
        self.max_bytes = budget_from(max_bytes)
        self._d: OrderedDict[str, tuple[bytes, Layout, list]] = OrderedDict()
        self._bytes = 0

    @property
    def uri(self) -> str:
        return "memory://" + (f"?max_bytes={self.max_bytes}" if self.max_bytes is not None else "")

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._d

    def _load(self, key: str, layers: Sequence[int] | None) -> Loaded | None:
        with self._lock:
            e = self._d.get(key)
            if e is None:
                return None
            self._d.move_to_end(key)
        header, layout, blobs = e
        if layers is None:
            return header, layout, []
        sel = blobs if wants_all(layers) else [blobs[check_layer_index(i, layout)] for i in layers]
        return header, layout, [bytearray(b) for b in sel]  # blobs are never mutated: copy unlocked

    def _store(self, key: str, enc: EncodedEntry, layout: Layout, owned: bool) -> bool:
        nbytes = layout.total_nbytes
        if self.max_bytes is not None and nbytes > self.max_bytes:
            self._count("rejected_too_large")
            return False
        blobs = list(enc.blobs) if owned else [bytes(b) for b in enc.blobs]
        with self._lock:
            if key in self._d:
                return False
            self._d[key] = (bytes(enc.header), layout, blobs)
            self._bytes += nbytes
            self._evict(keep=key)
            return key in self._d

    def _evict(self, keep: str) -> None:
        """Drop least recently used unpinned entries until within budget (lock held). ``keep``
        (the entry just written) goes last: it is dropped only if nothing else can make room."""
        if self.max_bytes is None:
            return
        for k in list(self._d):
            if self._bytes <= self.max_bytes:
                return
            if k != keep and self._pinned[k] <= 0:
                self._drop(k)
        if self._bytes > self.max_bytes and self._pinned[keep] <= 0:
            self._drop(keep)

    def _drop(self, key: str) -> None:
        _, layout, _ = self._d.pop(key)
        self._bytes -= layout.total_nbytes
        self._counts["evictions"] += 1

    def _remove(self, key: str) -> bool:
        with self._lock:
            e = self._d.pop(key, None)
            if e is not None:
                self._bytes -= e[1].total_nbytes
            return e is not None

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._d))

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0

    def _usage(self) -> dict:
        with self._lock:
            return {"entries": len(self._d), "bytes": self._bytes, "max_bytes": self.max_bytes}
