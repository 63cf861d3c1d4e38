"""``KVStore``: the interface every backend (memory, disk, redis, tiered) implements.

Who calls what (the table in ragkv/store/README.md): the read path ``contains``, ``get_meta``,
``fetch_layers(keys, i)`` (layer i of each key, or a ``Miss`` with its reason), ``get_layer``,
``pin``; the write path ``put_encoded``, ``missing_tiers``, ``fill``, ``tiers``; operators and tools
``check``, ``keys``, ``stats``, ``get``, ``get_encoded``, ``put``, ``delete``, ``clear``, ``close``.
Returned tensors are the caller's (in-place writes never reach the store); ``uri`` and every
message show URIs with secrets redacted.

Reads never raise for bad data or an unreachable backend: a corrupt entry (``CorruptEntry``) is
counted, removed and returned as a miss; an entry of another format version (``UnsupportedEntry``,
e.g. from a newer writer) is counted as ``unsupported``, logged once per key, left in place and
returned as a miss; an I/O or connection error is counted as an error and returned as a miss. A
caller's mistakes do raise: ``ValueError`` for a key outside ``check_key``'s alphabet, ``IndexError``
for a layer index that is not a layer of the entry (nothing is removed). Writes of a single backend
raise ``StoreError``/``StoreFull``.

Backend hooks (abstract): ``uri``, ``_load``, ``_store``, ``_remove``, ``keys``. Optional with
defaults: ``contains``, ``clear``, ``_usage``, ``check``, ``close``.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from torch import Tensor

from ragkv.store.entry import (
    ChunkKV,
    EncodedEntry,
    EntryMeta,
    Layout,
    StoredLayer,
    check_layer_index,
    decode_header,
    decode_layer,
    encode,
)
from ragkv.store.errors import CorruptEntry, StoreError, UnsupportedEntry
from ragkv.store.values import (
    ABSENT,
    CORRUPT,
    ERROR,
    UNSUPPORTED,
    Miss,
    check_key,
)

log = logging.getLogger("ragkv.store")

Loaded = tuple[bytes, Layout, list]  # header bytes, parsed layout, requested blobs (in order)


class KVStore(ABC):
    verify_reads: bool = True  # checksum + finiteness on every read (MemoryStore turns it off)

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._counts: Counter[str] = Counter()
        self._pinned: Counter[str] = Counter()
        self._unsupported_seen: set[str] = set()  # keys already logged as unsupported

    # ---- backend hooks ------------------------------------------------------------------------

    @property
    @abstractmethod
    def uri(self) -> str: ...

    @abstractmethod
    def _load(self, key: str, layers: Sequence[int] | None) -> Loaded | None:
        """Fetch the header and the blobs of ``layers`` (None: header only -> empty list; all
        indices: every blob; else ints, already type-checked). Returns None when absent. Must
        validate the header with ``decode_header(header, key)`` and each index with
        ``check_layer_index(i, layout)`` before touching blobs (IndexError: a caller's bad index,
        nothing is removed); raises CorruptEntry on bad bytes, StoreError/OSError on I/O trouble."""

    @abstractmethod
    def _store(self, key: str, enc: EncodedEntry, layout: Layout, owned: bool) -> bool:
        """Write a validated entry so that readers see all of it or nothing. ``owned``: the blobs
        are fresh buffers nobody else holds (no defensive copy needed). False if already present."""

    @abstractmethod
    def _remove(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    def contains(self, key: str) -> bool:
        """A readable entry, or one of a newer format (this build never overwrites it), is there."""
        try:
            return self._load(key, None) is not None
        except UnsupportedEntry:
            return True
        except (CorruptEntry, StoreError, OSError):
            return False

    def clear(self) -> None:
        for k in list(self.keys()):
            self._remove(k)

    @property
    def tiers(self) -> list[KVStore]:
        """The stores this one is made of, fastest first: ``[self]``; a TieredStore's tiers."""
        return [self]

    def _checked(self, key: str, check) -> bool:
        """``contains`` of a backend that checks an entry cheaply: ``check()`` raises CorruptEntry for
        a damaged one (counted and removed, so a put rewrites it: absent) or UnsupportedEntry for one
        of a newer format (present: never overwritten); else the entry is there."""
        try:
            check()
        except UnsupportedEntry:
            return True
        except CorruptEntry as e:
            self._corrupt(key, e, miss=False)
            return False
        return True

    def missing_tiers(self, key: str) -> list[KVStore]:
        """The stores that lack a valid entry for ``key``: here ``[]`` or ``[self]``; a
        TieredStore lists its tiers that lack it (e.g. Redis restarted empty under a disk tier)."""
        return [] if self.contains(key) else [self]

    def fill(self, key: str) -> bool:
        """Copy ``key`` into the tiers that lack it from one holding a verified copy; True when
        every tier now holds it. A single store has nothing to copy from: True iff it holds it."""
        return self.contains(key)

    def _usage(self) -> dict:
        return {"entries": None, "bytes": None}

    def check(self) -> None:  # noqa: B027 - optional hook: a memory store is always usable
        """``StoreUnavailable`` (clear, redacted) when the backend cannot be used at all (Redis PING,
        disk root writable, every tier). Reads and writes never need it; operators' tools do."""

    def close(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Release connections / flush the index. Safe to call twice."""

    # ---- public API ---------------------------------------------------------------------------

    def put(self, meta: EntryMeta, layers_kv: Sequence[tuple[Tensor, Tensor]]) -> bool:
        """Quantize per meta.storage_dtype and store. False (and no work) if already present."""
        check_key(meta.key)
        if self.contains(meta.key):
            self._count("put_skipped")
            return False
        enc = encode(meta, list(layers_kv))
        _, layout = decode_header(enc.header, meta.key)
        return self._put(meta.key, enc, layout, owned=True)

    def put_encoded(self, key: str, enc: EncodedEntry) -> bool:
        """Store an already encoded entry (e.g. from another tier). Raises ValueError when the
        header is invalid or bound to another key; blob checksums are verified."""
        check_key(key)
        try:
            _, layout = decode_header(enc.header, key)
            if len(enc.blobs) != len(layout.layers):
                raise CorruptEntry(f"{len(enc.blobs)} blobs for {len(layout.layers)} layers")
            if self.verify_reads is False:  # a store that will not verify on read verifies now
                for i, b in enumerate(enc.blobs):
                    decode_layer(layout, i, b, verify=True)
            else:
                for i, b in enumerate(enc.blobs):
                    if len(b) != layout.layers[i].nbytes:
                        raise CorruptEntry(
                            f"layer {i}: {len(b)} bytes, header says {layout.layers[i].nbytes}"
                        )
        except (CorruptEntry, UnsupportedEntry) as e:
            raise ValueError(f"put_encoded({key!r}): invalid entry: {e}") from None
        if self.contains(key):
            self._count("put_skipped")
            return False
        return self._put(key, enc, layout, owned=False)

    def get_meta(self, key: str) -> EntryMeta | None:
        r = self._guarded(key, None)
        return None if r is None else r[1].meta

    def fetch_layers(self, keys: Sequence[str], i: int) -> list[StoredLayer | Miss]:
        """Layer i of each key in storage dtype, or a ``Miss`` saying why not (the read path counts
        corruption, outages and absent entries apart). Per key here; backends that can batch the
        reads into one round trip override it. IndexError, and nothing removed, for a bad ``i``."""
        i = check_layer_index(i)
        return [self._fetch_layer(k, i) for k in keys]

    def get_layer(self, key: str, i: int) -> StoredLayer | None:
        """One layer in storage dtype (int8 + scales when quantized); ``.dequantize(dtype)``.
        None on a miss; IndexError (and nothing removed) when ``i`` is not a layer of the entry."""
        r = self.fetch_layers([key], i)[0]
        return None if isinstance(r, Miss) else r

    def _get_stored(self, key: str) -> tuple[EntryMeta, list[StoredLayer]] | None:
        r = self._get_full(key)
        return None if r is None else (r[1].meta, r[3])

    def get_encoded(self, key: str) -> EncodedEntry | None:
        """The verified entry bytes (for copying between tiers)."""
        r = self._get_full(key)
        return None if r is None else EncodedEntry(r[0], r[2])

    def get(self, key: str) -> ChunkKV | None:
        """All layers decoded to the model dtype."""
        r = self._get_full(key)
        if r is None:
            return None
        meta = r[1].meta
        return ChunkKV(meta, [layer.dequantize(meta.model_dtype) for layer in r[3]])

    def delete(self, key: str) -> bool:
        return self._remove(key)

    def stats(self) -> dict:
        with self._lock:
            c = dict(self._counts)
        out = {"uri": self.uri, **self._usage()}
        for name in ("hits", "misses", "corruptions", "unsupported", "evictions", "puts", "put_skipped", "errors"):
            out[name] = c.pop(name, 0)
        out.update(c)
        return out

    @contextmanager
    def pin(self, keys: Iterable[str]):
        """Entries pinned here are never evicted while the context is open (this process)."""
        keys = list(keys)
        with self._lock:
            self._pinned.update(keys)
        try:
            yield self
        finally:
            with self._lock:
                self._pinned.subtract(keys)
                self._pinned = +self._pinned  # drop zero counts

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return self._pinned[key] > 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # ---- internal helpers ---------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _put(self, key: str, enc: EncodedEntry, layout: Layout, owned: bool) -> bool:
        ok = self._store(key, enc, layout, owned)
        self._count("puts" if ok else "put_skipped")
        return ok

    def _fetch_layer(self, key: str, i: int) -> StoredLayer | Miss:
        try:
            r = self._load(key, [i])
            if r is None:
                return self._absent()
            layer = decode_layer(r[1], i, r[2][0], verify=self.verify_reads)
        except _READ_FAILURES as e:
            return self._missed(key, e)
        self._count("hits")
        return layer

    def _missed(self, key: str, err: Exception) -> Miss:
        """A read that raised: counted and handled by kind (newer format, damage, I/O)."""
        if isinstance(err, UnsupportedEntry):
            return self._unsupported(key, err)
        if isinstance(err, CorruptEntry):
            return self._corrupt(key, err)
        return self._read_failed(key, err)

    def _absent(self) -> Miss:
        self._count("misses")
        return ABSENT

    def _corrupt(self, key: str, err: Exception, miss: bool = True) -> Miss:
        """Evidence of damage: counted, a miss (unless found by ``contains``), the entry removed."""
        self._count("corruptions")
        if miss:
            self._count("misses")
        log.warning("%s: corrupt entry %s removed: %s", self.uri, key, err)
        try:
            self._remove(key)
        except (StoreError, OSError) as e:  # pragma: no cover - best effort
            log.warning("%s: could not remove corrupt entry %s: %s", self.uri, key, e)
        return CORRUPT

    def _unsupported(self, key: str, err: Exception) -> Miss:
        """An entry of another format version: counted, a miss, logged once per key, left alone."""
        self._count("unsupported")
        self._count("misses")
        with self._lock:
            first = key not in self._unsupported_seen
            if len(self._unsupported_seen) >= _SEEN_MAX:  # bounded: forget and maybe log again
                self._unsupported_seen.clear()
            self._unsupported_seen.add(key)
        if first:
            log.warning("%s: entry %s is of a format this build does not read (newer writer?); "
                        "skipped and left in place: %s", self.uri, key, err)
        return UNSUPPORTED

    def _guarded(self, key: str, layers: Sequence[int] | None) -> Loaded | None:
        try:
            r = self._load(key, layers)
        except _READ_FAILURES as e:
            self._missed(key, e)
            return None
        self._count("hits" if r is not None else "misses")
        return r

    def _read_failed(self, key: str, err: Exception) -> Miss:
        """An I/O or connection error on read: counted, logged, a miss."""
        self._count("errors")
        self._count("misses")
        log.debug("%s: read of %s failed: %s", self.uri, key, err)
        return ERROR

    def _get_full(self, key: str) -> tuple[bytes, Layout, list, list[StoredLayer]] | None:
        try:
            r = self._load(key, range(_ALL))
            if r is None:
                self._count("misses")
                return None
            header, layout, blobs = r
            stored = [decode_layer(layout, i, b, verify=self.verify_reads) for i, b in enumerate(blobs)]
            blobs = list(blobs)  # a backend may hand a lazy (streamed) sequence
        except _READ_FAILURES as e:
            self._missed(key, e)
            return None
        self._count("hits")
        return header, layout, blobs, stored


_ALL = 1 << 30  # ``range(_ALL)`` passed to _load means "every layer"
_READ_FAILURES = (UnsupportedEntry, CorruptEntry, StoreError, OSError)  # a read's misses, by kind
_SEEN_MAX = 65536  # unsupported keys remembered for logging once


def wants_all(layers: Sequence[int] | None) -> bool:
    return isinstance(layers, range) and layers == range(_ALL)
