"""``ServeStore``: what the server's engine reads and writes. The corpus store (``--store``) is read
first and never written; the write store (``--write-store``) is read after it and takes the entries
computed for requests, as the ``WritePolicy`` allows (ragkv.integrations.serve.writes)."""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.store import KVStore, decode_header, encode
from ragkv.store.errors import CorruptEntry, StoreError, UnsupportedEntry
from ragkv.store.tiered import TieredStore
from ragkv.store.values import check_key

from .writes import WritePolicy


class ServeStore(TieredStore):
    """The corpus store (read, never written) over the store of request-written entries (read after
    it, written under ``policy``). Nothing found in the write store is copied into the corpus."""

    def __init__(self, corpus: KVStore, writes: KVStore, policy: WritePolicy):
        super().__init__([corpus, writes], promote_on_lookup=False)
        self.corpus, self.writes, self.policy = corpus, writes, policy

    @property
    def uri(self) -> str:
        return self.corpus.uri

    def put_encoded(self, key: str, enc) -> bool:
        check_key(key)
        try:
            _, layout = decode_header(enc.header, key)
        except (CorruptEntry, UnsupportedEntry) as e:
            raise ValueError(f"put_encoded({key!r}): invalid entry: {e}") from None
        if self.contains(key):
            self._count("put_skipped")
            return False
        n = layout.total_nbytes  # what the entry takes in a store
        ticket = self.policy.reserve(n)
        if ticket is None:
            self._count("writes_refused")
            return False
        written = False
        try:
            written = self.writes.put_encoded(key, enc)
        except StoreError:
            self._count("tier_write_errors")
            raise
        finally:
            self.policy.settle(ticket, written)
        self._count("puts" if written else "put_skipped")
        return written

    def put(self, meta, layers_kv: Sequence) -> bool:
        return self.put_encoded(meta.key, encode(meta, list(layers_kv)))

    def missing_tiers(self, key: str) -> list[KVStore]:
        return [] if self.contains(key) else [self.writes]

    def fill(self, key: str) -> bool:
        return self.contains(key)

    def clear(self) -> None:
        self.writes.clear()  # the corpus is the operator's (ragkv clear)

    def _promote(self, key: str, enc, found_at: int) -> None:
        """(TieredStore copies lower-tier hits upward: never into the corpus here.)"""
