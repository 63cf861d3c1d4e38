"""Shared helpers of the store tests (imported as a top-level module: tests/ has no __init__)."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch

from ragkv.keys import chunk_key
from ragkv.store.entry import EntryMeta


def make_entry(
    n_tokens=16,
    n_layers=3,
    heads=2,
    dim=8,
    storage="float32",
    axis=None,
    model_dtype="float32",
    seed=0,
    salt="",
):
    g = torch.Generator().manual_seed(seed)
    toks = tuple(int(t) for t in torch.randint(0, 50000, (n_tokens,), generator=g))
    key = chunk_key("fp-test", toks, "sink1/v1", namespace=salt)
    meta = EntryMeta(
        key=key,
        token_ids=toks,
        start_pos=1,
        num_layers=n_layers,
        num_kv_heads=heads,
        head_dim=dim,
        model_dtype=model_dtype,
        storage_dtype=storage,
        quant_axis=axis,
        fingerprint="fp-test",
        policy="sink1/v1",
        extra={"doc": "d1"},
    )
    dt = getattr(torch, model_dtype)
    layers = []
    for _ in range(n_layers):
        k = torch.randn(heads, n_tokens, dim, generator=g)
        k[:, :, 0] *= 20  # an outlier channel, as real keys have
        v = torch.randn(heads, n_tokens, dim, generator=g)
        layers.append((k.to(dt), v.to(dt)))
    return meta, layers


def future_version(header: bytes, version: int = 2) -> bytes:
    """The header as a newer writer would write it: prefix and JSON both say ``version`` (same
    length, valid crc, so the entry's byte layout is unchanged)."""
    magic, _ver, n, _ = struct.unpack_from("<8sIII", header)
    doc = json.loads(header[20 : 20 + n])
    doc["version"] = version
    js = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    assert len(js) == n
    return struct.pack("<8sIII", magic, version, n, zlib.crc32(js)) + js + header[20 + n :]


def open_redis(request, kind: str, namespace: str):
    """A RedisStore on the session's single server (``redis``) or on its 3-master cluster
    (``cluster``), cleared and closed after the test."""
    from ragkv.store.redis_store import RedisStore

    request.applymarker(pytest.mark.redis)
    if kind == "cluster":
        s = RedisStore(request.getfixturevalue("redis_cluster").client_url, namespace=namespace, cluster=True)
    else:
        s = RedisStore(request.getfixturevalue("redis_server").url, namespace=namespace)

    def done():
        s.clear()
        s.close()

    request.addfinalizer(done)
    return s


def layers_or_none(store, keys, i):
    """Layer i of each key from ``fetch_layers``, None for a miss (whatever its reason)."""
    from ragkv.store.values import Miss

    return [None if isinstance(r, Miss) else r for r in store.fetch_layers(keys, i)]
