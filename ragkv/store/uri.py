"""Store URIs -> backends.

    memory | memory:// | memory://?max_bytes=1G
    disk:///abs/path?max_bytes=10G&fsync=1       (disk://rel/path is relative to the cwd)
    redis://[:password@]host:port/db?ttl=3600&namespace=tenant1:   (rediss:// for TLS)
    redis+cluster://host:port  or  redis://host:port?cluster=1    -> RedisCluster
A comma-separated list gives a TieredStore, fastest first: ``memory,disk:///var/cache/ragkv``.
Other query options of a redis URI are passed to ``redis.Redis.from_url``.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ragkv.store.base import KVStore
from ragkv.store.values import typed_budget

SCHEMES = ("memory", "disk", "redis", "rediss", "redis+cluster", "rediss+cluster")
_OPTIONS = {
    "memory": ("max_bytes",),
    "disk": ("max_bytes", "fsync"),
    "redis": ("ttl", "namespace", "cluster"),  # plus redis-py's own from_url options
}


def _bool(name: str, v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"option {name}={v!r}: expected 1/0/true/false")


def _opts(kind: str, query: str, passthrough: bool = False) -> tuple[dict, list]:
    ours, rest = {}, []
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k in _OPTIONS[kind]:
            ours[k] = v
        elif passthrough:
            rest.append((k, v))
        else:
            raise ValueError(f"unknown option {k!r} for {kind} store; valid options: {_OPTIONS[kind]}")
    return ours, rest


def open_one(uri: str) -> KVStore:
    uri = uri.strip()
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else uri.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown store scheme {scheme!r} in {uri!r}; valid schemes: {SCHEMES}")
    parts = urlsplit(uri) if "://" in uri else urlsplit(uri + "://")
    if scheme == "memory":
        from ragkv.store.memory import MemoryStore

        o, _ = _opts("memory", parts.query)
        if parts.netloc or parts.path:
            raise ValueError(f"memory store takes no path: {uri!r}")
        return MemoryStore(max_bytes=typed_budget(o.get("max_bytes", "1G")))
    if scheme == "disk":
        from ragkv.store.disk import DiskStore

        o, _ = _opts("disk", parts.query)
        path = parts.netloc + parts.path
        if not path:
            raise ValueError(f"disk store needs a path: disk:///abs/path, got {uri!r}")
        return DiskStore(
            path,
            max_bytes=typed_budget(o.get("max_bytes", "10G")),
            fsync=_bool("fsync", o.get("fsync", "1")),
        )
    from ragkv.store.redis_store import RedisStore

    o, rest = _opts("redis", parts.query, passthrough=True)
    cluster = "+cluster" in scheme or _bool("cluster", o.get("cluster", "0"))
    base_scheme = scheme.replace("+cluster", "")
    url = urlunsplit((base_scheme, parts.netloc, parts.path, urlencode(rest), ""))
    ttl = o.get("ttl")
    try:
        ttl_i = int(ttl) if ttl not in (None, "", "0") else None
    except ValueError:
        raise ValueError(f"option ttl={ttl!r}: expected seconds") from None
    return RedisStore(url, ttl=ttl_i, namespace=o.get("namespace", ""), cluster=cluster)


def open_store(uris: str) -> KVStore:
    """One URI -> that backend; a comma-separated list -> TieredStore (fastest first)."""
    items = [u for u in (s.strip() for s in uris.split(",")) if u]
    if not items:
        raise ValueError(f"no store URI given; valid schemes: {SCHEMES}")
    stores = [open_one(u) for u in items]
    if len(stores) == 1:
        return stores[0]
    from ragkv.store.tiered import TieredStore

    return TieredStore(stores)
