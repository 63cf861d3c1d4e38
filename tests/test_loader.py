"""Layer-wise pipelined loading (ragkv.loader): pipelined == sequential, failures end in recompute,
prefetch stays within its byte bound, and the loader thread never outlives a request."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from blend_testlib import TEMPLATE, make_prompt
from redis_server import start_or_skip

from ragkv import models
from ragkv.blend import BlendConfig, BlendEngine, DeviationSelector
from ragkv.blend import cache as cache_mod
from ragkv.loader import LayerLoader, Miss, SequentialLoader
from ragkv.policy import StorageFormat
from ragkv.store.disk import DiskStore
from ragkv.store.entry import decode_header, header_nbytes
from ragkv.store.memory import MemoryStore

SIZES = (13, 29, 7, 21)  # four chunks


def engine(model, store, pipelined: bool, storage_dtype=None) -> BlendEngine:
    config = BlendConfig(pipelined=pipelined, selector=DeviationSelector(check_layers=(1,)))
    return BlendEngine(model, None, store, config, template=TEMPLATE, storage=StorageFormat(storage_dtype))


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ragkv-layer-loader" and t.is_alive()]


class FlakyStore:
    """Delegates to a store; ``get_layer(key, fail_layer)`` of ``fail_key`` raises or returns None."""

    def __init__(self, inner, fail_key: str, fail_layer: int, mode: str):
        self.inner, self.fail_key, self.fail_layer, self.mode = inner, fail_key, fail_layer, mode

    def get_layer(self, key, i):
        if key == self.fail_key and i == self.fail_layer:
            if self.mode == "raise":
                raise RuntimeError("injected read failure")
            return None
        return self.inner.get_layer(key, i)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def healthy_run(model, prompt, store):
    eng = engine(model, store, pipelined=False)
    eng.prefill_prompt(prompt)  # computes and stores every chunk
    return eng.prefill_prompt(prompt)


# ---------------------------------------------------------------- pipelined == sequential


@pytest.mark.parametrize("backend", ["memory", "disk"])
@pytest.mark.parametrize("storage_dtype", [None, "int8"])
def test_pipelined_equals_sequential(backend, storage_dtype, tmp_path):
    model = models.tiny_model("llama")
    store = MemoryStore() if backend == "memory" else DiskStore(tmp_path / "kv", fsync=False)
    prompt = make_prompt(seed=1, sizes=SIZES)
    engine(model, store, False, storage_dtype=storage_dtype).prefill_prompt(prompt)  # fill the store
    seq = engine(model, store, False, storage_dtype=storage_dtype).prefill_prompt(prompt)
    pipe = engine(model, store, True, storage_dtype=storage_dtype).prefill_prompt(prompt)
    assert seq.stats.hits == pipe.stats.hits == 4
    assert pipe.stats.corrupt == pipe.stats.vanished == pipe.stats.store_errors == pipe.stats.timeouts == 0
    assert pipe.stats.t_load_io > 0
    for li in range(model.config.num_hidden_layers):
        assert torch.equal(seq.cache.layers[li].keys, pipe.cache.layers[li].keys), li
        assert torch.equal(seq.cache.layers[li].values, pipe.cache.layers[li].values), li
    assert torch.equal(seq.logits, pipe.logits)
    eng = engine(model, store, True)
    out_seq = eng.adapter.generate(seq.input_ids, seq.cache, max_new_tokens=8)
    out_pipe = eng.adapter.generate(pipe.input_ids, pipe.cache, max_new_tokens=8)
    assert out_seq.tolist() == out_pipe.tolist()
    assert not loader_threads()


# ---------------------------------------------------------------- failures end in recompute


@pytest.mark.parametrize("mode", ["raise", "none"])
def test_failing_layer_is_recomputed(mode):
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=2, sizes=SIZES)
    store = MemoryStore()
    ref = healthy_run(model, prompt, store)
    bad_key = engine(model, store, True).keys.chunk_key(prompt.chunk_ids[1])
    res = engine(model, FlakyStore(store, bad_key, 2, mode), True).prefill_prompt(prompt)
    if mode == "raise":  # an outage, counted as such
        assert res.stats.store_errors == 1 and res.stats.vanished == 0
    else:  # gone since the lookup
        assert res.stats.vanished == 1 and res.stats.store_errors == 0
    assert res.stats.corrupt == 0 and res.stats.timeouts == 0
    torch.testing.assert_close(res.logits, ref.logits, atol=1e-4, rtol=0)


def _corrupt_layer_on_disk(store: DiskStore, key: str, li: int) -> None:
    p = store.path(key)
    data = bytearray(p.read_bytes())
    _, layout = decode_header(bytes(data[: header_nbytes(bytes(data[:64]))]), key)
    off = layout.data_offset + layout.layers[li].offset
    data[off : off + 8] = bytes(b ^ 0xFF for b in data[off : off + 8])
    p.write_bytes(bytes(data))


def test_corrupt_disk_layer_midway_is_recomputed(tmp_path):
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=3, sizes=SIZES)
    store = DiskStore(tmp_path / "kv", fsync=False)
    ref = healthy_run(model, prompt, store)
    eng = engine(model, store, True)
    key = eng.keys.chunk_key(prompt.chunk_ids[2])
    _corrupt_layer_on_disk(store, key, 2)  # the header is intact: the lookup passes, layer 2 fails
    res = eng.prefill_prompt(prompt)
    assert res.stats.hits == 4 and res.stats.corrupt == 1 and res.stats.vanished == res.stats.store_errors == 0
    torch.testing.assert_close(res.logits, ref.logits, atol=1e-4, rtol=0)
    assert store.contains(key)  # written back by the recompute
    assert not loader_threads()


@pytest.fixture
def redis_proc():
    srv = start_or_skip()
    yield srv.proc, srv.url
    srv.stop()


class KillOnFirstRead:
    """Kills the redis-server at the first layer read: after the lookup, in the middle of a request."""

    def __init__(self, inner, proc):
        self.inner, self.proc, self.killed = inner, proc, False

    def _kill(self):
        if not self.killed:
            self.killed = True
            self.proc.kill()
            self.proc.wait(timeout=10)

    def get_layer(self, key, i):
        self._kill()
        return self.inner.get_layer(key, i)

    def fetch_layers(self, keys, i):
        self._kill()
        return self.inner.fetch_layers(keys, i)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.redis
@pytest.mark.parametrize("pipelined", [True, False])
def test_redis_dies_mid_request(redis_proc, pipelined):
    from ragkv.store.redis_store import RedisStore

    proc, url = redis_proc
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=4, sizes=SIZES)
    store = RedisStore(url, namespace="loader-test:", socket_timeout=2.0)
    try:
        ref = healthy_run(model, prompt, store)
        assert ref.stats.hits == 4
        res = engine(model, KillOnFirstRead(store, proc), pipelined).prefill_prompt(prompt)
        assert proc.poll() is not None and res.stats.store_errors >= 1 and res.stats.corrupt == 0
        torch.testing.assert_close(res.logits, ref.logits, atol=1e-4, rtol=0)
    finally:
        store.close()
    assert not loader_threads()


# ---------------------------------------------------------------- the loader itself


def _filled_store(n_keys: int = 3, n_layers: int = 6):
    model = models.tiny_model("llama", num_hidden_layers=n_layers)
    store = MemoryStore()
    eng = engine(model, store, False)
    prompt = make_prompt(seed=5, sizes=(17, 17, 17)[:n_keys])
    eng.prefill_prompt(prompt)
    keys = [seg.key for seg in eng._segments(prompt) if not seg.is_prefix]
    layer_bytes = sum(store.get_layer(k, 0).nbytes for k in keys)
    return store, keys, layer_bytes


@pytest.mark.parametrize("budget_layers", [0.5, 1, 2, 3])
def test_prefetch_stays_within_byte_bound(budget_layers):
    store, keys, layer_bytes = _filled_store()
    max_bytes = int(budget_layers * layer_bytes)
    with LayerLoader(store, keys, range(6), prefetch_depth=4, max_bytes=max_bytes) as loader:
        time.sleep(0.1)  # let it prefetch as far as it may
        got = []
        for li in range(6):
            got.append(loader.layer(li))
            time.sleep(0.02)
    assert all(not isinstance(x, Miss) for layer in got for x in layer)
    if budget_layers < 1:  # a single layer larger than the bound goes through alone
        assert loader.peak_bytes == layer_bytes
    else:
        assert 0 < loader.peak_bytes <= max_bytes
    for li, layer in enumerate(got):
        for key, x in zip(keys, layer):
            assert torch.equal(x.k, store.get_layer(key, li).k)
    assert not loader._thread.is_alive() and loader.bytes_in_flight == 0


def test_prefetch_depth_bounds_layers_ahead():
    store, keys, layer_bytes = _filled_store()
    with LayerLoader(store, keys, range(6), prefetch_depth=2) as loader:
        time.sleep(0.2)
        assert loader.peak_bytes <= 2 * layer_bytes
        for li in (0, 1):
            got = loader.layer(li)
            assert len(got) == len(keys) and not any(isinstance(x, Miss) for x in got)
            assert all(torch.equal(x.k, store.get_layer(k, li).k) for k, x in zip(keys, got))


def test_sequential_loader_same_layers():
    store, keys, _ = _filled_store()
    seq = SequentialLoader(store, keys, range(2, 6))
    with LayerLoader(store, keys, range(2, 6)) as pipe:
        for li in range(2, 6):
            for a, b in zip(seq.layer(li), pipe.layer(li)):
                assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_stuck_store_times_out_as_miss():
    _, keys, _ = _filled_store()
    release = threading.Event()

    class Stuck:
        def get_layer(self, key, i):
            release.wait(5)
            return None

    loader = LayerLoader(Stuck(), keys, range(6), timeout_s=1.0, join_timeout_s=0.1)
    try:
        assert loader.layer(0) == [Miss("timeout")] * len(keys) and loader.timed_out
        t0 = time.monotonic()
        assert loader.layer(1) == [Miss("timeout")] * len(keys)
        assert time.monotonic() - t0 < loader.timeout_s  # no second wait after a timeout
    finally:
        loader.close()
        release.set()
    loader._thread.join(5)
    assert not loader._thread.is_alive()


def test_loader_closed_when_request_raises(monkeypatch):
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=6, sizes=SIZES)
    eng = engine(model, MemoryStore(), True)
    eng.prefill_prompt(prompt)
    real = cache_mod.FusedCache.fuse

    def boom(self, li, parts):
        if li == 2:
            raise RuntimeError("boom")
        return real(self, li, parts)

    monkeypatch.setattr(cache_mod.FusedCache, "fuse", boom)
    with pytest.raises(RuntimeError, match="boom"):
        eng.prefill_prompt(prompt)
    assert not loader_threads()


class CountingStore:
    """Counts layer reads and signals when ``n`` reads happened."""

    def __init__(self, inner, n: int):
        self.inner, self.n, self.reads = inner, n, []
        self.done = threading.Event()

    def get_layer(self, key, i):
        self.reads.append(i)
        if len(self.reads) >= self.n:
            self.done.set()
        return self.inner.get_layer(key, i)


def test_loader_reads_ahead_of_the_caller():
    store, keys, _ = _filled_store()
    counting = CountingStore(store, 3 * len(keys))
    with LayerLoader(counting, keys, range(6), prefetch_depth=3) as loader:
        assert counting.done.wait(10)  # layers 0..2 read before anybody asked for them
        assert sorted(set(counting.reads)) == [0, 1, 2]
        for li in range(3):  # served from what was read ahead
            got = loader.layer(li)
            assert all(torch.equal(x.k, store.get_layer(k, li).k) for k, x in zip(keys, got))
    assert loader.io_seconds > 0


def test_skipping_layers_never_fills_the_prefetch_window():
    """The caller jumps from layer 0 to layer 4 while layers 1..2 sit unread in a full window: they
    are dropped at once, the loader moves on, and layer 4 arrives without waiting out the timeout."""
    store, keys, _ = _filled_store()
    counting = CountingStore(store, 3 * len(keys))
    with LayerLoader(counting, keys, range(6), prefetch_depth=2, timeout_s=30.0) as loader:
        loader.layer(0)
        assert counting.done.wait(10)  # window full: layers 1 and 2 read, the loader waits for room
        got = loader.layer(4)
        assert not loader.timed_out and not any(isinstance(x, Miss) for x in got)
        assert 3 not in counting.reads  # a skipped layer is not read at all once the caller passed it


class HangingStore:
    """Layer reads hang (until released) and writes are recorded: a store that stopped answering."""

    def __init__(self, inner):
        self.inner, self.release, self.writes = inner, threading.Event(), []

    def fetch_layers(self, keys, i):
        self.release.wait(30)
        return self.inner.fetch_layers(keys, i)

    def put_encoded(self, key, enc):
        self.writes.append(key)
        self.release.wait(30)
        return self.inner.put_encoded(key, enc)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_after_a_load_timeout_the_request_recomputes_and_writes_nothing_back():
    """Write-back used to call the same stuck store, with no timeout, after the loader gave up on it."""
    model = models.tiny_model("llama")
    prompt = make_prompt(seed=8, sizes=SIZES)
    store = MemoryStore()
    ref = healthy_run(model, prompt, store)
    hanging = HangingStore(store)
    config = BlendConfig(pipelined=True, load_timeout_s=0.5, selector=DeviationSelector(check_layers=(1,)))
    eng = BlendEngine(model, None, hanging, config, template=TEMPLATE)
    try:
        res = eng.prefill_prompt(prompt)
    finally:
        hanging.release.set()
    assert res.stats.timeouts >= 1 and hanging.writes == []
    torch.testing.assert_close(res.logits, ref.logits, atol=1e-4, rtol=0)
