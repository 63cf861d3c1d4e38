"""Redis backend (redis-py), binary-safe, Redis Cluster ready.

Keys of one entry share the hash tag ``{<key>}`` so they live in one cluster slot::

    ragkv:<namespace>/{<key>}:h      header (written last)
    ragkv:<namespace>/{<key>}:<i>    layer blob i (contiguous from 0)

Namespaces are ``[A-Za-z0-9_.:-]*`` and keys ``check_key``'s alphabet, so ``/`` ends the namespace
and no caller-supplied string is a glob: SCAN patterns are escaped (``_glob_escape``) and never
built from a key. Entries of the old layout (``<namespace>ragkv:{<key>}:...``) are neither read nor
deleted by this version (they expire by TTL or can be removed with redis-cli).

- Write: one MULTI/EXEC transaction sets every blob, then the header (with the optional TTL on
  every key). EXEC is atomic, so no reader sees part of an entry; concurrent writers of one key
  leave the last writer's complete entry.
- Read: header and requested blobs in one MULTI/EXEC (a consistent snapshot); ``fetch_layers``/
  ``get_layer(s)``: the header and that blob of every key, all keys in one round trip.
- Unreachable server: the first failure logs one warning, later calls are misses / skipped writes
  without touching the network until a back-off (1 s doubling to 30 s) expires; the next success
  (or ``check()``) logs "reachable again". Requests never fail because Redis is down.
- ``pin`` is a no-op here: Redis evicts by its own maxmemory policy / TTL.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time
from collections.abc import Iterator, Sequence

import redis
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ragkv.store.base import KVStore, Loaded, Miss, log, wants_all
from ragkv.store.entry import (
    EncodedEntry,
    Layout,
    StoredLayer,
    check_layer_index,
    decode_header,
    decode_layer,
)
from ragkv.store.errors import CorruptEntry, StoreError, StoreUnavailable, UnsupportedEntry
from ragkv.store.values import check_key, is_key, redact_uri

_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)
_NS_RE = re.compile(r"[A-Za-z0-9_.:-]*")
_DEL_BATCH = 64  # blob keys deleted per DEL when the header cannot say how many there are
_SCAN_BATCH = 512


def _glob_escape(s: str) -> str:
    """``s`` as a literal inside a Redis glob pattern (SCAN MATCH, KEYS)."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", s)


class RedisStore(KVStore):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl: int | None = None,
        namespace: str = "",
        cluster: bool = False,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        **client_kwargs,
    ):
        """``url``: a redis-py URL (shown as ``redact_uri(url)``); ``ttl``: whole seconds >= 1 or
        None; ``client_kwargs``: redis-py connection options. Bad namespace or ttl: ValueError."""
        super().__init__()
        if not isinstance(namespace, str) or not _NS_RE.fullmatch(namespace):
            raise ValueError(
                f"redis namespace {namespace!r}: use only [A-Za-z0-9_.:-] (no glob characters, no '/', "
                "no hash-tag braces)"
            )
        if ttl == 0:
            ttl = None
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
            raise ValueError(f"redis ttl {ttl!r}: expected whole seconds >= 1 (or None: no TTL)")
        self._url, self.ttl, self.namespace, self.cluster = url, ttl, namespace, cluster
        self._options = dict(client_kwargs)  # as given: shown (secrets masked) in ``uri``
        client_kwargs.setdefault("socket_connect_timeout", 1.0)
        client_kwargs.setdefault("socket_timeout", 10.0)
        if cluster:  # RedisCluster asks the cluster for its slots right away
            try:
                self.client = redis.RedisCluster.from_url(url, **client_kwargs)
            except (RedisError, RedisClusterException, OSError) as e:  # RedisClusterException: no RedisError
                raise StoreUnavailable(f"{redact_uri(url)}: cannot reach the cluster: {e}") from None
        else:
            self.client = redis.Redis.from_url(url, **client_kwargs)
        self._backoff0, self._backoff_max = backoff_s, max_backoff_s
        self._down_until = 0.0
        self._backoff = backoff_s
        self._down = False
        self._state_lock = threading.Lock()

    @property
    def uri(self) -> str:
        """The URL with its options, every secret shown as ``***`` (``redact_uri``)."""
        q = [f"ttl={self.ttl}"] if self.ttl else []
        if self.namespace:
            q.append(f"namespace={self.namespace}")
        if self.cluster and not self._url.startswith("redis+cluster"):
            q.append("cluster=1")
        q += [f"{k}={v}" for k, v in self._options.items()]
        return redact_uri(self._url + (("&" if "?" in self._url else "?") + "&".join(q) if q else ""))

    def check(self) -> None:
        """PING now (no back-off): StoreUnavailable when unreachable or our credentials are refused."""
        try:
            self.client.ping()
        except (RedisError, *_DOWN_ERRORS) as e:
            auth = isinstance(e, AuthenticationError) or any(w in str(e) for w in ("NOAUTH", "WRONGPASS"))
            raise StoreUnavailable(f"{self.uri}: {'authentication failed' if auth else 'cannot connect'}: {e}") from None
        with self._state_lock:
            if self._down:  # it answers: no need to wait for the back-off
                log.warning("%s: redis reachable again", self.uri)
                self._down = False

    def _base(self, key: str) -> str:
        return f"ragkv:{self.namespace}/{{{check_key(key)}}}"

    def _hkey(self, key: str) -> str:
        return self._base(key) + ":h"

    def _bkey(self, key: str, i: int) -> str:
        return f"{self._base(key)}:{i}"

    def _pattern(self) -> str:
        """SCAN pattern of every Redis key of this namespace's entries."""
        return _glob_escape(f"ragkv:{self.namespace}/{{") + "*"

    def _scan(self) -> list[str]:
        names = self._call(lambda: list(self.client.scan_iter(match=self._pattern(), count=1000)))
        return [n.decode() if isinstance(n, bytes) else n for n in names]

    # ---- availability ---------------------------------------------------------------------------

    def _call(self, fn):
        """Run ``fn()`` unless Redis is known down; connection trouble -> StoreError."""
        with self._state_lock:
            if self._down and time.monotonic() < self._down_until:
                raise StoreError(f"{self.uri}: unavailable (backing off)")
        try:
            out = fn()
        except _DOWN_ERRORS as e:
            with self._state_lock:
                if not self._down:
                    what = "refused our credentials" if isinstance(e, AuthenticationError) else "unreachable"
                    log.warning("%s: redis %s (%s); treating as misses, retrying later", self.uri, what, e)
                    self._down = True
                    self._backoff = self._backoff0
                else:
                    self._backoff = min(self._backoff * 2, self._backoff_max)
                self._down_until = time.monotonic() + self._backoff
            raise StoreError(f"{self.uri}: {e}") from e
        except RedisError as e:
            raise StoreError(f"{self.uri}: {e}") from e
        with self._state_lock:
            if self._down:
                log.warning("%s: redis reachable again", self.uri)
                self._down = False
        return out

    @property
    def available(self) -> bool:
        return not self._down

    # ---- hooks --------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """The header is valid for ``key`` and every blob key exists (two round trips when present:
        GET header, EXISTS blobs). A damaged entry (e.g. a blob evicted by maxmemory) is counted as
        corrupt and removed, so a put rewrites it; an entry of a newer format counts as present."""
        def check():
            _, layout = decode_header(header, key)
            names = [self._bkey(key, i) for i in range(len(layout.layers))]
            found = self._call(lambda: self.client.exists(*names))
            if found != len(names):
                raise CorruptEntry(f"{len(names) - found} of {len(names)} layer blobs missing (evicted or expired)")

        try:
            header = self._call(lambda: self.client.get(self._hkey(key)))
            return header is not None and self._checked(key, check)
        except StoreError:
            self._count("errors")
            return False

    def _load(self, key: str, layers: Sequence[int] | None) -> Loaded | None:
        if layers is None:
            header = self._call(lambda: self.client.get(self._hkey(key)))
            if header is None:
                return None
            _, layout = decode_header(header, key)
            return header, layout, []
        if wants_all(layers):
            header = self._call(lambda: self.client.get(self._hkey(key)))
            if header is None:
                return None
            _, layout = decode_header(header, key)
            idx = list(range(len(layout.layers)))
        else:
            idx = list(layers)

        def fetch():
            pipe = self.client.pipeline(transaction=True)
            pipe.get(self._hkey(key))
            for i in idx:
                pipe.get(self._bkey(key, i))
            return pipe.execute()

        res = self._call(fetch)
        header, blobs = res[0], res[1:]
        if header is None:
            return None
        _, layout = decode_header(header, key)
        for i in idx:
            check_layer_index(i, layout)  # a caller's bad index, before blaming the entry
        if any(b is None for b in blobs):
            raise CorruptEntry("header present but a layer blob is missing (expired or evicted)")
        return header, layout, blobs

    def fetch_layers(self, keys: Sequence[str], i: int) -> list[StoredLayer | Miss]:
        """Layer i of every key in one round trip (header + blob per key, one MULTI unless
        clustered). IndexError, with nothing removed, when ``i`` is not a layer of an entry of the
        batch; the index is checked against every header before any entry is blamed."""
        i = check_layer_index(i)
        for key in keys:
            check_key(key)
        if not keys:
            return []

        def fetch():
            pipe = self.client.pipeline(transaction=not self.cluster)
            for key in keys:
                pipe.get(self._hkey(key))
                pipe.get(self._bkey(key, i))
            return pipe.execute()

        try:
            res = self._call(fetch)
        except StoreError as e:
            return [self._read_failed(key, e) for key in keys]
        layouts: list = []
        for j, key in enumerate(keys):
            try:
                layouts.append(None if res[2 * j] is None else decode_header(res[2 * j], key)[1])
            except (CorruptEntry, UnsupportedEntry) as e:
                layouts.append(e)
            if isinstance(layouts[-1], Layout):
                check_layer_index(i, layouts[-1])
        return [self._layer_of(key, i, layouts[j], res[2 * j + 1]) for j, key in enumerate(keys)]

    def _layer_of(self, key: str, i: int, layout, blob) -> StoredLayer | Miss:
        """One key's part of a batched read: its decoded header (or why not) and its blob."""
        if layout is None:
            return self._absent()
        if isinstance(layout, Exception):  # the header was corrupt or of a newer format
            return self._missed(key, layout)
        try:
            if blob is None:
                raise CorruptEntry("header present but a layer blob is missing (expired or evicted)")
            layer = decode_layer(layout, i, blob, verify=self.verify_reads)
        except CorruptEntry as e:
            return self._corrupt(key, e)
        self._count("hits")
        return layer

    def _store(self, key: str, enc: EncodedEntry, layout: Layout, owned: bool) -> bool:
        def write():
            pipe = self.client.pipeline(transaction=True)
            for i, b in enumerate(enc.blobs):
                pipe.set(self._bkey(key, i), b, ex=self.ttl)
            pipe.set(self._hkey(key), enc.header, ex=self.ttl)  # last: the entry becomes visible
            pipe.execute()

        self._call(write)
        return True

    def _remove(self, key: str) -> bool:
        base = self._base(key)
        hdr = self._call(lambda: self.client.get(base + ":h"))
        n = None
        with contextlib.suppress(CorruptEntry, UnsupportedEntry):
            n = decode_header(hdr, key)[0].num_layers if hdr is not None else None
        if n is not None:
            names = [base + ":h"] + [f"{base}:{i}" for i in range(n)]
            return bool(self._call(lambda: self.client.delete(*names)))
        # header absent or unreadable: blobs are contiguous from 0, delete them batch by batch
        # until a batch comes back short (never by pattern: no key is ever a glob)
        deleted = self._call(lambda: self.client.delete(base + ":h"))
        for start in itertools.count(0, _DEL_BATCH):
            batch = [f"{base}:{i}" for i in range(start, start + _DEL_BATCH)]
            got = self._call(lambda b=batch: self.client.delete(*b))
            deleted += got
            if got < len(batch):
                break
        return deleted > 0

    def keys(self) -> Iterator[str]:
        lo = f"ragkv:{self.namespace}/{{"
        try:
            names = self._scan()
        except StoreError:
            return iter(())
        found = {n[len(lo) : -3] for n in names if n.startswith(lo) and n.endswith("}:h")}
        return iter(sorted(k for k in found if is_key(k)))

    def clear(self) -> None:
        names = self._scan()
        for i in range(0, len(names), _SCAN_BATCH):
            batch = names[i : i + _SCAN_BATCH]
            if self.cluster:
                for n in batch:
                    self._call(lambda n=n: self.client.delete(n))
            else:
                self._call(lambda b=batch: self.client.delete(*b))

    def _usage(self) -> dict:
        """Entries (committed headers) and bytes (STRLEN of every key of this namespace): a full
        SCAN, meant for operators (``ragkv stats``), not for the request path."""
        try:
            names = self._scan()
            nbytes = 0
            for i in range(0, len(names), _SCAN_BATCH):
                pipe = self.client.pipeline(transaction=False)
                for n in names[i : i + _SCAN_BATCH]:
                    pipe.strlen(n)
                nbytes += sum(int(x or 0) for x in self._call(pipe.execute))
        except StoreError:
            return {"entries": None, "bytes": None, "available": self.available}
        entries = sum(1 for n in names if n.endswith("}:h"))
        return {"entries": entries, "bytes": nbytes, "available": self.available}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
