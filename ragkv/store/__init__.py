"""Content-addressed chunk K/V storage: entry codec, backends, tiers. See README.md."""

from ragkv.store.base import KVStore
from ragkv.store.entry import (
    ChunkKV,
    EncodedEntry,
    EntryMeta,
    StoredLayer,
    decode_header,
    decode_layer,
    encode,
    encode_stored,
    quantize_layer,
)
from ragkv.store.errors import CorruptEntry, StoreError, StoreFull, StoreUnavailable, UnsupportedEntry
from ragkv.store.uri import open_store, redact_uri
from ragkv.store.values import Miss

__all__ = [
    "ChunkKV",
    "CorruptEntry",
    "EncodedEntry",
    "EntryMeta",
    "KVStore",
    "Miss",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "StoredLayer",
    "UnsupportedEntry",
    "decode_header",
    "decode_layer",
    "encode",
    "encode_stored",
    "open_store",
    "quantize_layer",
    "redact_uri",
]
