"""Store URIs -> backends, and URIs made safe to show.

    memory | memory:// | memory://?max_bytes=1G
    disk:///abs/path?max_bytes=10G&fsync=1&mode=0600   (disk://rel/path is relative to the cwd)
    redis://[[user]:password@]host:port/db?ttl=3600&namespace=tenant1   (rediss:// for TLS)
    redis+cluster://host:port  or  redis://host:port?cluster=1    -> RedisCluster
A comma-separated list gives a TieredStore, fastest first: ``memory,disk:///var/cache/ragkv``; the
list splits only at a comma followed by a scheme, so a comma inside a password stays.

Every option is checked when the store is opened; a bad value or an unknown option is a
ValueError naming it (and listing the valid ones). A redis URI takes ``ttl`` (whole seconds, 0 or
empty: none), ``namespace``, ``cluster`` and the redis-py connection options in ``REDIS_OPTIONS``,
parsed here and passed typed. ``redact_uri`` is how any URI is shown (uri properties, errors, CLI).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ragkv.store.base import KVStore
from ragkv.store.values import redact_uri, split_uris, typed_budget

SCHEMES = ("memory", "disk", "redis", "rediss", "redis+cluster", "rediss+cluster")
_OPTIONS = {
    "memory": ("max_bytes",),
    "disk": ("max_bytes", "fsync", "mode"),
    "redis": ("ttl", "namespace", "cluster"),  # plus REDIS_OPTIONS
}
# ---- option parsing -------------------------------------------------------------------------


def _bool(name: str, v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"option {name}={v!r}: expected 1/0/true/false")


def _number(kind, lo, what):
    def parse(name: str, v: str):
        try:
            x = kind(v)
        except ValueError:
            x = None
        if x is None or x != x or x < lo:  # x != x: NaN
            raise ValueError(f"option {name}={v!r}: expected {what}")
        return x

    return parse


def _text(name: str, v: str) -> str:
    return v


def _choice(*valid):
    def parse(name: str, v: str) -> str:
        if v.lower() not in valid:
            raise ValueError(f"option {name}={v!r}: expected one of {', '.join(valid)}")
        return v.lower()

    return parse


_seconds = _number(float, 0, "seconds (a number >= 0)")
# redis-py connection options a redis URI may carry (parsed here, passed to redis-py typed)
REDIS_OPTIONS = {
    "socket_timeout": _seconds,
    "socket_connect_timeout": _seconds,
    "health_check_interval": _number(int, 0, "whole seconds (an integer >= 0)"),
    "socket_keepalive": _bool,
    "retry_on_timeout": _bool,
    "max_connections": _number(int, 1, "an integer >= 1"),
    "db": _number(int, 0, "a database number (an integer >= 0)"),
    "protocol": _choice("2", "3"),
    "client_name": _text,
    "username": _text,
    "password": _text,
    "ssl_cert_reqs": _choice("none", "optional", "required"),
    "ssl_ca_certs": _text,
    "ssl_ca_path": _text,
    "ssl_certfile": _text,
    "ssl_keyfile": _text,
    "ssl_password": _text,
    "ssl_check_hostname": _bool,
}


def _opts(kind: str, query: str) -> tuple[dict, dict]:
    """(our options, redis-py options) of a query; unknown options are refused."""
    ours, client = {}, {}
    valid = _OPTIONS[kind] + (tuple(REDIS_OPTIONS) if kind == "redis" else ())
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k in _OPTIONS[kind]:
            ours[k] = v
        elif kind == "redis" and k in REDIS_OPTIONS:
            client[k] = REDIS_OPTIONS[k](k, v)
        else:
            raise ValueError(f"unknown option {k!r} for {kind} store; valid options: {', '.join(valid)}")
    return ours, client


def _mode(v: str) -> int:
    from ragkv.store.disk_io import check_mode

    try:
        mode = int(v, 8)
    except ValueError:
        raise ValueError(f"option mode={v!r}: expected an octal file mode such as 0600 or 0640") from None
    try:
        return check_mode(mode)
    except ValueError as e:
        raise ValueError(f"option mode={v!r}: {e}") from None


def _ttl(v: str | None) -> int | None:
    if v in (None, "", "0"):
        return None
    if not v.isdigit():
        raise ValueError(f"option ttl={v!r}: expected a positive whole number of seconds (0 or empty: no TTL)")
    return int(v)


# ---- opening --------------------------------------------------------------------------------


def open_one(uri: str, create: bool = True, read_only: bool = False) -> KVStore:
    """One URI -> its backend. ``create``/``read_only``: a disk store's (``DiskStore``)."""
    uri = uri.strip()
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else uri.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown store scheme {scheme!r} in {redact_uri(uri)!r}; valid schemes: {SCHEMES}")
    parts = urlsplit(uri) if "://" in uri else urlsplit(uri + "://")
    if scheme == "memory":
        from ragkv.store.memory import MemoryStore

        o, _ = _opts("memory", parts.query)
        if parts.netloc or parts.path:
            raise ValueError(f"memory store takes no path: {redact_uri(uri)!r}")
        return MemoryStore(max_bytes=typed_budget(o.get("max_bytes", "1G")))
    if scheme == "disk":
        from ragkv.store.disk import DiskStore

        o, _ = _opts("disk", parts.query)
        path = parts.netloc + parts.path
        if not path:
            raise ValueError(f"disk store needs a path: disk:///abs/path, got {redact_uri(uri)!r}")
        return DiskStore(
            path,
            max_bytes=typed_budget(o.get("max_bytes", "10G")),
            fsync=_bool("fsync", o.get("fsync", "1")),
            mode=_mode(o["mode"]) if "mode" in o else 0o600,
            create=create,
            read_only=read_only,
        )
    from ragkv.store.redis_store import RedisStore

    o, client = _opts("redis", parts.query)
    if parts.path not in ("", "/") and not re.fullmatch(r"/[0-9]+", parts.path):
        raise ValueError(f"redis database in the path must be a number (/0, /1, ...): {redact_uri(uri)!r}")
    if "db" in client and parts.path not in ("", "/") and int(parts.path[1:]) != client["db"]:
        raise ValueError(f"the redis database is given twice and they disagree: /{parts.path[1:]} in the path, "
                         f"db={client['db']} in the options; give one: {redact_uri(uri)!r}")
    cluster = "+cluster" in scheme or _bool("cluster", o.get("cluster", "0"))
    base_scheme = scheme.replace("+cluster", "")
    if base_scheme != "rediss" and any(k.startswith("ssl_") for k in client):
        raise ValueError(f"ssl_* options need a rediss:// URI: {redact_uri(uri)!r}")
    url = urlunsplit((base_scheme, parts.netloc, parts.path, "", ""))
    return RedisStore(url, ttl=_ttl(o.get("ttl")), namespace=o.get("namespace", ""), cluster=cluster, **client)


def open_store(uris: str, *, create: bool = True, read_only: bool = False) -> KVStore:
    """One URI -> that backend; a comma-separated list -> TieredStore (fastest first). For the
    operators' tools: ``create=False`` refuses a disk store that is not there instead of creating
    it; ``read_only=True`` (``ragkv stats``) also creates, locks and sweeps nothing."""
    items = split_uris(uris)
    if not items:
        raise ValueError(f"no store URI given; valid schemes: {SCHEMES}")
    stores = [open_one(u, create, read_only) for u in items]
    if len(stores) == 1:
        return stores[0]
    from ragkv.store.tiered import TieredStore

    return TieredStore(stores)
