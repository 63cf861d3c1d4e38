"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand: a few
counters, two gauges and the TTFT histogram need no client library."""

from __future__ import annotations

import threading

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

COUNTERS = {
    "requests": "chat completion requests answered, by HTTP status (200 includes streams that completed)",
    "requests_cancelled": "requests whose client went away before the answer was complete (generation stopped)",
    "requests_rejected": "requests refused with 429 because the queue was full",
    "chunk_hits": "document chunks whose K/V were found in the store",
    "chunk_misses": "document chunks prefilled because the store lacked them (kept as --write-policy allows)",
    "recomputed_tokens": "chunk tokens recomputed in the last layer",
    "cached_tokens": "prompt tokens served from stored K/V (usage.prompt_tokens_details.cached_tokens)",
    "prompt_tokens": "prompt tokens of admitted requests",
    "completion_tokens": "tokens generated (including requests cancelled midway)",
}


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.counts = {name: 0 for name in COUNTERS if name != "requests"}
        self.by_status: dict[int, int] = {}
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)
        self.ttft_sum = 0.0
        self.ttft_count = 0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def answered(self, status: int) -> None:
        with self._lock:
            self.by_status[status] = self.by_status.get(status, 0) + 1

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_buckets[i] += 1

    def render(self, queue_depth: int, queue_limit: int, writes=None) -> str:
        """``writes``: the server's WritePolicy (its counters are rendered too)."""
        lines = []

        def head(name, kind, help_):
            lines.extend([f"# HELP ragkv_{name} {help_}", f"# TYPE ragkv_{name} {kind}"])

        with self._lock:
            head("requests_total", "counter", COUNTERS["requests"])
            for status in sorted(self.by_status):
                lines.append(f'ragkv_requests_total{{status="{status}"}} {self.by_status[status]}')
            for name, value in self.counts.items():
                head(f"{name}_total", "counter", COUNTERS[name])
                lines.append(f"ragkv_{name}_total {value}")
            head("ttft_seconds", "histogram", "time from request arrival to the first generated token")
            for bound, n in zip(TTFT_BUCKETS, self.ttft_buckets):
                lines.append(f'ragkv_ttft_seconds_bucket{{le="{bound}"}} {n}')
            lines += [f'ragkv_ttft_seconds_bucket{{le="+Inf"}} {self.ttft_count}',
                      f"ragkv_ttft_seconds_sum {self.ttft_sum:.6f}", f"ragkv_ttft_seconds_count {self.ttft_count}"]
        head("queue_depth", "gauge", "requests admitted: running or waiting for the model")
        lines.append(f"ragkv_queue_depth {queue_depth}")
        head("queue_limit", "gauge", "the most requests admitted at once (--max-queue)")
        lines.append(f"ragkv_queue_limit {queue_limit}")
        if writes is not None:
            for name, value, help_ in (
                ("store_writes_total", writes.written, "entries computed for requests and kept in the write store"),
                ("store_write_bytes_total", writes.written_bytes, "bytes of those entries"),
                ("store_writes_refused_total", writes.refused,
                 "entries computed for requests and not kept (--write-policy none, or over --write-quota)"),
            ):
                head(name, "counter", help_)
                lines.append(f"ragkv_{name} {value}")
        return "\n".join(lines) + "\n"
