"""Entries of another format version (a newer writer in a mixed fleet) are skipped, never deleted."""

import json
import logging
import struct
import zlib

import pytest
from store_testlib import future_version, layers_or_none, make_entry, open_redis

import ragkv.store as rs
from ragkv.store.disk import DiskStore
from ragkv.store.entry import CorruptEntry, decode_header, encode


def _other_checksum_algo(header: bytes) -> bytes:
    magic, ver, n, _ = struct.unpack_from("<8sIII", header)
    doc = json.loads(header[20 : 20 + n])
    doc["checksum"] = "xxh3-64-next"  # as long as "bsum64-crc32": the byte layout stays valid
    js = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    assert len(js) == n
    return struct.pack("<8sIII", magic, ver, n, zlib.crc32(js)) + js + header[20 + n :]


MUTATIONS = {"version": future_version, "checksum_algo": _other_checksum_algo}


@pytest.mark.parametrize("kind", list(MUTATIONS))
def test_codec_raises_unsupported_not_corrupt(kind):
    meta, layers = make_entry()
    enc = encode(meta, layers)
    with pytest.raises(rs.UnsupportedEntry, match="version 2" if kind == "version" else "xxh3-64-next") as ei:
        decode_header(MUTATIONS[kind](enc.header), meta.key)
    assert not isinstance(ei.value, CorruptEntry)


def test_a_damaged_version_field_is_corrupt_not_newer():
    """Prefix says 3, the intact JSON says 1: a bit flip (1 -> 3), not a newer writer."""
    meta, layers = make_entry()
    h = bytearray(encode(meta, layers).header)
    h[8] ^= 0x02
    with pytest.raises(CorruptEntry, match="version 3"):
        decode_header(bytes(h), meta.key)


def test_bad_magic_is_still_corrupt():
    meta, layers = make_entry()
    h = bytearray(encode(meta, layers).header)
    h[0] ^= 1
    with pytest.raises(CorruptEntry, match="magic"):
        decode_header(bytes(h), meta.key)


def _disk_store(tmp_path, request):
    return DiskStore(tmp_path / "kv", fsync=False)


def _write_header_disk(store, key, mutate):
    p = store.path(key)
    raw = p.read_bytes()
    n = 20 + struct.unpack_from("<I", raw, 12)[0]
    p.write_bytes(mutate(raw[:n]) + raw[n:])


def _snapshot_disk(store, key):
    return store.path(key).read_bytes()


def _redis_store(tmp_path, request, kind="redis"):
    return open_redis(request, kind, request.getfixturevalue("redis_ns"))


def _write_header_redis(store, key, mutate):
    store.client.set(store._hkey(key), mutate(store.client.get(store._hkey(key))))


def _snapshot_redis(store, key):
    names = sorted(store.client.scan_iter(match=f"*{{{key}}}*"))
    return [(n, store.client.get(n)) for n in names]


BACKENDS = {
    "disk": (_disk_store, _write_header_disk, _snapshot_disk),
    "redis": (_redis_store, _write_header_redis, _snapshot_redis),
    "cluster": (lambda t, r: _redis_store(t, r, "cluster"), _write_header_redis, _snapshot_redis),
}


@pytest.mark.parametrize("backend", ["disk", pytest.param("redis", marks=pytest.mark.redis),
                                     pytest.param("cluster", marks=pytest.mark.redis)])
@pytest.mark.parametrize("kind", list(MUTATIONS))
def test_store_skips_a_newer_entry_counts_it_and_leaves_it_alone(tmp_path, request, caplog, backend, kind):
    make, write_header, snapshot = BACKENDS[backend]
    store = make(tmp_path, request)
    meta, layers = make_entry()
    store.put(meta, layers)
    write_header(store, meta.key, MUTATIONS[kind])
    before = snapshot(store, meta.key)
    caplog.set_level(logging.DEBUG, logger="ragkv.store")
    for _ in range(2):
        assert store.get(meta.key) is None and store.get_meta(meta.key) is None
        assert store.get_layer(meta.key, 1) is None and layers_or_none(store, [meta.key], 1) == [None]
        assert store.get_encoded(meta.key) is None
    assert snapshot(store, meta.key) == before  # still there, byte for byte
    st = store.stats()
    assert st["unsupported"] == 10 and st["corruptions"] == 0 and st["misses"] == 10
    assert store.contains(meta.key) and list(store.keys()) == [meta.key]
    assert store.put(meta, layers) is False  # never overwritten by an older writer
    assert snapshot(store, meta.key) == before
    logged = [r for r in caplog.records if meta.key in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert "newer" in logged[0].getMessage() or "unsupported" in logged[0].getMessage()
