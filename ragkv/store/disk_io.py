"""Low-level file I/O of the disk store: exact positional reads, full writes, and the streamed
whole-entry read that overlaps reading with checksum verification."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from ragkv.store.entry import Layout
from ragkv.store.errors import CorruptEntry

if TYPE_CHECKING:
    from ragkv.store.disk import DiskStore

STREAM_MIN = 4 << 20  # smaller entries are read in the caller's thread


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

    def __init__(self, store: DiskStore, fd: int, layout: Layout):
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

        if not store.parallel_read or layout.data_nbytes < STREAM_MIN:
            read()
        else:
            store._reader().submit(read)

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, i: int):
        self._done[i].wait()
        if self._err is not None:  # the entry is bad (e.g. truncated under us): refuse all of it
            raise self._err
        return self._views[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))
