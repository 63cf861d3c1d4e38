"""The model worker: every model step of every request runs on one thread, one at a time, and the
event loop only awaits them.

Fairness: a request submits its next step only after the previous one finished, and the worker takes
steps first in, first out, so the requests in flight take turns token by token (round robin): a new
request's prefill waits for at most one step of each request ahead of it, never for whole answers.

Admission: at most ``max_queue`` requests are admitted at once (running or waiting); one more is
refused with 429 and a ``Retry-After`` of about one request's service time. ``admit()`` hands out a
``Slot`` whose ``release()`` gives the place back once, however often it is called, so the route can
release it on every way out (an answer, an error, an exception, a stream that never started).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .protocol import ApiError


class Slot:
    """One admitted request's place in the queue; ``release()`` gives it back once (later calls are
    no-ops and return False)."""

    def __init__(self, worker: Worker):
        self._worker, self.released = worker, False

    def release(self, seconds: float | None = None) -> bool:
        """``seconds``: the request's time in the server (for Retry-After). True the first time."""
        return self._worker._release(self, seconds)


class Worker:
    def __init__(self, max_queue: int):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.admitted = 0  # requests running or waiting
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragkv-model")
        self._lock = threading.Lock()
        self._service_s = 1.0  # moving average of one request's time in the server
        self.closed = False

    def admit(self) -> Slot:
        """Take a place for one request, or raise ApiError 429 with Retry-After."""
        with self._lock:
            if self.closed:
                raise ApiError(503, "the server is shutting down", code="shutting_down", type_="server_error")
            if self.admitted >= self.max_queue:
                retry = max(1, math.ceil(self._service_s))
                raise ApiError(429, f"the server is busy: {self.admitted} requests queued or running "
                               f"(--max-queue {self.max_queue}); retry after {retry} s",
                               code="queue_full", type_="rate_limit_error", headers={"Retry-After": str(retry)})
            self.admitted += 1
            return Slot(self)

    def _release(self, slot: Slot, seconds: float | None) -> bool:
        with self._lock:
            if slot.released:
                return False
            slot.released = True
            self.admitted -= 1
            if seconds is not None:
                self._service_s = 0.8 * self._service_s + 0.2 * seconds
            return True

    async def run(self, fn: Callable, *args):
        """Run one model step on the worker thread. Cancelling the awaiting task drops a step that
        has not started; a running step finishes (a step is one prefill or one token)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def after(self, fn: Callable) -> None:
        """Run ``fn`` on the worker thread after the steps already queued (no-op once closed)."""
        with contextlib.suppress(RuntimeError):  # shut down
            self._pool.submit(fn)

    def close(self) -> None:
        """Refuse new requests, drop queued steps, wait for the running one."""
        with self._lock:
            self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
