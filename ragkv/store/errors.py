"""Exceptions of the store layer. Reads never raise CorruptEntry/UnsupportedEntry/StoreError to
callers of ``KVStore`` (they become misses and counters); writes raise ``StoreError``/``StoreFull``
from single backends, and the TieredStore turns a failing tier's write into a logged, counted
skip; ``check()`` and opening a store raise ``StoreUnavailable``."""

from __future__ import annotations


class CorruptEntry(Exception):
    """An entry's bytes fail validation (magic, JSON, types, shapes, lengths, checksums, non-finite
    values, a header bound to another key, a damaged version field). Stores remove such entries."""


class UnsupportedEntry(Exception):
    """A well-formed entry header (valid magic) of a format version or checksum algorithm this build
    does not read, e.g. written by a newer ragkv. Not corruption: stores skip such an entry (a miss,
    counted as ``unsupported``) and leave it in place for the readers that understand it."""


class StoreError(Exception):
    """A backend could not carry out an operation (I/O error, unreachable server)."""


class StoreUnavailable(StoreError):
    """The backend cannot be used at all (``KVStore.check()``, opening a store): unreachable server,
    refused credentials, a root directory that cannot be written. The message names the backend
    (secrets redacted) and the cause."""


class StoreFull(StoreError):
    """No space left where the backend writes (ENOSPC/EDQUOT; the message names the path), or an
    entry larger than the store's whole byte budget (the message names both sizes)."""
