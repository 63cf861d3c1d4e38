"""Redis namespaces and keys: no caller-supplied string ever becomes a SCAN glob."""

import uuid
from urllib.parse import quote

import pytest
from store_testlib import layers_or_none, make_entry

from ragkv.store import open_store
from ragkv.store.entry import encode
from ragkv.store.redis_store import RedisStore

pytestmark = pytest.mark.redis


def _names(store, key=None) -> set[str]:
    """Every Redis key of the server that mentions ``key`` (or all of them)."""
    pat = "*" if key is None else f"*{{{key}}}*"
    return {n.decode() for n in store.client.scan_iter(match=pat, count=1000)}


@pytest.mark.parametrize("ns", ["t*", "tenant?", "tenant[AB]", "a\\b", "a/b", "a{b}", "a b", "ns\n", "é"])
def test_namespace_outside_the_safe_alphabet_is_refused(redis_server, ns):
    with pytest.raises(ValueError, match=r"namespace.*\[A-Za-z0-9_\.:-\]"):
        RedisStore(redis_server.url, namespace=ns)
    with pytest.raises(ValueError, match="namespace"):
        open_store(f"{redis_server.url}?namespace={quote(ns)}")


def test_tenants_stay_apart_under_keys_stats_clear_and_delete(redis_server):
    uid = uuid.uuid4().hex[:8]
    a = open_store(f"{redis_server.url}?namespace=tenantA-{uid}")
    b = open_store(f"{redis_server.url}?namespace=tenantB-{uid}")
    prefix = open_store(f"{redis_server.url}?namespace=tenant")  # a prefix of both names
    ea, eb = make_entry(seed=1), make_entry(seed=2)
    a.put(*ea)
    b.put(*eb)
    prefix.put(*ea)
    assert list(a.keys()) == [ea[0].key] and list(b.keys()) == [eb[0].key]
    assert a.stats()["entries"] == 1 and b.stats()["entries"] == 1 and prefix.stats()["entries"] == 1
    assert a.stats()["bytes"] == encode(*ea).nbytes
    prefix.clear()
    assert list(a.keys()) == [ea[0].key] and a.get(ea[0].key) is not None
    assert b.get(eb[0].key) is not None
    assert not b.delete(ea[0].key)  # tenant B cannot reach tenant A's entry
    a.clear()
    assert list(a.keys()) == [] and b.get(eb[0].key) is not None and b.stats()["entries"] == 1
    b.clear()


def test_key_layout_separates_namespace_and_key(redis_store, redis_ns):
    meta, layers = make_entry(n_layers=2)
    redis_store.put(meta, layers)
    assert _names(redis_store, meta.key) == {
        f"ragkv:{redis_ns}/{{{meta.key}}}:h",
        f"ragkv:{redis_ns}/{{{meta.key}}}:0",
        f"ragkv:{redis_ns}/{{{meta.key}}}:1",
    }


@pytest.mark.parametrize("key", ["*", "?", "[a-z]*", "a*", "../x", "/etc/passwd", "x\x00y", "k" * 201, "", "a b", "ok\n"])
def test_redis_refuses_keys_the_disk_store_refuses(redis_store, key):
    meta, layers = make_entry()
    redis_store.put(meta, layers)
    enc = encode(meta, layers)
    for op in (
        lambda: redis_store.delete(key),
        lambda: redis_store.get(key),
        lambda: redis_store.get_meta(key),
        lambda: redis_store.get_layer(key, 0),
        lambda: layers_or_none(redis_store, [meta.key, key], 0),
        lambda: redis_store.contains(key),
        lambda: redis_store.put_encoded(key, enc),
    ):
        with pytest.raises(ValueError, match="invalid store key"):
            op()
    assert list(redis_store.keys()) == [meta.key] and redis_store.get(meta.key) is not None


@pytest.mark.parametrize("n_layers", [3, 64, 70, 130])
def test_entry_with_unreadable_header_is_removed_whole_and_alone(redis_store, n_layers):
    meta, layers = make_entry(n_layers=n_layers, n_tokens=2, dim=4)
    other, other_layers = make_entry(seed=5)
    redis_store.put(meta, layers)
    redis_store.put(other, other_layers)
    redis_store.client.set(redis_store._hkey(meta.key), b"garbage")
    assert redis_store.get(meta.key) is None and redis_store.stats()["corruptions"] == 1
    assert _names(redis_store, meta.key) == set()
    assert redis_store.get(other.key) is not None


def test_delete_removes_blobs_whose_header_expired(redis_store):
    meta, layers = make_entry(n_layers=5)
    redis_store.put(meta, layers)
    redis_store.client.delete(redis_store._hkey(meta.key))
    assert len(_names(redis_store, meta.key)) == 5
    redis_store.delete(meta.key)
    assert _names(redis_store, meta.key) == set()


@pytest.mark.parametrize("literal", ["x*y", "x?y", "x[ab]y", "x\\y", "x]y"])
def test_glob_escape_matches_only_the_literal(redis_store, literal):
    from ragkv.store.redis_store import _glob_escape

    others = ["xzy", "xay", "xby", "x\\zy", "x*yz", "xabzy"]
    prefix = f"globtest-{uuid.uuid4().hex[:6]}:"
    for n in [literal, *others]:
        redis_store.client.set(prefix + n, b"1")
    try:
        found = {n.decode() for n in redis_store.client.scan_iter(match=_glob_escape(prefix + literal))}
        assert found == {prefix + literal}
    finally:
        redis_store.client.delete(*(prefix + n for n in [literal, *others]))
