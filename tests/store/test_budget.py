"""Byte budgets: a typo in a size never evicts what other people stored."""

import logging

import pytest
from store_testlib import make_entry

from ragkv.store import StoreFull, open_store
from ragkv.store.disk import DiskStore
from ragkv.store.entry import encode
from ragkv.store.memory import MemoryStore
from ragkv.store.values import size_from_str


def _fill(store, n, **kw) -> list[str]:
    keys = []
    for seed in range(n):
        meta, layers = make_entry(seed=seed, **kw)
        assert store.put(meta, layers)
        keys.append(meta.key)
    return keys


@pytest.mark.parametrize("s", ["-1", "-5G", "-0.5M", -1])
def test_size_from_str_refuses_negative_sizes(s):
    with pytest.raises(ValueError, match="negative"):
        size_from_str(s)


def test_size_from_str_units():
    assert size_from_str("10G") == 10 << 30 and size_from_str("1.5M") == 3 << 19
    assert size_from_str("1GiB") == 1 << 30 and size_from_str("none") is None and size_from_str("0") == 0


@pytest.mark.parametrize("kind", ["memory", "disk"])
@pytest.mark.parametrize("size", ["10", "-1", "0", "1023K"])
def test_store_uris_refuse_budgets_below_one_mib(tmp_path, kind, size):
    uri = "memory://" if kind == "memory" else f"disk://{tmp_path / 'kv'}"
    match = "must not be negative" if size.startswith("-") else rf"max_bytes={size} is smaller than one entry"
    with pytest.raises(ValueError, match=match):
        open_store(f"{uri}?max_bytes={size}")
    if size == "10":
        with pytest.raises(ValueError, match="did you mean 10G"):
            open_store(f"{uri}?max_bytes=10")
    assert not (tmp_path / "kv").exists()  # refused before anything was created


@pytest.mark.parametrize("cls", ["memory", "disk"])
def test_constructors_refuse_negative_budgets(tmp_path, cls):
    with pytest.raises(ValueError, match="max_bytes"):
        MemoryStore(max_bytes=-1) if cls == "memory" else DiskStore(tmp_path / "kv", max_bytes=-1)


def test_disk_put_larger_than_the_budget_is_refused_and_evicts_nothing(tmp_path):
    small = encode(*make_entry()).nbytes + 64
    s = DiskStore(tmp_path / "kv", max_bytes=4 * small, fsync=False)
    keys = _fill(s, 3)
    big, big_layers = make_entry(seed=99, n_tokens=256)
    with pytest.raises(StoreFull, match=rf"{big.key}.* \d+ bytes.*max_bytes={4 * small}"):
        s.put(big, big_layers)
    assert all(s.contains(k) for k in keys) and s.stats()["evictions"] == 0
    assert not s.contains(big.key)
    assert [p for p in (tmp_path / "kv" / "objects").rglob(".tmp-*")] == []


def test_memory_put_larger_than_the_budget_evicts_nothing():
    small = encode(*make_entry()).nbytes + 64
    s = MemoryStore(max_bytes=4 * small)
    keys = _fill(s, 3)
    big, big_layers = make_entry(seed=99, n_tokens=256)
    assert s.put(big, big_layers) is False
    assert all(s.contains(k) for k in keys) and s.stats()["evictions"] == 0


def test_opening_a_disk_store_over_its_budget_warns(tmp_path, caplog):
    s = DiskStore(tmp_path / "kv", max_bytes=None, fsync=False)
    _fill(s, 3)
    total = s.stats()["bytes"]
    s.close()
    caplog.set_level(logging.WARNING, logger="ragkv.store")
    DiskStore(tmp_path / "kv", max_bytes=total // 2, fsync=False).close()
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"{total} bytes" in m and f"max_bytes={total // 2}" in m and "first write will evict" in m
               for m in msgs), msgs
    caplog.clear()
    DiskStore(tmp_path / "kv", max_bytes=total, fsync=False).close()
    assert not caplog.records
