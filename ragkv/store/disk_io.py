"""Low-level file I/O of the disk store: exact positional reads, full writes, the streamed
whole-entry read that overlaps reading with checksum verification, temp-file names and the
directory scan that sweeps orphaned temp files, and the index file."""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import threading
import time
import uuid
from concurrent.futures import Executor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ragkv.store.entry import Layout, decode_header, header_nbytes
from ragkv.store.errors import CorruptEntry
from ragkv.store.values import is_key

STREAM_MIN = 4 << 20  # smaller entries are read in the caller's thread
SUFFIX = ".kv"
_HEAD_READ = 64 << 10  # first read of an entry file: the whole header in one pread, usually
TMP_STALE_S = 3600.0  # temp files of other hosts (shared NFS) are swept after this age
# this host in temp names; '-' separates the name's fields, so it is replaced (capped: the name
# ".tmp-<200-char key>-<host>-<pid>-<rand>" stays under 255 bytes)
HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:24] or "localhost"
_TMP_RE = re.compile(r"\.tmp-.+-(?P<host>[A-Za-z0-9._]+)-(?P<pid>[0-9]+)-[0-9a-f]+")


def read_exact(fd: int, buf, offset: int) -> None:
    mv, got = memoryview(buf), 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if n == 0:
            raise CorruptEntry(f"truncated file: wanted {len(mv)} bytes at {offset}, got {got}")
        got += n


def write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    while len(mv):
        n = os.write(fd, mv)
        mv = mv[n:]


class StreamedBlobs:
    """All layer blobs of one file, read by a helper thread into one buffer while the caller
    verifies the layers already read (read and checksum overlap: two cores instead of one).
    Indexing waits for that layer's bytes; a read error is raised where the layer is asked for."""

    def __init__(self, fd: int, layout: Layout, reader: Executor | None):
        """``reader``: the pool the helper thread comes from (None: read here, before returning)."""
        self.layout = layout
        base = layout.data_offset
        # uninitialised buffer (np.empty): every byte of every blob is written by the reads below
        self._mv = memoryview(np.empty(layout.data_nbytes, dtype=np.uint8))
        self._views = [self._mv[ll.offset : ll.offset + ll.nbytes] for ll in layout.layers]
        self._done = [threading.Event() for _ in layout.layers]
        self._err: BaseException | None = None

        def read():
            try:
                for ll, view, ev in zip(layout.layers, self._views, self._done):
                    read_exact(fd, view, base + ll.offset)
                    ev.set()
            except BaseException as e:
                self._err = e
            finally:
                os.close(fd)
                for ev in self._done:
                    ev.set()

        if reader is None or layout.data_nbytes < STREAM_MIN:
            read()
        else:
            reader.submit(read)

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int):
        self._done[i].wait()
        if self._err is not None:  # the entry is bad (e.g. truncated under us): refuse all of it
            raise self._err
        return self._views[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


# ---- temp files and the directory scan ---------------------------------------------------------


def tmp_name(key: str) -> str:
    """Name of an in-flight write of ``key``: it says which host and process is writing it."""
    return f".tmp-{key}-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    except (OverflowError, ValueError):
        return False
    return True


def tmp_is_orphan(name: str, mtime: float, now: float) -> bool:
    """Nobody will finish this temp file: its writer on this host is dead (swept right away), or it
    is older than TMP_STALE_S (other hosts' writers, names of older versions, reused pids)."""
    if now - mtime > TMP_STALE_S:
        return True
    m = _TMP_RE.fullmatch(name)
    return m is not None and m["host"] == HOST and not _pid_alive(int(m["pid"]))


def scan_objects(objects: Path, cached: dict[str, list], trust_cached: bool,
                 sweep: bool = True) -> tuple[dict[str, list], int]:
    """(key -> [nbytes, last access], bytes of live temp files) from the directory, deleting
    orphaned temp files (``sweep``). Entries in ``cached`` keep their size (and, with
    ``trust_cached``, their access time); others are stat-ed. Files whose name is not a key are
    not entries (``foreign_files``)."""
    index: dict[str, list] = {}
    tmp_bytes, now = 0, time.time()
    for sub in os.scandir(objects):
        if not sub.is_dir():
            continue
        for de in os.scandir(sub.path):
            name = de.name
            if name.startswith(".tmp-"):
                try:
                    st = de.stat()
                    if sweep and tmp_is_orphan(name, st.st_mtime, now):
                        os.unlink(de.path)
                    else:
                        tmp_bytes += st.st_size  # a live write: it counts toward the budget
                except OSError:
                    pass
                continue
            if not name.endswith(SUFFIX) or not is_key(name[: -len(SUFFIX)]):
                continue
            key = name[: -len(SUFFIX)]
            if key in cached and trust_cached:
                index[key] = cached[key]
                continue
            try:
                st = de.stat()
            except FileNotFoundError:
                continue
            index[key] = [st.st_size, max(st.st_mtime, cached.get(key, [0, 0.0])[1])]
    return index, tmp_bytes


def foreign_files(objects: Path) -> list[str]:
    """Files under ``objects/<xx>/`` that are neither entries nor temp files (relative paths)."""
    out = []
    for sub in sorted(os.scandir(objects), key=lambda d: d.name):
        if sub.is_dir():
            for de in sorted(os.scandir(sub.path), key=lambda d: d.name):
                if not de.name.startswith(".tmp-") and not (de.name.endswith(SUFFIX) and is_key(de.name[: -len(SUFFIX)])):
                    out.append(f"objects/{sub.name}/{de.name}")
    return out


def load_index(path: Path) -> dict[str, list]:
    """The index file's entries; {} when lost or unreadable (rebuilt by the scan)."""
    try:
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and doc.get("version") == 1 and isinstance(doc.get("entries"), dict):
            return {k: [int(v[0]), float(v[1])] for k, v in doc["entries"].items()
                    if isinstance(v, list) and len(v) == 2}
    except (OSError, ValueError, TypeError):
        pass
    return {}


def save_index(path: Path, entries: dict[str, list], mode: int) -> None:
    tmp = path.with_name(f".index-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = create(tmp, mode)
    try:
        write_all(fd, json.dumps({"version": 1, "entries": entries}, separators=(",", ":")).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


# ---- modes: owner-only unless the store's mode shares with a group ----------------------------


def check_mode(mode: int) -> int:
    """A store's file mode: permission bits within 0o666, owner read+write. Directories get the
    matching x bits (``dir_mode``)."""
    if isinstance(mode, bool) or not isinstance(mode, int) or mode & ~0o777:
        raise ValueError(f"file mode {mode!r}: only permission bits within 0o666 are allowed")
    if mode & 0o111:
        raise ValueError(f"file mode {mode:#o}: no execute bits, it is a file mode (directories get them)")
    if mode & 0o600 != 0o600:
        raise ValueError(f"file mode {mode:#o}: the owner must be able to read and write (0o600)")
    return mode


def dir_mode(mode: int) -> int:
    """0o600 -> 0o700, 0o640 -> 0o750, 0o660 -> 0o770: x wherever r."""
    return mode | (mode & 0o444) >> 2


def create(path: Path, mode: int, exclusive: bool = True) -> int:
    """Open a new file for writing with exactly ``mode`` (whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else 0), mode)
    os.fchmod(fd, mode)
    return fd


def makedirs(path: Path, mode: int) -> None:
    """``mkdir -p`` whose new directories get exactly ``dir_mode(mode)``; existing ones are kept."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # another process made it: keep its mode
            continue
        os.chmod(d, dir_mode(mode))


# ---- entry files and the lock --------------------------------------------------------------------


def read_header(fd: int, key: str) -> tuple[bytes, Layout, int]:
    """The validated header of an open entry file, its layout, and the file size, which must be
    the header's total (CorruptEntry otherwise: a truncated file)."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, min(size, _HEAD_READ), 0)
    n = header_nbytes(head)
    if n > len(head):
        head += os.pread(fd, n - len(head), len(head))
    header = head[:n]
    _meta, layout = decode_header(header, key)
    if size != layout.total_nbytes:
        raise CorruptEntry(f"file is {size} bytes, header says {layout.total_nbytes}")
    return header, layout, size


@contextmanager
def flock(path: Path, mode: int, create: bool = True):
    """The store's exclusive fcntl lock (the lock file is created with ``mode``). ``create=False``:
    a shared lock on the lock file if there is one (readers that write nothing), else no lock."""
    if not create:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        os.fchmod(fd, mode)
    except FileExistsError:
        fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
