"""TieredStore: an ordered list of stores, fastest first (e.g. memory, disk, redis).

- ``put`` / ``put_encoded``: encode once, write the same bytes to every tier that lacks the key
  (also when only a lower tier has it). A tier whose write fails (StoreFull, Redis down) is logged
  and counted in ``tier_write_errors``; the others still get it.
- ``contains``: any tier; ``missing_tiers(key)``: the tiers lacking a valid entry; ``fill(key)``:
  copy a verified copy into them (Redis restarted empty under a disk tier, a truncated disk file).
- ``fetch_layers`` / ``get_layer``: each key from the first tier that has it, no promotion; a
  miss everywhere reports "error" if a tier could not be asked, else corrupt/unsupported/absent.
- ``get``: asks tier by tier; a hit in a lower tier is promoted (the whole verified entry is copied
  into every tier above) before it is decoded. ``get_meta`` (the read path's lookup) that hits a
  lower tier schedules the same promotion on a background thread, so the request streams its layers
  from where they are now and the next request finds the entry in the fastest tier.
  ``wait_promotions()`` waits for scheduled promotions (tests, shutdown).
- ``pin`` pins in every tier; ``stats()`` = ``{"tiers": [...], totals...}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

from torch import Tensor

import ragkv.store.entry as codec
from ragkv.store.base import KVStore, Loaded, log
from ragkv.store.entry import ChunkKV, EncodedEntry, EntryMeta, Layout, StoredLayer
from ragkv.store.errors import CorruptEntry, StoreError, StoreUnavailable, UnsupportedEntry
from ragkv.store.values import Miss, check_key

_REASON_ORDER = ("error", "corrupt", "unsupported", "absent")  # most telling first


class TieredStore(KVStore):
    def __init__(self, tiers: Sequence[KVStore], promote_on_lookup: bool = True):
        super().__init__()
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self._tiers = list(tiers)
        self.promote_on_lookup = promote_on_lookup
        self._promoter: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}

    @property
    def tiers(self) -> list[KVStore]:
        return self._tiers

    @property
    def uri(self) -> str:
        return ",".join(t.uri for t in self.tiers)

    # the hooks delegate to the tiers; the public methods below are overridden so each tier keeps
    # its own hit/miss/corruption accounting
    def _load(self, key: str, layers: Sequence[int] | None) -> Loaded | None:  # pragma: no cover
        raise NotImplementedError

    def _store(self, key: str, enc: EncodedEntry, layout: Layout, owned: bool) -> bool:  # pragma: no cover
        raise NotImplementedError  # put and put_encoded write tier by tier

    def _remove(self, key: str) -> bool:
        out = False
        for t in self.tiers:
            try:
                out |= t.delete(key)
            except StoreError as e:
                log.warning("%s: delete of %s failed: %s", t.uri, key, e)
        return out

    def keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for t in self.tiers:
            for k in t.keys():  # noqa: SIM118 - KVStore.keys(), not a dict
                if k not in seen:
                    seen.add(k)
                    yield k

    def check(self) -> None:
        """Check every tier; StoreUnavailable naming each failing tier (``tier 3 of 3: ...``)."""
        bad = []
        for j, t in enumerate(self.tiers, 1):
            try:
                t.check()
            except StoreUnavailable as e:
                bad.append(f"tier {j} of {len(self.tiers)}: {e}")
        if bad:
            raise StoreUnavailable("; ".join(bad))

    def contains(self, key: str) -> bool:
        """Any tier holds it (see ``missing_tiers`` for the ones that do not)."""
        return any(t.contains(key) for t in self.tiers)

    def missing_tiers(self, key: str) -> list[KVStore]:
        return [t for t in self.tiers if not t.contains(key)]

    def fill(self, key: str) -> bool:
        """Copy the entry from the first tier holding a verified copy (``get_encoded``: a corrupt
        copy is counted and removed there, the next tier is tried) into every tier that lacks it.
        True when every tier now holds it; False when no tier has a valid copy or a write failed."""
        missing = self.missing_tiers(key)
        if not missing:
            return True
        enc = None
        for t in self.tiers:
            if not any(t is m for m in missing):
                enc = t.get_encoded(key)
                if enc is not None:
                    break
        if enc is None:
            return False
        ok = True
        for t in missing:
            try:
                if t.put_encoded(key, enc):
                    self._count("fills")
                elif not t.contains(key):  # e.g. larger than a memory tier's budget
                    ok = False
            except StoreError as e:
                self._count("tier_write_errors")
                log.warning("%s: fill of %s failed: %s", t.uri, key, e)
                ok = False
        return ok

    def put_encoded(self, key: str, enc: EncodedEntry) -> bool:
        """Write the entry into every tier that lacks it (each tier validates it and skips it when
        present). True when a tier was written; False when every tier already had it."""
        check_key(key)
        try:
            codec.decode_header(enc.header, key)
        except (CorruptEntry, UnsupportedEntry) as e:
            raise ValueError(f"put_encoded({key!r}): invalid entry: {e}") from None
        wrote = self._write_tiers(self.tiers, key, enc)
        self._count("puts" if wrote else "put_skipped")
        return wrote

    def _write_tiers(self, tiers: Sequence[KVStore], key: str, enc: EncodedEntry) -> bool:
        wrote = False
        for t in tiers:
            try:
                wrote |= t.put_encoded(key, enc)
            except StoreError as e:
                self._count("tier_write_errors")
                log.warning("%s: write of %s skipped: %s", t.uri, key, e)
        return wrote

    def put(self, meta: EntryMeta, layers_kv: Sequence[tuple[Tensor, Tensor]]) -> bool:
        check_key(meta.key)
        missing = [t for t in self.tiers if not t.contains(meta.key)]
        if not missing:
            self._count("put_skipped")
            return False
        wrote = self._write_tiers(missing, meta.key, codec.encode(meta, list(layers_kv)))
        self._count("puts" if wrote else "put_skipped")
        return wrote

    def _first(self, read):
        """(tier index, ``read(tier)``) of the first tier whose read is not None, counted as a hit;
        (-1, None) and a miss when none has it."""
        for j, t in enumerate(self.tiers):
            got = read(t)
            if got is not None:
                self._count("hits")
                return j, got
        self._count("misses")
        return -1, None

    def get_meta(self, key: str) -> EntryMeta | None:
        j, meta = self._first(lambda t: t.get_meta(key))
        if j > 0 and self.promote_on_lookup:
            self._schedule_promotion(key)
        return meta

    def fetch_layers(self, keys: Sequence[str], i: int) -> list[StoredLayer | Miss]:
        """Layer i of each key from the first tier that has it, asking each tier once for all the
        keys still missing (no promotion). A key no tier has gets the most telling reason of its
        tiers' misses: "error" when a tier could not be asked (the entry may exist there), else
        "corrupt", else "unsupported", else "absent". Each tier counts its own misses too."""
        i = codec.check_layer_index(i)
        out: list = [None] * len(keys)
        reasons: list[set[str]] = [set() for _ in keys]
        todo = list(range(len(keys)))
        for t in self.tiers:
            if not todo:
                break
            got = t.fetch_layers([keys[j] for j in todo], i)
            left = []
            for j, r in zip(todo, got):
                if isinstance(r, Miss):
                    reasons[j].add(r.reason)
                    left.append(j)
                else:
                    out[j] = r
            todo = left
        for j in todo:
            out[j] = Miss(next(r for r in _REASON_ORDER if r in reasons[j]))
        self._count("hits", len(keys) - len(todo))
        self._count("misses", len(todo))
        return out

    def get_encoded(self, key: str) -> EncodedEntry | None:
        j, enc = self._first(lambda t: t.get_encoded(key))
        if enc is not None:
            self._promote(key, enc, j)
        return enc

    def _get_stored(self, key: str) -> tuple[EntryMeta, list[StoredLayer]] | None:
        j, r = self._first(lambda t: t._get_full(key))
        if r is None:
            return None
        header, layout, blobs, stored = r
        self._promote(key, EncodedEntry(header, blobs), j)
        return layout.meta, stored

    def get(self, key: str) -> ChunkKV | None:
        r = self._get_stored(key)
        if r is None:
            return None
        meta, stored = r
        return ChunkKV(meta, [s.dequantize(meta.model_dtype) for s in stored])

    def _schedule_promotion(self, key: str) -> None:
        with self._lock:
            if key in self._pending:
                return
            if self._promoter is None:
                self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragkv-promote")
            fut = self._promoter.submit(self.promote, key)
            self._pending[key] = fut
        fut.add_done_callback(lambda _f: self._pending.pop(key, None))

    def wait_promotions(self) -> None:
        for fut in list(self._pending.values()):
            fut.result()

    def promote(self, key: str) -> bool:
        """Copy an entry found in a lower tier into the tiers above it."""
        return self.get_encoded(key) is not None

    def _promote(self, key: str, enc: EncodedEntry, found_at: int) -> None:
        if found_at == 0:
            return
        codec.decode_header(enc.header, key)
        for t in self.tiers[:found_at]:
            try:
                if t.put_encoded(key, enc):  # copies: the caller's tensors share enc's buffers
                    self._count("promotions")
            except (StoreError, ValueError) as e:
                log.warning("%s: promotion of %s skipped: %s", t.uri, key, e)

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    @contextmanager
    def pin(self, keys: Iterable[str]):
        keys = list(keys)
        with ExitStack() as stack:
            for t in self.tiers:
                stack.enter_context(t.pin(keys))
            yield self

    def is_pinned(self, key: str) -> bool:
        return self.tiers[0].is_pinned(key)

    def stats(self) -> dict:
        tiers = [t.stats() for t in self.tiers]
        out: dict = {"uri": self.uri, "tiers": tiers}
        with self._lock:
            c = dict(self._counts)
        out["hits"], out["misses"] = c.pop("hits", 0), c.pop("misses", 0)  # of the whole stack
        for name in ("entries", "bytes", "corruptions", "unsupported", "evictions", "errors"):
            out[name] = sum(int(s.get(name) or 0) for s in tiers)
        out.update(c)
        return out

    def close(self) -> None:
        if self._promoter is not None:
            self._promoter.shutdown(wait=True)
            self._promoter = None
        for t in self.tiers:
            t.close()
