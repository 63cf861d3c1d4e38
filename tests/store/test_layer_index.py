"""A caller's bad layer index is the caller's error (IndexError), never evidence against the entry."""

import numpy as np
import pytest
import torch
from store_testlib import layers_or_none, make_entry

from ragkv.store.disk import DiskStore
from ragkv.store.entry import decode_header, decode_layer, encode
from ragkv.store.memory import MemoryStore
from ragkv.store.tiered import TieredStore

# entries of these tests have 3 layers
BAD_INDICES = [-1, 3, 7, 1.0, "1", None, True]


def _match(bad) -> str:
    if isinstance(bad, int) and not isinstance(bad, bool):
        return rf"layer index {bad}\b.*\b3 layers"
    return "layer index must be an int"


def _put_two(store):
    a, la = make_entry(n_layers=3, seed=1)
    b, lb = make_entry(n_layers=3, seed=2)
    assert store.put(a, la) and store.put(b, lb)
    return (a, la), (b, lb)


@pytest.mark.parametrize("bad", BAD_INDICES)
def test_bad_layer_index_raises_and_removes_nothing(any_store, bad):
    (a, la), (b, _lb) = _put_two(any_store)
    with pytest.raises(IndexError, match=_match(bad)):
        any_store.get_layer(a.key, bad)
    with pytest.raises(IndexError, match=_match(bad)):
        layers_or_none(any_store, [a.key, b.key], bad)
    assert any_store.contains(a.key) and any_store.contains(b.key)
    assert torch.equal(any_store.get_layer(a.key, 2).k, la[2][0])
    assert any_store.get(b.key) is not None
    assert any_store.stats()["corruptions"] == 0


def test_numpy_integer_index_is_accepted(any_store):
    (a, la), _ = _put_two(any_store)
    assert torch.equal(any_store.get_layer(a.key, np.int64(1)).v, la[1][1])


def test_bad_index_of_an_entry_held_by_a_lower_tier_only(tmp_path):
    disk = DiskStore(tmp_path / "kv", fsync=False)
    tiered = TieredStore([MemoryStore(), disk])
    (a, _), _ = _put_two(disk)
    for bad in (-1, 3):
        with pytest.raises(IndexError, match=_match(bad)):
            tiered.get_layer(a.key, bad)
        with pytest.raises(IndexError, match=_match(bad)):
            layers_or_none(tiered, [a.key], bad)
    assert disk.contains(a.key) and disk.stats()["corruptions"] == 0


def test_index_past_the_end_of_an_absent_entry_is_a_plain_miss(any_store):
    assert any_store.get_layer("ragkv1-" + "0" * 64, 7) is None


def test_decode_layer_out_of_range_is_an_index_error():
    meta, layers = make_entry(n_layers=3)
    enc = encode(meta, layers)
    _, lay = decode_header(enc.header, meta.key)
    for bad in (-1, 3):
        with pytest.raises(IndexError, match=_match(bad)):
            decode_layer(lay, bad, enc.blobs[0])


@pytest.mark.redis
def test_redis_get_layers_past_the_end_keeps_every_entry_of_the_batch(redis_store):
    (a, _), (b, _) = _put_two(redis_store)
    with pytest.raises(IndexError, match=_match(7)):
        layers_or_none(redis_store, [a.key, b.key], 7)
    assert redis_store.contains(a.key) and redis_store.contains(b.key)
    assert redis_store.stats()["corruptions"] == 0
