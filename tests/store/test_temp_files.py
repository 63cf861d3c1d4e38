"""Temp files of interrupted writes: swept as soon as their writer is known dead, counted while live."""

import os
import re
import socket
import subprocess
import sys
import threading
import time

from store_testlib import make_entry

from ragkv.store.disk import DiskStore
from ragkv.store.entry import encode

_KILLED_WRITER = """
import os, signal, sys
import ragkv.store.disk as disk
from store_testlib import make_entry
real, calls = disk._write_all, []
def write_then_die(fd, data):
    calls.append(1)
    if len(calls) == 4:  # header, padding and layer 0 are written: kill -9 mid-entry
        os.kill(os.getpid(), signal.SIGKILL)
    real(fd, data)
disk._write_all = write_then_die
disk.DiskStore(sys.argv[1], fsync=False).put(*make_entry(seed=int(sys.argv[2])))
"""


def _temps(root) -> list:
    return sorted((root / "objects").rglob(".tmp-*"))


def _kill_a_writer_mid_entry(root, seed=0) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(root), str(seed)], env=env)
    assert p.wait(60) == -9
    return p.pid


def test_temp_file_of_a_killed_writer_is_swept_at_the_next_open(tmp_path):
    root = tmp_path / "kv"
    DiskStore(root, fsync=False).close()
    pid = _kill_a_writer_mid_entry(root)
    (orphan,) = _temps(root)
    meta, layers = make_entry(seed=0)
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())  # '-' separates the name's fields
    assert re.fullmatch(rf"\.tmp-{meta.key}-{re.escape(host)}-{pid}-[0-9a-f]+", orphan.name), orphan.name
    s = DiskStore(root, fsync=False)  # a rerun: the writer's pid is dead on this host
    assert _temps(root) == []
    assert s.put(meta, layers) and s.get(meta.key) is not None


def test_temp_file_of_a_killed_writer_is_swept_at_evict(tmp_path):
    root = tmp_path / "kv"
    s = DiskStore(root, fsync=False)
    _kill_a_writer_mid_entry(root, seed=1)
    assert len(_temps(root)) == 1
    s.evict()
    assert _temps(root) == []


def test_temp_files_of_other_hosts_wait_for_the_stale_age(tmp_path):
    s = DiskStore(tmp_path / "kv", fsync=False)
    meta, layers = make_entry()
    s.put(meta, layers)
    d = s.path(meta.key).parent
    fresh, stale = d / f".tmp-{meta.key}-otherhost-123-0123abcd", d / f".tmp-{meta.key}-otherhost-124-4567abcd"
    fresh.write_bytes(b"x" * 100)
    stale.write_bytes(b"x" * 100)
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    s.evict()
    assert fresh.exists() and not stale.exists()


def test_live_temp_files_count_toward_the_budget(tmp_path, monkeypatch):
    import ragkv.store.disk as disk

    root = tmp_path / "kv"
    writer = DiskStore(root, max_bytes=None, fsync=False)
    small = [make_entry(seed=s) for s in (1, 2)]
    for meta, layers in small:
        writer.put(meta, layers)
    entry_bytes = writer.stats()["bytes"]
    release, real, calls = threading.Event(), disk._write_all, []

    def slow_write(fd, data):
        calls.append(1)
        if len(calls) == 4:  # header, padding and layer 0 of the big entry are on disk
            release.wait(30)
        real(fd, data)

    monkeypatch.setattr(disk, "_write_all", slow_write)
    big, big_layers = make_entry(seed=9, n_tokens=256)
    t = threading.Thread(target=writer.put, args=(big, big_layers))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not (calls[3:] and _temps(root)) and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp,) = _temps(root)
        assert tmp.stat().st_size > len(encode(big, big_layers).blobs[0])  # layer 0 is written
        # entries alone fit; with the live temp file they fit once one entry (of two) is gone
        other = DiskStore(root, max_bytes=entry_bytes + tmp.stat().st_size - entry_bytes // 4, fsync=False)
        assert other.evict() == 1
        assert other.stats()["tmp_bytes"] == tmp.stat().st_size
        assert tmp.exists()  # a live writer's file is never swept
    finally:
        release.set()
        t.join(30)
    assert writer.get(big.key) is not None
