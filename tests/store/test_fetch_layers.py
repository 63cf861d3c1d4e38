"""``fetch_layers``: a layer per key, or a ``Miss`` that says why (absent, corrupt, unsupported, error)."""


import pytest
import torch
from redis_server import free_port
from store_testlib import future_version, layers_or_none, make_entry

import ragkv.store as rs
from ragkv.store.disk import DiskStore
from ragkv.store.entry import decode_header, header_nbytes
from ragkv.store.memory import MemoryStore
from ragkv.store.redis_store import RedisStore
from ragkv.store.tiered import TieredStore

ABSENT_KEY = "ragkv1-" + "0" * 64


def test_miss_is_a_small_value_type():
    assert rs.Miss("absent") == rs.Miss("absent") and rs.Miss("absent") != rs.Miss("error")
    assert {rs.Miss(r).reason for r in ("absent", "corrupt", "unsupported", "error")} == {
        "absent", "corrupt", "unsupported", "error"}
    with pytest.raises(ValueError, match="absent"):
        rs.Miss("gone")
    with pytest.raises(AttributeError):
        rs.Miss("absent").reason = "error"


def test_memory_fetch_layers(tmp_path):
    s = MemoryStore()
    meta, layers = make_entry()
    s.put(meta, layers)
    out = s.fetch_layers([meta.key, ABSENT_KEY, meta.key], 1)
    assert torch.equal(out[0].k, layers[1][0]) and torch.equal(out[2].v, layers[1][1])
    assert out[1] == rs.Miss("absent")
    assert layers_or_none(s, [meta.key, ABSENT_KEY], 1)[1] is None


def _three_entries(store, damage_corrupt, damage_newer):
    good, corrupt, newer = (make_entry(seed=s) for s in (1, 2, 3))
    for meta, layers in (good, corrupt, newer):
        store.put(meta, layers)
    damage_corrupt(corrupt[0].key)
    damage_newer(newer[0].key)
    return good, corrupt, newer


def _check_reasons(store, good, corrupt, newer):
    keys = [good[0].key, ABSENT_KEY, corrupt[0].key, newer[0].key]
    out = store.fetch_layers(keys, 1)
    assert isinstance(out[0], rs.StoredLayer) and torch.equal(out[0].k, good[1][1][0])
    assert out[1:] == [rs.Miss("absent"), rs.Miss("corrupt"), rs.Miss("unsupported")]
    st = store.stats()
    assert (st["hits"], st["misses"], st["corruptions"], st["unsupported"], st["errors"]) == (1, 3, 1, 1, 0)
    assert not store.contains(corrupt[0].key) and store.contains(newer[0].key)
    again = layers_or_none(store, keys, 1)
    assert torch.equal(again[0].v, good[1][1][1]) and again[1:] == [None, None, None]


def _flip_disk_layer(store, key, i):
    p = store.path(key)
    data = bytearray(p.read_bytes())
    _, layout = decode_header(bytes(data[: header_nbytes(bytes(data[:64]))]), key)
    data[layout.data_offset + layout.layers[i].offset + 16] ^= 0x04
    p.write_bytes(bytes(data))


def test_disk_fetch_layers_reasons(tmp_path):
    s = DiskStore(tmp_path / "kv", fsync=False)

    def newer(key):
        p = s.path(key)
        p.write_bytes(future_version(p.read_bytes()))

    good, corrupt, new = _three_entries(s, lambda k: _flip_disk_layer(s, k, 1), newer)
    _check_reasons(s, good, corrupt, new)


@pytest.mark.redis
def test_redis_fetch_layers_reasons_in_one_round_trip(redis_store):
    s = redis_store

    def flip(key):
        name = s._bkey(key, 1)
        b = bytearray(s.client.get(name))
        b[100] ^= 0x10
        s.client.set(name, bytes(b))

    def newer(key):
        s.client.set(s._hkey(key), future_version(s.client.get(s._hkey(key))))

    good, corrupt, new = _three_entries(s, flip, newer)
    executed = []
    real_pipeline = s.client.pipeline

    def counting_pipeline(*a, **kw):
        p = real_pipeline(*a, **kw)
        real_execute = p.execute
        p.execute = lambda *ea, **ekw: executed.append(len(p)) or real_execute(*ea, **ekw)
        return p

    s.client.pipeline = counting_pipeline
    out = s.fetch_layers([good[0].key, ABSENT_KEY, corrupt[0].key, new[0].key], 1)
    # header + blob of each key: one pipeline (one round trip; per node on a cluster, where the DEL
    # of the corrupt entry's keys, all in one slot, is one more pipeline of one command)
    assert executed == ([8, 1] if s.cluster else [8])
    assert [type(x).__name__ for x in out] == ["StoredLayer", "Miss", "Miss", "Miss"]
    executed.clear()
    assert layers_or_none(s, [good[0].key, ABSENT_KEY], 1)[1] is None and executed == [4]
    s.client.pipeline = real_pipeline
    s._counts.clear()
    s.put(*corrupt)  # removed as corrupt above: damage it again
    flip(corrupt[0].key)
    _check_reasons(s, good, corrupt, new)


def test_redis_down_is_an_error_miss():
    s = RedisStore(f"redis://127.0.0.1:{free_port()}/0", namespace="down")
    assert s.fetch_layers([ABSENT_KEY, ABSENT_KEY], 0) == [rs.Miss("error")] * 2
    assert s.stats()["errors"] == 2


def test_tiered_fetch_layers_takes_the_first_tier_that_has_it_and_reports_errors_first(tmp_path):
    mem, disk = MemoryStore(), DiskStore(tmp_path / "kv", fsync=False)
    down = RedisStore(f"redis://127.0.0.1:{free_port()}/0", namespace="down")
    tiered = TieredStore([mem, disk, down])
    a, b, c = (make_entry(seed=s) for s in (1, 2, 3))
    mem.put(*a)
    disk.put(*b)
    disk.put(*c)
    _flip_disk_layer(disk, c[0].key, 2)
    out = tiered.fetch_layers([a[0].key, b[0].key, ABSENT_KEY, c[0].key], 2)
    assert torch.equal(out[0].k, a[1][2][0]) and torch.equal(out[1].k, b[1][2][0])
    assert out[2:] == [rs.Miss("error"), rs.Miss("error")]  # redis could not be asked
    up = TieredStore([mem, disk])
    disk.put(*c)
    _flip_disk_layer(disk, c[0].key, 2)
    assert up.fetch_layers([ABSENT_KEY, c[0].key], 2) == [rs.Miss("absent"), rs.Miss("corrupt")]
    assert layers_or_none(up, [ABSENT_KEY, b[0].key], 2)[0] is None
    st = up.stats()
    assert st["hits"] == 1 and st["misses"] == 3


@pytest.mark.parametrize("bad", [-1, 3, "0"])
def test_fetch_layers_bad_index_is_an_index_error(any_store, bad):
    meta, layers = make_entry()
    any_store.put(meta, layers)
    with pytest.raises(IndexError):
        any_store.fetch_layers([meta.key], bad)
    assert any_store.contains(meta.key)
