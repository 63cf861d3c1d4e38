import logging
import threading
import time

import pytest
import torch
from redis_server import RedisServer
from store_testlib import layers_or_none, make_entry

from ragkv.store import open_store
from ragkv.store.memory import MemoryStore
from ragkv.store.redis_store import RedisStore
from ragkv.store.tiered import TieredStore

pytestmark = pytest.mark.redis


def test_redis_two_phase_reader_never_sees_partial_entry(redis_server, redis_ns):
    writer = RedisStore(redis_server.url, namespace=redis_ns)
    reader = RedisStore(redis_server.url, namespace=redis_ns)
    entries = [make_entry(seed=i, n_layers=12, n_tokens=128, dim=64) for i in range(6)]
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            for m, layers in entries:
                got = reader.get(m.key)
                if got is not None:
                    seen.append(all(torch.equal(a, b[0]) for (a, _), b in zip(got.layers, layers)))
                layer = reader.get_layer(m.key, m.num_layers - 1)  # None only if absent
                if layer is not None:
                    seen.append(torch.equal(layer.k, layers[-1][0]))

    t = threading.Thread(target=poll)
    t.start()
    for _ in range(3):
        for m, layers in entries:
            writer.put(m, layers)
        for m, _ in entries:
            writer.delete(m.key)
    for m, layers in entries:
        writer.put(m, layers)
    time.sleep(0.05)
    stop.set()
    t.join()
    assert seen and all(seen)
    assert reader.stats()["corruptions"] == 0
    writer.clear()


def test_redis_ttl_applies_to_every_key(redis_server, redis_ns):
    s = open_store(f"{redis_server.url}?ttl=100&namespace={redis_ns}")
    meta, layers = make_entry()
    s.put(meta, layers)
    names = list(s.client.scan_iter(match=f"ragkv:{redis_ns}/*"))
    assert len(names) == meta.num_layers + 1
    assert all(0 < s.client.ttl(n) <= 100 for n in names)
    assert all(b"{" + meta.key.encode() + b"}" in n for n in names)  # one hash slot
    s.clear()


def test_tiered_survives_redis_death_warns_once_and_reconnects(tmp_path, caplog):
    srv = RedisServer().start()
    try:
        url = f"memory,disk://{tmp_path / 'kv'}?fsync=0,{srv.url}?namespace=t:"
        store = open_store(url)
        assert isinstance(store, TieredStore)
        redis_tier = store.tiers[2]
        redis_tier._backoff0 = 0.2
        a, la = make_entry(seed=1)
        store.put(a, la)
        assert redis_tier.contains(a.key)
        srv.stop()
        caplog.set_level(logging.WARNING, logger="ragkv.store")
        b, lb = make_entry(seed=2)
        t0 = time.monotonic()
        for _ in range(5):
            store.put(b, lb)
            assert store.get(b.key) is not None and store.get(a.key) is not None
            store.tiers[0].clear()  # force reads down the tiers
            assert store.get_layer(b.key, 1) is not None
        assert time.monotonic() - t0 < 10
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down) == 1
        assert store.stats()["errors"] >= 1
        srv.start()  # same port
        time.sleep(0.5)  # past the back-off
        deadline = time.monotonic() + 10
        c, lc = make_entry(seed=3)
        while not redis_tier.contains(c.key) and time.monotonic() < deadline:
            store.put(c, lc)
            time.sleep(0.2)
        assert redis_tier.contains(c.key)
        assert any("reachable again" in r.getMessage() for r in caplog.records)
        store.close()
    finally:
        srv.stop()


def test_tiered_promotes_hits_upward_and_pins_everywhere(tmp_path, redis_server, redis_ns):
    mem = MemoryStore()
    store = open_store(f"disk://{tmp_path / 'kv'}?fsync=0,{redis_server.url}?namespace={redis_ns}")
    tiered = TieredStore([mem, *store.tiers], promote_on_lookup=False)
    meta, layers = make_entry()
    tiered.tiers[2].put(meta, layers)  # only in redis
    assert not mem.contains(meta.key)
    assert tiered.get_meta(meta.key) == meta and not mem.contains(meta.key)  # lookup promotion off
    got = tiered.get(meta.key)
    assert torch.equal(got.layers[0][0], layers[0][0])
    assert mem.contains(meta.key) and tiered.tiers[1].contains(meta.key)
    with tiered.pin([meta.key]):
        assert all(t.is_pinned(meta.key) for t in tiered.tiers)
    st = tiered.stats()
    assert len(st["tiers"]) == 3 and st["promotions"] == 2 and st["hits"] >= 2
    tiered.tiers[2].clear()


def test_lookup_of_a_lower_tier_hit_promotes_in_the_background(tmp_path, redis_server, redis_ns):
    redis_tier = open_store(f"{redis_server.url}?namespace={redis_ns}")
    mem, disk = MemoryStore(), open_store(f"disk://{tmp_path / 'kv'}?fsync=0")
    tiered = TieredStore([mem, disk, redis_tier])
    meta, layers = make_entry()
    redis_tier.put(meta, layers)
    assert tiered.get_meta(meta.key) == meta  # what the read path does first
    tiered.wait_promotions()
    assert mem.contains(meta.key) and disk.contains(meta.key)
    layer = mem.get_layer(meta.key, 1)
    assert torch.equal(layer.k, layers[1][0]) and torch.equal(layer.v, layers[1][1])
    tiered.close()
    redis_tier.close()


@pytest.mark.parametrize(
    "uri,match",
    [
        ("ftp://x", "valid schemes"),
        ("memory://?max_byte=1G", "valid options"),
        ("disk:///tmp/x?max_bytes=lots", "bad size"),
        ("redis://localhost?ttl=soon", "ttl"),
        ("", "valid schemes"),
    ],
)
def test_bad_uris_name_the_valid_ones(uri, match):
    with pytest.raises(ValueError, match=match):
        open_store(uri)


def test_uri_forms(tmp_path):
    assert open_store("memory").uri == "memory://?max_bytes=1073741824"
    assert open_store("memory://?max_bytes=2M").max_bytes == 2 << 20
    d = open_store(f"disk://{tmp_path}?max_bytes=1G&fsync=0")
    assert d.max_bytes == 1 << 30 and not d.fsync
    r = open_store("rediss://:secret@example.invalid:6380/2?ttl=60&namespace=a:")
    assert r.ttl == 60 and "secret" not in r.uri and r.client.connection_pool.connection_kwargs["db"] == 2


@pytest.mark.redis
def test_redis_get_layers_batches_and_keeps_miss_and_corruption_semantics(redis_store):
    entries = [make_entry(seed=s) for s in (1, 2, 3)]
    for meta, layers in entries[:2]:
        redis_store.put(meta, layers)
    keys = [m.key for m, _ in entries]
    got = layers_or_none(redis_store, keys, 1)
    for (_meta, layers), g in zip(entries[:2], got[:2]):
        assert torch.equal(g.k, layers[1][0]) and torch.equal(g.v, layers[1][1])
    assert got[2] is None  # never stored: a miss
    # a flipped byte in one entry's layer blob: a miss for that entry only, counted and removed
    bkey = redis_store._bkey(keys[0], 1)
    blob = bytearray(redis_store.client.get(bkey))
    blob[100] ^= 0x10
    redis_store.client.set(bkey, bytes(blob))
    got = layers_or_none(redis_store, keys, 1)
    assert got[0] is None and got[1] is not None
    assert redis_store.stats()["corruptions"] == 1 and not redis_store.contains(keys[0])


@pytest.mark.redis
def test_redis_get_layers_on_a_dead_server_is_all_misses():
    from ragkv.store.redis_store import RedisStore

    srv = RedisServer().start()
    store = RedisStore(srv.url, namespace="dead:", socket_timeout=1.0)
    meta, layers = make_entry()
    store.put(meta, layers)
    srv.stop()
    assert layers_or_none(store, [meta.key, meta.key + "x"], 0) == [None, None]
    assert store.stats()["errors"] >= 2
    store.close()
