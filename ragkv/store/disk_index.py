"""What a DiskStore knows about its directory (ragkv.store.disk): per entry its bytes and last access
(its file's mtime, shared by every process), the total, and the bytes of live temp files. Reconciled
with the directory by ``rescan`` (the store holds its file lock), saved to ``index.json`` (a cache: a
lost or stale one is rebuilt by scanning), and asked which least recently used entries a budget
evicts (``victims``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import ragkv.store.disk_io as disk_io


class DiskIndex:
    def __init__(self, objects: Path, path: Path, mode: int, read_only: bool):
        self.objects, self.path, self.mode, self.read_only = objects, path, mode, read_only
        self._lock = threading.Lock()
        self._entries: dict[str, list] = {}  # key -> [nbytes, last access (mtime)]
        self.bytes = 0
        self.tmp_bytes = 0  # live temp files (in-flight writes) at the last scan
        self.puts_since_scan = 0

    def usage(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "tmp_bytes": self.tmp_bytes}

    def touch(self, key: str, path: Path, size: int) -> None:
        """A hit: its access time (and its file's mtime, at most once a second per key)."""
        if self.read_only:
            return
        now = time.time()
        with self._lock:
            e = self._entries.get(key)
            if e is not None and now - e[1] < 1.0:
                return
            if e is None:
                self.bytes += size
            self._entries[key] = [size, now]
        with suppress(OSError):
            os.utime(path, (now, now))

    def added(self, key: str, nbytes: int) -> tuple[int, int]:
        """An entry written by this process; -> (bytes of the directory incl. temp files, puts since
        the last rescan)."""
        with self._lock:
            if key not in self._entries:
                self.bytes += nbytes
            self._entries[key] = [nbytes, time.time()]
            self.puts_since_scan += 1
            return self.bytes + self.tmp_bytes, self.puts_since_scan

    def forget(self, key: str) -> None:
        with self._lock:
            e = self._entries.pop(key, None)
            if e is not None:
                self.bytes -= e[0]

    def rescan(self, load_index: bool) -> None:
        """Reconcile with the directory (the store's lock held), sweeping orphaned temp files unless
        read-only. Known entries keep their cached size, their access time refreshed from mtime;
        unknown ones are stat-ed. ``load_index``: start from index.json (at open)."""
        if load_index:
            cached = disk_io.load_index(self.path)
        else:
            with self._lock:
                cached = {k: list(v) for k, v in self._entries.items()}
        entries, tmp_bytes = disk_io.scan_objects(self.objects, cached, trust_cached=load_index,
                                                  sweep=not self.read_only)
        with self._lock:
            self._entries = entries
            self.bytes = sum(v[0] for v in entries.values())
            self.tmp_bytes = tmp_bytes
            self.puts_since_scan = 0

    def save(self) -> None:
        with self._lock:
            entries = dict(self._entries)
        disk_io.save_index(self.path, entries, self.mode)

    def victims(self, limit: int | None, pinned: Callable[[str], bool]) -> list[tuple[str, int]]:
        """Least recently used unpinned entries to delete so that the directory fits ``limit`` (live
        temp files count: they become entries)."""
        with self._lock:
            total, order = self.bytes + self.tmp_bytes, sorted(self._entries.items(), key=lambda kv: kv[1][1])
        out = []
        for key, (nbytes, _) in order:
            if limit is None or total <= limit:
                break
            if not pinned(key):
                out.append((key, nbytes))
                total -= nbytes
        return out
