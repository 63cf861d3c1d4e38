"""Disk store files are owner-only unless the URI's ``mode`` shares them with a group."""

import os
import stat
import threading
import time

import pytest
from store_testlib import make_entry

from ragkv.store import open_store
from ragkv.store.disk import DiskStore


def _modes(root) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.stat().st_mode)
    return out


def _check(root, fmode, dmode):
    modes = _modes(root)
    files = {n for n in modes if (root / n).is_file()}
    assert {n for n in files if n.endswith(".kv")} and {"index.json", ".lock"} <= files
    assert {n: oct(m) for n, m in modes.items() if (root / n).is_file() and m != fmode} == {}
    assert {n: oct(m) for n, m in modes.items() if (root / n).is_dir() and m != dmode} == {}


@pytest.fixture
def loose_umask():
    old = os.umask(0o002)  # a permissive umask must not loosen the store's modes
    yield
    os.umask(old)


def test_default_files_0600_and_directories_0700(tmp_path, loose_umask):
    root = tmp_path / "kv"
    s = DiskStore(root, fsync=False)
    for seed in range(3):
        s.put(*make_entry(seed=seed))
    s.close()
    _check(root, 0o600, 0o700)


def test_mode_option_shares_with_a_group(tmp_path, loose_umask):
    root = tmp_path / "kv"
    s = open_store(f"disk://{root}?mode=0640")
    assert s.mode == 0o640 and "mode=0640" in s.uri
    for seed in range(3):
        s.put(*make_entry(seed=seed))
    s.close()
    _check(root, 0o640, 0o750)


def test_temp_files_are_owner_only_while_being_written(tmp_path, monkeypatch, loose_umask):
    import ragkv.store.disk as disk

    s = DiskStore(tmp_path / "kv", fsync=False)
    release, seen, real = threading.Event(), [], disk._write_all

    def slow_write(fd, data):
        if not seen:
            seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
            release.wait(30)
        real(fd, data)

    monkeypatch.setattr(disk, "_write_all", slow_write)
    t = threading.Thread(target=s.put, args=make_entry())
    t.start()
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    t.join(30)
    assert seen == [0o600]


@pytest.mark.parametrize(
    "mode,match",
    [("644x", "octal"), ("0400", "owner"), ("0200", "owner"), ("0755", "execute"), ("04600", "0o666"), ("", "octal")],
)
def test_bad_mode_is_refused(tmp_path, mode, match):
    with pytest.raises(ValueError, match=match):
        open_store(f"disk://{tmp_path / 'kv'}?mode={mode}")
    assert not (tmp_path / "kv").exists()
