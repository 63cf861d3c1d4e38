"""Partial tier stacks: which tiers lack an entry, and copying it back into them."""

import os

import pytest
import torch
from store_testlib import make_entry

from ragkv.store.disk import DiskStore
from ragkv.store.entry import encode
from ragkv.store.memory import MemoryStore
from ragkv.store.tiered import TieredStore


@pytest.fixture
def disk(tmp_path):
    return DiskStore(tmp_path / "kv", fsync=False)


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: os.truncate(p, p.stat().st_size - 64),
        lambda p: os.truncate(p, 30),
        lambda p: p.write_bytes(b"garbage" * 10),
        lambda p: p.write_bytes(b""),
    ],
    ids=["short_by_64", "header_cut", "garbage", "empty"],
)
def test_disk_contains_does_not_count_a_damaged_file_and_put_repairs_it(disk, damage):
    meta, layers = make_entry()
    disk.put(meta, layers)
    damage(disk.path(meta.key))
    assert not disk.contains(meta.key)
    assert disk.missing_tiers(meta.key) == [disk]
    assert disk.put(meta, layers) is True  # rewritten, not skipped
    assert torch.equal(disk.get_layer(meta.key, 2).k, layers[2][0])


def test_missing_tiers_of_a_single_store(disk):
    meta, layers = make_entry()
    assert disk.missing_tiers(meta.key) == [disk]
    disk.put(meta, layers)
    assert disk.missing_tiers(meta.key) == []


def test_tiered_missing_tiers_and_fill(disk):
    mem = MemoryStore()
    tiered = TieredStore([mem, disk])
    meta, layers = make_entry()
    assert tiered.missing_tiers(meta.key) == [mem, disk]
    assert tiered.fill(meta.key) is False  # nowhere to copy from
    disk.put(meta, layers)
    assert tiered.missing_tiers(meta.key) == [mem]
    assert tiered.fill(meta.key) is True
    assert tiered.missing_tiers(meta.key) == []
    assert torch.equal(mem.get_layer(meta.key, 1).v, layers[1][1])
    assert tiered.fill(meta.key) is True  # nothing to do: every tier holds it


def test_fill_does_not_copy_a_corrupt_entry(disk):
    mem = MemoryStore()
    tiered = TieredStore([mem, disk])
    meta, layers = make_entry()
    disk.put(meta, layers)
    p = disk.path(meta.key)
    b = bytearray(p.read_bytes())
    b[-100] ^= 0x04  # a bit flip in the last layer: the header and size are fine
    p.write_bytes(bytes(b))
    assert tiered.missing_tiers(meta.key) == [mem]  # contains() is cheap: no checksum
    assert tiered.fill(meta.key) is False
    assert not mem.contains(meta.key) and not disk.contains(meta.key)  # found corrupt, removed
    assert disk.stats()["corruptions"] == 1


def test_fill_copies_into_every_lacking_tier_from_the_one_that_has_it(tmp_path):
    top, mid, low = MemoryStore(), DiskStore(tmp_path / "a", fsync=False), DiskStore(tmp_path / "b", fsync=False)
    tiered = TieredStore([top, mid, low])
    meta, layers = make_entry()
    mid.put(meta, layers)
    assert tiered.missing_tiers(meta.key) == [top, low]
    assert tiered.fill(meta.key) is True
    assert all(t.contains(meta.key) for t in (top, mid, low))


def test_tiered_put_encoded_writes_the_tiers_that_lack_the_key(disk):
    mem = MemoryStore()
    tiered = TieredStore([mem, disk])
    meta, layers = make_entry()
    disk.put(meta, layers)  # only the lower tier holds it
    assert tiered.put_encoded(meta.key, encode(meta, layers)) is True
    assert mem.contains(meta.key)
    assert torch.equal(mem.get_layer(meta.key, 0).k, layers[0][0])
    assert tiered.put_encoded(meta.key, encode(meta, layers)) is False  # every tier has it now
    assert disk.stats()["puts"] == 1


def test_tiered_put_writes_the_tiers_that_lack_the_key(disk):
    mem = MemoryStore()
    tiered = TieredStore([mem, disk])
    meta, layers = make_entry()
    mem.put(meta, layers)  # only the upper tier holds it
    assert tiered.put(meta, layers) is True and disk.contains(meta.key)


@pytest.mark.redis
def test_redis_restarted_empty_is_found_missing_and_refilled(tmp_path, redis_store):
    disk = DiskStore(tmp_path / "kv", fsync=False)
    tiered = TieredStore([disk, redis_store])
    entries = [make_entry(seed=s) for s in range(3)]
    for meta, layers in entries:
        tiered.put(meta, layers)
    redis_store.clear()  # what a restart without persistence leaves
    assert all(tiered.contains(m.key) for m, _ in entries)  # "any tier": precompute would skip all
    assert [tiered.missing_tiers(m.key) for m, _ in entries] == [[redis_store]] * 3
    assert all(tiered.fill(m.key) for m, _ in entries)
    for meta, layers in entries:
        assert torch.equal(redis_store.get_layer(meta.key, 2).v, layers[2][1])


@pytest.mark.redis
def test_redis_contains_is_false_when_a_blob_is_missing(redis_store):
    meta, layers = make_entry()
    redis_store.put(meta, layers)
    redis_store.client.delete(redis_store._bkey(meta.key, 1))  # e.g. evicted by maxmemory
    assert not redis_store.contains(meta.key)
    assert redis_store.put(meta, layers) is True
    assert torch.equal(redis_store.get_layer(meta.key, 1).k, layers[1][0])
