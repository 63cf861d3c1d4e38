"""Layer-wise loading of stored chunk K/V for the blend's layer loop, pipelined or sequential.

While the compute thread runs layer i, a background thread already reads layer i+1 (and up to
``prefetch_depth`` layers ahead) from the store, so TTFT tends to max(load, recompute) instead of
their sum.

Who calls what
--------------
- ``BlendEngine.prefill_prompt`` creates one loader per request over the keys of the segments that
  come from the store and the layers it will read (``range(first_load, num_layers)``), and uses it
  as a context manager (``with loader:``), so ``close()`` runs on every exit, exceptions included.
- The layer loop calls ``loader.layer(li)`` at most once per layer, in increasing order (it may
  skip layers); it returns one ``StoredLayer | Miss`` per key (in ``keys`` order). A ``Miss`` says
  why that key has no layer li: ``absent`` (vanished since the lookup), ``corrupt``/``unsupported``
  (the store's verdict), ``error`` (the store raised or is unreachable) or ``timeout`` (not read
  within ``timeout_s``). The caller recomputes that segment (never a hang, never a raise).
- ``timed_out``: True once a layer did not arrive in time; the store is then considered stuck for
  the rest of the request (every later layer is a timeout miss, and the caller skips write-back).
- ``loader.bytes_in_flight`` / ``peak_bytes``: bytes read but not yet taken by ``layer()``;
  ``io_seconds``: time spent inside store reads.

Thread lifecycle (``LayerLoader``)
----------------------------------
``__init__`` starts one daemon thread. For each layer it waits until fewer than ``prefetch_depth``
layers are ready and untaken AND the layer fits in ``max_bytes`` (its size is predicted from the
layers already read: all layers of an entry have the same shape; a layer larger than the bound is read
only when nothing else is in flight, i.e. alone), reads every key, publishes the layer and wakes
the caller. ``layer(li)`` first drops every earlier layer never asked for (so skipping layers never
fills the prefetch window) and tells the thread not to read them, then takes layer li, releasing
its bytes. ``close()`` sets a stop flag, wakes the thread and joins it (a thread stuck inside a
store call is abandoned after ``join_timeout_s``; it is a daemon and holds nothing the caller
needs). After ``close()`` or a timeout, ``layer()`` answers misses without waiting.

``SequentialLoader`` has the same interface and reads on demand in the caller's thread (the
reference for comparisons and benchmarks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from ragkv.store.entry import StoredLayer
from ragkv.store.values import ABSENT as _ABSENT
from ragkv.store.values import ERROR as _ERROR
from ragkv.store.values import TIMEOUT as _TIMEOUT
from ragkv.store.values import Miss

log = logging.getLogger("ragkv.loader")


def read_layer(store, keys: Sequence[str], li: int) -> list[StoredLayer | Miss]:
    """Layer li of every key, with one batched store call (``fetch_layers``: one Redis round trip,
    misses with their reason) when the store class has it, else key by key with ``get_layer``. A
    failing batch falls back to key by key; an exception for one key is an ``error`` miss."""
    # looked up on the class: a wrapper that delegates unknown attributes must not bypass its get_layer
    batched = getattr(type(store), "fetch_layers", None)
    if batched is not None:
        try:
            return [x if isinstance(x, (StoredLayer, Miss)) else _ABSENT for x in batched(store, keys, li)]
        except IndexError:
            raise  # a caller's bad layer index is a bug, not a miss
        except Exception as e:  # any store failure: retry key by key, each failure a miss
            log.warning("fetch_layers(%d keys, %d) raised %s: %s", len(keys), li, type(e).__name__, e)
    items: list[StoredLayer | Miss] = []
    for key in keys:
        try:
            got = store.get_layer(key, li)
        except IndexError:
            raise
        except Exception as e:  # any store failure is a miss for this key and layer
            log.warning("get_layer(%s, %d) raised %s: %s", key, li, type(e).__name__, e)
            got = _ERROR
        items.append(got if got is not None else _ABSENT)
    return items


def _nbytes(items: Sequence[StoredLayer | Miss]) -> int:
    return sum(x.nbytes for x in items if isinstance(x, StoredLayer))


class SequentialLoader:
    """Reads layer li of every key when ``layer(li)`` is called, in the caller's thread."""

    def __init__(self, store, keys: Sequence[str], layers: range, **_ignored):
        self.store, self.keys, self.layers = store, list(keys), layers
        self.peak_bytes = 0
        self.bytes_in_flight = 0
        self.io_seconds = 0.0
        self.timed_out = False

    def layer(self, li: int) -> list[StoredLayer | Miss]:
        if li not in self.layers:
            raise IndexError(f"layer {li} outside {self.layers}")
        t0 = time.perf_counter()
        out = read_layer(self.store, self.keys, li)
        self.io_seconds += time.perf_counter() - t0
        self.peak_bytes = max(self.peak_bytes, _nbytes(out))
        return out

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LayerLoader:
    """Background prefetch of ``store.get_layer(key, li)`` for every key, layer by layer."""

    def __init__(self, store, keys: Sequence[str], layers: range, prefetch_depth: int = 2,
                 max_bytes: int | None = None, timeout_s: float = 10.0, join_timeout_s: float = 2.0):
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.store, self.keys, self.layers = store, list(keys), layers
        self.prefetch_depth, self.max_bytes = prefetch_depth, max_bytes
        self.timeout_s, self.join_timeout_s = timeout_s, join_timeout_s
        self.peak_bytes = 0
        self.bytes_in_flight = 0  # read (or reserved for the layer being read), not yet taken
        self.io_seconds = 0.0
        self.timed_out = False
        self._ready: dict[int, tuple[list, int]] = {}  # li -> (items, nbytes)
        self._done_upto = layers.start  # every layer < this was published (or abandoned)
        self._taken_upto = layers.start  # every layer < this was taken by the caller
        self._stop = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ragkv-layer-loader", daemon=True)
        self._thread.start()

    # ---- caller side ----------------------------------------------------------------------

    def layer(self, li: int) -> list[StoredLayer | Miss]:
        """Block until layer li is read (at most ``timeout_s``); one item per key."""
        if li not in self.layers:
            raise IndexError(f"layer {li} outside {self.layers}")
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            for old in [j for j in self._ready if j < li]:  # layers the caller skipped: free the window
                self.bytes_in_flight -= self._ready.pop(old)[1]
            self._taken_upto = max(self._taken_upto, li)  # ... and the thread skips those not read yet
            self._cv.notify_all()
            while li not in self._ready and not self._stop and li >= self._done_upto:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("layer %d not loaded within %.1f s: treated as a miss", li, self.timeout_s)
                    self._stop = self.timed_out = True  # a stuck store: stop waiting on it for this request
                    break
                self._cv.wait(left)
            self._taken_upto = max(self._taken_upto, li + 1)
            miss = _TIMEOUT if self.timed_out else _ERROR
            items, nbytes = self._ready.pop(li, ([miss] * len(self.keys), 0))
            self.bytes_in_flight -= nbytes
            self._cv.notify_all()
        return items

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._ready.clear()
            self.bytes_in_flight = 0
            self._cv.notify_all()
        self._thread.join(self.join_timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- loader thread --------------------------------------------------------------------

    def _room(self, est: int) -> bool:
        """Whether the next layer (predicted ``est`` bytes) may be read now (lock held)."""
        ahead = len(self._ready)
        if ahead >= self.prefetch_depth:
            return False
        if self.max_bytes is None or self.bytes_in_flight == 0:
            return True  # nothing in flight: even an oversized layer goes, alone
        return self.bytes_in_flight + est <= self.max_bytes

    def _run(self) -> None:
        sizes: dict[str, int] = {}  # per key, largest layer seen: all layers of an entry share a shape
        est = 0  # predicted bytes of the next layer
        try:
            for li in self.layers:
                with self._cv:
                    while not self._stop and not self._room(est):
                        self._cv.wait()
                    if self._stop:
                        return
                    if li < self._taken_upto:  # the caller already gave up on this layer
                        self._done_upto = li + 1
                        continue
                    reserved = est
                    self.bytes_in_flight += reserved
                    self.peak_bytes = max(self.peak_bytes, self.bytes_in_flight)
                t0 = time.perf_counter()
                items = [] if self._stop else read_layer(self.store, self.keys, li)
                self.io_seconds += time.perf_counter() - t0
                items += [_ERROR] * (len(self.keys) - len(items))
                nbytes = _nbytes(items)
                for key, x in zip(self.keys, items):
                    if isinstance(x, StoredLayer):
                        sizes[key] = max(sizes.get(key, 0), x.nbytes)
                if sizes:  # a key never read yet is predicted at the largest size seen
                    est = sum(sizes.get(k, max(sizes.values())) for k in self.keys)
                with self._cv:
                    self.bytes_in_flight += nbytes - reserved
                    if self._stop or li < self._taken_upto:
                        self.bytes_in_flight -= nbytes
                    else:
                        self._ready[li] = (items, nbytes)
                        self.peak_bytes = max(self.peak_bytes, self.bytes_in_flight)
                    self._done_upto = li + 1
                    self._cv.notify_all()
        except BaseException:  # never let the thread die silently with a waiter
            log.exception("layer loader thread failed")
        finally:
            with self._cv:
                self._done_upto = self.layers.stop
                self._cv.notify_all()


def make_loader(pipelined: bool, store, keys: Sequence[str], layers: range, **kw):
    """``LayerLoader`` when ``pipelined``, else ``SequentialLoader`` (same interface)."""
    return (LayerLoader if pipelined else SequentialLoader)(store, list(dict.fromkeys(keys)), layers, **kw)
