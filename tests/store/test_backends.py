import errno
import json
import multiprocessing as mp
import os
import pickle
import struct
import subprocess
import sys
import zlib

import pytest
import torch
from store_testlib import layers_or_none, make_entry, open_redis

from ragkv.store import StoreFull, open_store
from ragkv.store.disk import DiskStore
from ragkv.store.entry import encode
from ragkv.store.memory import MemoryStore


@pytest.fixture(params=["memory", "disk", "redis", "cluster"])
def store(request, tmp_path, redis_ns):
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "disk":
        s = DiskStore(tmp_path / "kv", fsync=False)
    else:
        s = open_redis(request, request.param, redis_ns)
    yield s
    s.close()


def assert_within_storage_error(got, ref, storage):
    """Each tensor against its own magnitude and the storage dtype's known error bound: exact for
    the model dtype; round-to-nearest relative error (2^-11 fp16, 2^-8 bf16) per element; int8
    absmax: half a step, scale/2 <= max|ref|/254, per element (the scale's row or channel max is at
    most the tensor's)."""
    err = (got - ref).abs()
    if storage == "float32":
        assert torch.equal(got, ref)
    elif storage in ("float16", "bfloat16"):
        u = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[storage]
        assert (err <= u * ref.abs()).all(), f"{int((err > u * ref.abs()).sum())} elements off"
    else:
        bound = ref.abs().max().item() / 254 * (1 + 1e-5)
        assert err.max().item() <= bound, (err.max().item(), bound)


@pytest.mark.parametrize("storage,axis", [("float32", None), ("bfloat16", None), ("int8", "auto")])
def test_put_get_roundtrip(store, storage, axis):
    meta, layers = make_entry(storage=storage, axis=axis)
    assert store.get(meta.key) is None and not store.contains(meta.key)
    assert store.put(meta, layers) is True
    assert store.put(meta, layers) is False  # idempotent
    assert store.contains(meta.key) and list(store.keys()) == [meta.key]
    assert store.get_meta(meta.key) == meta
    got = store.get(meta.key)
    assert got.meta == meta and len(got.layers) == meta.num_layers
    for (k, v), (gk, gv) in zip(layers, got.layers):
        assert gk.dtype == gv.dtype == torch.float32 and gk.shape == k.shape and gv.shape == v.shape
        assert_within_storage_error(gk, k, storage)
        assert_within_storage_error(gv, v, storage)
    lay = store.get_layer(meta.key, 2)
    assert lay.k.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[storage]
    # tensors handed out are the caller's: writing them does not change the store
    got.layers[0][0].zero_()
    assert store.get(meta.key).layers[0][0].abs().sum() > 0
    st = store.stats()
    assert st["puts"] == 1 and st["put_skipped"] >= 1 and st["hits"] >= 3 and st["misses"] >= 1
    assert store.delete(meta.key) and store.get(meta.key) is None
    store.put(meta, layers)
    store.clear()
    assert list(store.keys()) == []


def test_put_encoded_rejects_entry_for_other_key(store):
    meta, layers = make_entry()
    other, _ = make_entry(seed=1)
    with pytest.raises(ValueError, match="bound to key"):
        store.put_encoded(other.key, encode(meta, layers))


# ---- disk: persistence, corruption, concurrency, eviction, ENOSPC ---------------------------------


def test_disk_reopened_by_new_process_finds_entries(tmp_path):
    s = DiskStore(tmp_path / "kv", fsync=False)
    entries = [make_entry(seed=i) for i in range(3)]
    for meta, layers in entries:
        s.put(meta, layers)
    s.close()
    os.unlink(tmp_path / "kv" / "index.json")  # lost index: rebuilt by scanning
    code = (
        "import sys, torch; from ragkv.store import open_store;"
        f"s = open_store('disk://{tmp_path / 'kv'}');"
        "keys = sorted(s.keys()); c = s.get(keys[0]);"
        "print(len(keys), s.stats()['entries'], c.meta.num_layers, float(c.layers[1][1].sum()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    key0 = sorted(m.key for m, _ in entries)[0]
    v = next(layers for m, layers in entries if m.key == key0)[1][1]
    assert out[:3] == ["3", "3", "3"] and abs(float(out[3]) - float(v.sum())) < 1e-3


def _flip(path, pos):
    b = bytearray(path.read_bytes())
    b[pos] ^= 0x04
    path.write_bytes(bytes(b))


def _rewrite_header(path, mutate):
    raw = path.read_bytes()
    magic, ver, n, _ = struct.unpack_from("<8sIII", raw)
    doc = json.loads(raw[20 : 20 + n])
    mutate(doc)
    js = json.dumps(doc, separators=(",", ":")).encode().ljust(n)  # same length: offsets stay valid
    assert len(js) == n
    path.write_bytes(struct.pack("<8sIII", magic, ver, n, zlib.crc32(js)) + js + raw[20 + n :])


CORRUPTIONS = {
    "bitflip_layer": lambda p, other: _flip(p, p.stat().st_size - 100),
    "bitflip_header": lambda p, other: _flip(p, 60),
    "truncated": lambda p, other: os.truncate(p, p.stat().st_size - 64),
    "wrong_shape_in_header": lambda p, other: _rewrite_header(
        p, lambda d: d["layers"][0]["tensors"]["k"].__setitem__("shape", [2, 16, 4])
    ),
    "checksum_mismatch": lambda p, other: _rewrite_header(
        p, lambda d: d["layers"][2].__setitem__("checksum", d["layers"][2]["checksum"] ^ 1)
    ),
    "header_of_other_key": lambda p, other: p.write_bytes(other.read_bytes()),
    "pickle_instead_of_entry": lambda p, other: p.write_bytes(_evil_pickle(p)),
}


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_pickle(p) -> bytes:
    return pickle.dumps(_Evil(str(p.parent.parent.parent.parent / "PWNED")))


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_disk_corruption_is_a_counted_miss(tmp_path, kind):
    s = DiskStore(tmp_path / "kv", fsync=False)
    meta, layers = make_entry()
    other, other_layers = make_entry(seed=7)
    s.put(meta, layers)
    s.put(other, other_layers)
    CORRUPTIONS[kind](s.path(meta.key), s.path(other.key))
    read = [s.get_layer(meta.key, 2), s.get(meta.key), s.get_meta(meta.key)]
    assert read == [None, None, None]
    st = s.stats()
    assert st["corruptions"] == 1 and not s.contains(meta.key)  # removed on first detection
    assert s.get(other.key) is not None  # the neighbour is untouched
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.redis
def test_pickle_payload_never_executes(tmp_path, redis_server, redis_ns):
    """A pickle posing as header or blob, in disk and Redis, is rejected; nothing runs."""
    from ragkv.store.redis_store import RedisStore

    marker = tmp_path / "PWNED"
    evil = pickle.dumps(_Evil(str(marker)))
    meta, layers = make_entry()
    enc = encode(meta, layers)
    r = RedisStore(redis_server.url, namespace=redis_ns)
    try:
        r.client.set(r._hkey(meta.key), evil)
        assert r.get(meta.key) is None and r.get_meta(meta.key) is None
        r.put(meta, layers)
        r.client.set(r._bkey(meta.key, 1), evil.ljust(len(enc.blobs[1]), b"."))
        assert r.get(meta.key) is None and r.get_layer(meta.key, 1) is None
        assert r.stats()["corruptions"] >= 2
    finally:
        r.clear()
    d = DiskStore(tmp_path / "kv", fsync=False)
    d.path(meta.key).parent.mkdir(parents=True, exist_ok=True)
    d.path(meta.key).write_bytes(evil)
    assert d.get(meta.key) is None and d.stats()["corruptions"] == 1
    assert not marker.exists()


def _writer(root, seed, barrier):
    meta, layers = make_entry(seed=seed, n_layers=8, n_tokens=256, dim=64)
    s = open_store(root)
    barrier.wait()
    for _ in range(5):
        s.put(meta, layers)
    s.close()


def _concurrent(root):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_writer, args=(root, 3, barrier)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0


def test_disk_concurrent_writers_leave_one_complete_entry(tmp_path):
    root = f"disk://{tmp_path / 'kv'}?fsync=0"
    _concurrent(root)
    s = open_store(root)
    meta, layers = make_entry(seed=3, n_layers=8, n_tokens=256, dim=64)
    assert list(s.keys()) == [meta.key]
    got = s.get(meta.key)
    assert all(torch.equal(a, b[0]) for (a, _), b in zip(got.layers, layers))
    assert not [n for n in os.listdir(s.path(meta.key).parent) if n.startswith(".tmp")]


@pytest.mark.redis
def test_redis_concurrent_writers_leave_one_complete_entry(redis_server, redis_ns):
    root = f"{redis_server.url}?namespace={redis_ns}"
    _concurrent(root)
    s = open_store(root)
    meta, layers = make_entry(seed=3, n_layers=8, n_tokens=256, dim=64)
    got = s.get(meta.key)
    assert got is not None and all(torch.equal(a, b[0]) for (a, _), b in zip(got.layers, layers))
    assert list(s.keys()) == [meta.key]
    s.clear()


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_lru_eviction_within_budget_and_pins_survive(tmp_path, kind):
    entries = [make_entry(seed=i, n_tokens=64) for i in range(6)]
    size = len(encode(*entries[0]).header) + sum(len(b) for b in encode(*entries[0]).blobs) + 64
    budget = int(size * 3.5)
    s = MemoryStore(max_bytes=budget) if kind == "memory" else DiskStore(tmp_path / "kv", budget, fsync=False)
    pinned = entries[0][0].key
    with s.pin([pinned]):
        for i, (m, layers) in enumerate(entries):
            s.put(m, layers)
            if i == 2:
                s.get(entries[1][0].key)  # 1 becomes more recent than 2
                if kind == "disk":
                    os.utime(s.path(entries[1][0].key))
        present = {m.key for m, _ in entries if s.contains(m.key)}
        assert pinned in present
        assert s.stats()["bytes"] <= budget and s.stats()["evictions"] >= 2
        assert entries[5][0].key in present and entries[2][0].key not in present
    assert not s.is_pinned(pinned)


def test_disk_full_raises_storefull_and_leaves_nothing(tmp_path, monkeypatch):
    import ragkv.store.disk as disk

    s = DiskStore(tmp_path / "kv", fsync=False)
    meta, layers = make_entry()
    real = disk._write_all
    calls = []

    def write_then_fail(fd, data):
        calls.append(1)
        if len(calls) == 3:  # header and padding written, then the disk fills up
            real(fd, bytes(data)[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(disk, "_write_all", write_then_fail)
    with pytest.raises(StoreFull, match=str(tmp_path)):
        s.put(meta, layers)
    assert not s.contains(meta.key) and s.get(meta.key) is None
    assert [p for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.parent.name != "kv"] == []


@pytest.mark.redis
def test_redis_stats_count_entries_and_bytes(redis_store):
    assert redis_store.stats()["entries"] == 0 and redis_store.stats()["bytes"] == 0
    metas = []
    for seed in (1, 2):
        meta, layers = make_entry(seed=seed)
        assert redis_store.put(meta, layers)
        metas.append(meta)
    st = redis_store.stats()
    enc_bytes = sum(len(e.header) + sum(len(b) for b in e.blobs)
                    for e in (redis_store.get_encoded(m.key) for m in metas))
    assert st["entries"] == 2 and st["bytes"] == enc_bytes


BAD_KEYS = ["../x", "/etc/passwd", "a/../../b", "..", ".", ".hidden", "-rf", "x\x00y", "k" * 201, "",
            "a b", "ok\n", "a*", "{k}", "C:\\x"]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_disk_refuses_keys_outside_the_alphabet(tmp_path, key):
    s = DiskStore(tmp_path / "kv", fsync=False)
    meta, layers = make_entry()
    s.put(meta, layers)
    enc = encode(meta, layers)
    for op in (lambda: s.contains(key), lambda: s.get(key), lambda: s.get_meta(key), lambda: s.delete(key),
               lambda: s.get_layer(key, 0), lambda: layers_or_none(s, [meta.key, key], 0),
               lambda: s.put_encoded(key, enc), lambda: s.path(key)):
        with pytest.raises(ValueError, match="invalid store key"):
            op()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv"]  # nothing written outside the root
    assert list(s.keys()) == [meta.key] and s.get(meta.key) is not None
