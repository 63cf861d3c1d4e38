"""Embedded on-disk store: one file per entry, safe for several processes sharing a directory.

    objects/<2 hex fan-out>/<key>.kv     header | pad to 64 | blob 0 | blob 1 | ...
    objects/<xx>/.tmp-<key>-<host>-<pid>-<rand>   in-flight writes (removed on failure)
    index.json                           {key: [bytes, last access]} (a cache of the directory)
    .lock                                fcntl lock taken for index writes and eviction

Writes: temp file, fsync, ``os.replace`` (readers see all of an entry or none); ENOSPC/EDQUOT ->
``StoreFull``. Reads: the header, then only the asked layers' byte ranges (``pread``); a whole entry
streamed while it is verified. LRU by file mtime (shared by every process, survives restarts): past
``max_bytes`` (or every ``rescan_every`` puts) the directory is rescanned under the lock and the least
recently used unpinned entries go (ragkv.store.disk_index). Files ``mode`` 0o600, directories 0o700
by default, whatever the umask. Details: ragkv/store/README.md.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import numpy as np

import ragkv.store.disk_io as disk_io
from ragkv.store.base import KVStore, Loaded, log, wants_all
from ragkv.store.disk_index import DiskIndex
from ragkv.store.disk_io import SUFFIX, StreamedBlobs, read_exact
from ragkv.store.disk_io import write_all as _write_all  # module global: tests patch it
from ragkv.store.entry import EncodedEntry, Layout, check_layer_index
from ragkv.store.errors import StoreError, StoreFull, StoreUnavailable
from ragkv.store.values import budget_from, check_key, is_key

_PAD = bytes(64)


def _fanout(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()


class DiskStore(KVStore):
    def __init__(
        self,
        root: str | os.PathLike,
        max_bytes: int | str | None = 10 << 30,
        fsync: bool = True,
        rescan_every: int = 64,
        parallel_read: bool | None = None,
        mode: int = 0o600,
        create: bool = True,
        read_only: bool = False,
    ):
        """``mode``: of every file the store creates (entries, temp files, index, lock); its
        directories get the matching x bits. 0o600/0o700 by default: entries hold token ids in
        clear; 0o640 lets a group read a shared directory (0o660: and write it).
        ``create=False``: a directory without a store (no ``objects/``) is StoreUnavailable instead
        of becoming one. ``read_only``: (implies ``create=False``) for looking only (``ragkv
        stats``): nothing is created, written, locked or swept, not even the lock file or the
        index, and writes raise StoreError."""
        super().__init__()
        self.mode = disk_io.check_mode(mode)
        self.read_only = read_only
        create = create and not read_only
        self.root = Path(root).expanduser().resolve()
        self.max_bytes = budget_from(max_bytes)
        self.fsync = fsync
        self.rescan_every = rescan_every
        # overlap file reads with checksum verification on a helper thread; it needs a second core
        # (default: on when there is one; measured 4.4 -> 3.4 ms per 23.6 MB entry on an idle 2-core box)
        self.parallel_read = (os.cpu_count() or 1) > 1 if parallel_read is None else parallel_read
        self._objects = self.root / "objects"
        self._lock_path = self.root / ".lock"
        self._entries = DiskIndex(self._objects, self.root / "index.json", self.mode, read_only)
        self._pool: ThreadPoolExecutor | None = None
        try:
            if create:
                disk_io.makedirs(self._objects, self.mode)
            elif not self._objects.is_dir():
                if self.root.exists() and not self.root.is_dir():
                    raise NotADirectoryError(self.root)
                what = "no such directory" if not self.root.exists() else "not a store (no objects/ directory)"
                raise StoreUnavailable(f"disk store {self.root}: {what}; nothing was created")
            with self._flock():
                self._entries.rescan(load_index=True)
        except (NotADirectoryError, FileExistsError):
            raise ValueError(f"disk store path {self.root} is not a directory (or lies under a file)") from None
        except OSError as e:
            raise StoreUnavailable(f"disk store {self.root}: cannot use it: {e}") from None
        held = self._entries.usage()
        if self.max_bytes is not None and held["bytes"] + held["tmp_bytes"] > self.max_bytes:
            log.warning("%s: the directory holds %d bytes in %d entries, more than max_bytes=%d; "
                        "the first write will evict down to it", self.uri, held["bytes"] + held["tmp_bytes"],
                        held["entries"], self.max_bytes)

    @property
    def uri(self) -> str:
        q = [] if self.max_bytes is None else [f"max_bytes={self.max_bytes}"]
        if not self.fsync:
            q.append("fsync=0")
        if self.mode != 0o600:
            q.append(f"mode={self.mode:04o}")
        return f"disk://{self.root}" + ("?" + "&".join(q) if q else "")

    def check(self) -> None:
        """The root is a directory this process can create files in (a probe file, removed);
        read-only: one it can list."""
        try:
            if not self._objects.is_dir():
                raise NotADirectoryError(f"{self._objects} is not a directory")
            if self.read_only:
                os.listdir(self._objects)
                return
            fd, probe = tempfile.mkstemp(prefix=".probe-", dir=self.root)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise StoreUnavailable(f"disk store {self.root}: not usable: {e}") from None

    def path(self, key: str) -> Path:
        check_key(key)
        return self._objects / _fanout(key) / (key + SUFFIX)

    # ---- hooks --------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """A complete entry file is there: its header is valid and bound to ``key`` and the file
        size is the header's total (cheap: no checksum). A truncated or garbage file is counted as
        corrupt and removed, so a put rewrites it; an entry of a newer format counts as present."""
        p = self.path(key)
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            return self._checked(key, lambda: disk_io.read_header(fd, key))
        except OSError as e:
            log.debug("%s: contains(%s) could not read: %s", self.uri, key, e)
            return False
        finally:
            os.close(fd)

    def _load(self, key: str, layers: Sequence[int] | None) -> Loaded | None:
        p = self.path(key)
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            self._entries.forget(key)
            return None
        try:
            header, layout, size = disk_io.read_header(fd, key)
            if layers is not None and wants_all(layers):
                blobs = StreamedBlobs(fd, layout, self._reader() if self.parallel_read else None)  # owns fd
                fd = -1
            else:
                blobs = []
                for i in layers or ():
                    ll = layout.layers[check_layer_index(i, layout)]
                    b = memoryview(np.empty(ll.nbytes, dtype=np.uint8))  # every byte is read into
                    read_exact(fd, b, layout.data_offset + ll.offset)
                    blobs.append(b)
        finally:
            if fd >= 0:
                os.close(fd)
        self._entries.touch(key, p, size)
        return header, layout, blobs

    def _store(self, key: str, enc: EncodedEntry, layout: Layout, owned: bool) -> bool:
        if self.read_only:
            raise StoreError(f"disk store {self.root} is open read-only")
        p = self.path(key)
        if self.max_bytes is not None and layout.total_nbytes > self.max_bytes:  # would evict all
            raise StoreFull(f"disk store {self.root}: entry {key} is {layout.total_nbytes} bytes, larger than "
                            f"the whole budget max_bytes={self.max_bytes}; not stored, nothing evicted")
        if p.exists():
            return False
        disk_io.makedirs(p.parent, self.mode)
        tmp = p.parent / disk_io.tmp_name(key)
        try:
            fd = disk_io.create(tmp, self.mode)
            try:
                _write_all(fd, enc.header)
                _write_all(fd, _PAD[: layout.data_offset - len(enc.header)])
                for b in enc.blobs:
                    _write_all(fd, b)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)
        except OSError as e:
            with suppress(FileNotFoundError):
                tmp.unlink()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"disk store {self.root}: no space left writing {p}") from e
            raise StoreError(f"disk store {self.root}: writing {p} failed: {e}") from e
        total, puts = self._entries.added(key, layout.total_nbytes)
        if (self.max_bytes is not None and total > self.max_bytes) or puts >= self.rescan_every:
            self.evict()
        return True

    def _remove(self, key: str) -> bool:
        if self.read_only:
            raise StoreError(f"disk store {self.root} is open read-only")
        try:
            self.path(key).unlink()
            ok = True
        except FileNotFoundError:
            ok = False
        self._entries.forget(key)
        return ok

    def keys(self) -> Iterator[str]:
        for sub in sorted(os.scandir(self._objects), key=lambda d: d.name):
            if not sub.is_dir():
                continue
            try:
                names = os.listdir(sub.path)
            except FileNotFoundError:
                continue
            for name in names:
                if name.endswith(SUFFIX) and not name.startswith("."):
                    key = name[: -len(SUFFIX)]
                    if is_key(key):  # another file with our suffix is not an entry: left alone
                        yield key

    def clear(self) -> None:
        """Delete every entry. Files that are not entries (a name outside the key alphabet, e.g.
        ``objects/ab/bad name.kv``) are left in place (``foreign_files``)."""
        with self._flock():
            for k in list(self.keys()):
                self._remove(k)
            self._entries.save()

    def foreign_files(self) -> list[str]:
        """Files under ``objects/`` that are neither entries nor temp files (paths relative to the
        root); the store never reads or deletes them."""
        return disk_io.foreign_files(self._objects)

    def _reader(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="ragkv-disk-read")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.read_only:
            return
        try:
            with self._flock():
                self._entries.save()
        except OSError as e:  # pragma: no cover - read-only dir etc.
            log.warning("%s: could not save index: %s", self.uri, e)

    def _usage(self) -> dict:
        return {**self._entries.usage(), "max_bytes": self.max_bytes}

    # ---- index / eviction -----------------------------------------------------------------------

    def evict(self, max_bytes: int | None = None) -> int:
        """Rescan the directory and delete least recently used unpinned entries until it fits
        ``max_bytes`` (default: the store's own budget; the store's budget is not changed)."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        n = 0
        with self._flock():
            self._entries.rescan(load_index=False)
            for key, _ in self._entries.victims(limit, self.is_pinned):
                n += self._remove(key)
            self._count("evictions", n)
            self._entries.save()
        return n

    def plan_eviction(self, max_bytes: int) -> tuple[int, int]:
        """(entries, bytes) that ``evict(max_bytes)`` would delete now; deletes nothing."""
        with self._flock():
            self._entries.rescan(load_index=False)
            victims = self._entries.victims(max_bytes, self.is_pinned)
        return len(victims), sum(nbytes for _, nbytes in victims)

    def _flock(self):
        if self.read_only:  # the lock if it is there (shared), never a new lock file
            return disk_io.flock(self._lock_path, self.mode, create=False)
        return disk_io.flock(self._lock_path, self.mode)
