"""`ragkv stats / clear / evict` and the precompute command's argument checks (no model needed)."""

from __future__ import annotations

import json
import os
import re
import time
import uuid

import pytest
import torch
from click.testing import CliRunner
from redis_server import SECRET, SECRET_TAIL, free_port, start_or_skip

from ragkv.cli import main
from ragkv.keys import chunk_key
from ragkv.store import EntryMeta, open_store


@pytest.fixture(scope="module")
def redis_server():
    srv = start_or_skip()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def redis_auth_server():
    srv = start_or_skip(password=SECRET)
    yield srv
    srv.stop()


@pytest.fixture
def redis_ns():
    return f"cli-{uuid.uuid4().hex[:10]}"


def _put(store, n: int, tokens: int = 32) -> list[str]:
    keys = []
    for i in range(n):
        ids = list(range(i * 1000, i * 1000 + tokens))
        key = chunk_key("fp-cli", ids, "sink-test")
        meta = EntryMeta(key=key, token_ids=ids, start_pos=0, num_layers=2, num_kv_heads=2, head_dim=8,
                         model_dtype="float32", storage_dtype="float32", quant_axis=None,
                         fingerprint="fp-cli", policy="sink-test")
        kv = [(torch.randn(2, tokens, 8), torch.randn(2, tokens, 8)) for _ in range(2)]
        assert store.put(meta, kv)
        keys.append(key)
    return keys


def _invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


@pytest.fixture
def disk_uri(tmp_path):
    uri = f"disk://{tmp_path / 'store'}"
    with open_store(uri) as s:
        _put(s, 3)
    return uri


def test_stats_json_and_table(disk_uri):
    r = _invoke("stats", "--store", disk_uri, "--json")
    assert r.exit_code == 0, r.output
    tiers = json.loads(r.stdout)["tiers"]
    assert len(tiers) == 1 and tiers[0]["entries"] == 3 and tiers[0]["bytes"] > 3 * 2 * 2 * 32 * 8 * 4
    for field in ("uri", "hits", "misses", "corruptions"):
        assert field in tiers[0]
    r = _invoke("stats", "--store", disk_uri)
    assert r.exit_code == 0 and "entries" in r.stdout and disk_uri.removeprefix("disk://") in r.stdout


def test_stats_tiers(disk_uri):
    r = _invoke("stats", "--store", f"memory,{disk_uri}", "--json")
    tiers = json.loads(r.stdout)["tiers"]
    assert [t["entries"] for t in tiers] == [0, 3]
    assert tiers[0]["uri"].startswith("memory")


def test_clear_asks_then_clears(disk_uri):
    r = _invoke("clear", "--store", disk_uri, input="n\n")
    assert r.exit_code == 1  # aborted
    assert json.loads(_invoke("stats", "--store", disk_uri, "--json").stdout)["tiers"][0]["entries"] == 3
    r = _invoke("clear", "--store", disk_uri, "--yes")
    assert r.exit_code == 0 and "cleared 3" in r.stderr
    assert json.loads(_invoke("stats", "--store", disk_uri, "--json").stdout)["tiers"][0]["entries"] == 0


@pytest.fixture
def big_disk_uri(tmp_path):
    """3 entries of ~0.5 MiB each (eviction budgets start at 1 MiB)."""
    uri = f"disk://{tmp_path / 'big'}"
    with open_store(uri) as s:
        _put(s, 3, tokens=2048)
    return uri


def _entries(uri) -> int:
    return json.loads(_invoke("stats", "--store", uri, "--json").stdout)["tiers"][0]["entries"]


def test_evict_to_size(big_disk_uri):
    r = _invoke("evict", "--store", big_disk_uri, "--max-bytes", "1M", "--yes")  # entries ~ 0.5 MiB each
    assert r.exit_code == 0 and "evicted 2" in r.stderr
    assert _entries(big_disk_uri) == 1
    assert _invoke("evict", "--store", big_disk_uri, "--max-bytes", "lots").exit_code == 2


def test_evict_asks_first_showing_what_it_would_delete(big_disk_uri):
    total = json.loads(_invoke("stats", "--store", big_disk_uri, "--json").stdout)["tiers"][0]["bytes"]
    r = _invoke("evict", "--store", big_disk_uri, "--max-bytes", "1M", input="n\n")
    assert r.exit_code == 1 and "Aborted" in r.output
    assert re.search(r"evict 2 entries \((\d+) bytes\)", r.output), r.output
    assert int(re.search(r"\((\d+) bytes\)", r.output).group(1)) > total // 2
    assert _entries(big_disk_uri) == 3
    r = _invoke("evict", "--store", big_disk_uri, "--max-bytes", "1M", input="y\n")
    assert r.exit_code == 0 and _entries(big_disk_uri) == 1
    r = _invoke("evict", "--store", big_disk_uri, "--max-bytes", "10G")  # nothing to do: no question
    assert r.exit_code == 0 and "evicted 0" in r.stderr


@pytest.mark.parametrize("size,match", [("10", "smaller than one entry"), ("-1", "negative"), ("0", "ragkv clear")])
def test_evict_refuses_tiny_or_negative_budgets(disk_uri, size, match):
    r = _invoke("evict", "--store", disk_uri, "--max-bytes", size)  # refused before any question
    assert r.exit_code == 2 and match in r.output, r.output
    assert _entries(disk_uri) == 3


def test_disk_uri_with_a_tiny_budget_is_refused(disk_uri):
    r = _invoke("stats", "--store", disk_uri + "?max_bytes=10")
    assert r.exit_code == 2 and "did you mean 10G" in r.output
    assert _entries(disk_uri) == 3


def test_disk_path_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    for cmd in ("stats", "clear", "evict"):
        extra = ["--max-bytes", "1G"] if cmd == "evict" else []
        r = _invoke(cmd, "--store", f"disk://{tmp_path / 'f'}", *extra)
        assert r.exit_code == 2 and "not a directory" in r.output, r.output


# ---- stats / clear / evict touch nothing they were not asked to ------------------------------------------


def _tree(root) -> dict:
    """Every path under ``root`` with its size and mtime (what a command may not change)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def test_stats_only_looks(disk_uri, tmp_path):
    """`ragkv stats` once created .lock, index.json and objects/ wherever it was pointed, and swept
    temp files older than an hour."""
    root = tmp_path / "store"
    (root / ".lock").unlink()
    (root / "index.json").unlink()
    sub = next((root / "objects").iterdir())
    old_tmp = sub / ".tmp-ragkv1-abc-otherhost-1234-deadbeef"
    old_tmp.write_bytes(b"x" * 100)
    os.utime(old_tmp, (time.time() - 7200, time.time() - 7200))
    before = _tree(root)
    r = _invoke("stats", "--store", disk_uri, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tiers"][0]["entries"] == 3
    assert _tree(root) == before
    home = tmp_path / "home"  # any directory, not a store
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    before = _tree(home)
    r = _invoke("stats", "--store", f"disk://{home}")
    assert r.exit_code == 1 and "not a store" in r.output and "nothing was created" in r.output, r.output
    assert _tree(home) == before


@pytest.mark.parametrize("cmd", ["stats", "clear", "evict"])
def test_a_missing_disk_store_is_an_error_and_is_not_created(tmp_path, cmd):
    extra = {"stats": [], "clear": ["--yes"], "evict": ["--max-bytes", "1G", "--yes"]}[cmd]
    missing = tmp_path / "no" / "such" / "store"
    r = _invoke(cmd, "--store", f"disk://{missing}", *extra)
    assert r.exit_code == 1 and "no such directory" in r.output and str(missing) in r.output, r.output
    assert not (tmp_path / "no").exists()


def test_clear_leaves_files_that_are_not_entries(disk_uri, tmp_path):
    """A file in objects/ whose name is not a key (`bad name.kv`) made `ragkv clear` stop half way with a
    traceback; it is no entry: clear deletes every entry and leaves it, saying so."""
    root = tmp_path / "store"
    (root / "objects" / "ab").mkdir(exist_ok=True)
    stray = root / "objects" / "ab" / "bad name.kv"
    stray.write_text("not mine to delete")
    assert _entries(disk_uri) == 3  # not an entry
    r = _invoke("clear", "--store", disk_uri, "--yes")
    assert r.exit_code == 0 and "cleared 3 entries" in r.stderr, r.output
    assert "not ragkv entries" in r.stderr and "objects/ab/bad name.kv" in r.stderr
    assert stray.read_text() == "not mine to delete" and _entries(disk_uri) == 0
    with open_store(disk_uri) as s:  # and a store holding it still writes and evicts
        _put(s, 1)
        assert s.evict(0) == 1 and stray.exists()


# ---- redis: unreachable, wrong password, secrets, namespaces ---------------------------------------------


def test_a_redis_uri_whose_database_parts_disagree_is_refused():
    """`redis://host/11?db=12` once printed db 12 and cleared db 11."""
    for cmd in (["clear", "--yes"], ["stats"]):
        r = _invoke(cmd[0], "--store", f"redis://127.0.0.1:{free_port()}/11?db=12&namespace=z", *cmd[1:])
        assert r.exit_code == 2 and "disagree" in r.output and "/11" in r.output and "db=12" in r.output, r.output
    with pytest.raises(ValueError, match="disagree"):
        open_store("memory,redis://127.0.0.1:6379/3?db=4")


@pytest.mark.redis
def test_agreeing_database_parts_work_and_disagreeing_ones_clear_nothing(redis_server, redis_ns):
    base = redis_server.url.rsplit("/", 1)[0]
    for db in (11, 12):
        with open_store(f"{base}/{db}?namespace={redis_ns}") as s:
            _put(s, 1 + db - 11)
    assert _invoke("clear", "--store", f"{base}/11?db=12&namespace={redis_ns}", "--yes").exit_code == 2
    r = _invoke("stats", "--store", f"{base}/12?db=12&namespace={redis_ns}", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["tiers"][0]["entries"] == 2
    for db, n in ((11, 1), (12, 2)):
        with open_store(f"{base}/{db}?namespace={redis_ns}") as s:
            assert len(list(s.keys())) == n
            s.clear()


def _dead_redis() -> str:
    return f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"


def test_stats_of_an_unreachable_redis_exits_1(tmp_path):
    open_store(f"disk://{tmp_path / 'kv'}").close()  # an empty disk store
    uri = f"disk://{tmp_path / 'kv'},{_dead_redis()}"
    r = _invoke("stats", "--store", uri)
    assert r.exit_code == 1 and "unavailable" in r.output, r.output
    r = _invoke("stats", "--store", uri, "--json")
    assert r.exit_code == 1
    tiers = json.loads(r.stdout)["tiers"]
    assert tiers[0]["available"] is True and tiers[0]["entries"] == 0
    assert tiers[1]["available"] is False and tiers[1]["entries"] is None and "127.0.0.1" in tiers[1]["error"]


@pytest.mark.redis
def test_stats_with_a_wrong_password_exits_1(redis_auth_server):
    r = _invoke("stats", "--store", f"redis://:nope@127.0.0.1:{redis_auth_server.port}/0")
    assert r.exit_code == 1 and "auth" in r.output and "entries 0" not in r.output, r.output


def test_clear_of_an_unreachable_redis_exits_1_without_traceback(tmp_path):
    open_store(f"disk://{tmp_path / 'kv'}").close()
    r = _invoke("clear", "--store", f"disk://{tmp_path / 'kv'},{_dead_redis()}", "--yes")
    assert r.exit_code == 1 and "Error:" in r.output and "unavailable" in r.output, r.output
    assert "Traceback" not in r.output and SECRET_TAIL not in r.output


@pytest.mark.parametrize("cmd", ["stats", "clear", "evict"])
def test_store_commands_on_an_unwritable_disk_exit_1(cmd):
    root = f"/sys/ragkv-test-{uuid.uuid4().hex[:8]}"  # sysfs: mkdir fails even for root
    try:
        os.mkdir(root)
    except OSError:
        pass
    else:  # pragma: no cover - an unusual machine
        os.rmdir(root)
        pytest.skip("/sys is writable here")
    extra = {"stats": [], "clear": ["--yes"], "evict": ["--max-bytes", "1G", "--yes"]}[cmd]
    r = _invoke(cmd, "--store", f"disk://{root}", *extra)
    assert r.exit_code == 1 and "Error:" in r.output and root in r.output, r.output


@pytest.mark.redis
def test_cli_never_prints_the_password(redis_auth_server, redis_ns):
    for uri in (
        f"redis://:{SECRET}@127.0.0.1:{redis_auth_server.port}/0?namespace={redis_ns}",
        f"memory,redis://127.0.0.1:{redis_auth_server.port}/0?password={SECRET}&namespace={redis_ns}",
    ):
        with open_store(uri) as s:
            _put(s, 2)
        outs = [_invoke("stats", "--store", uri), _invoke("stats", "--store", uri, "--json"),
                _invoke("evict", "--store", uri, "--max-bytes", "1G", "--yes"),
                _invoke("clear", "--store", uri, input="n\n"), _invoke("clear", "--store", uri, "--yes")]
        assert [r.exit_code for r in outs] == [0, 0, 0, 1, 0], [r.output for r in outs]
        assert "cleared 2" in outs[-1].output and "***" in outs[-1].output
        for r in outs:
            assert SECRET_TAIL not in r.output, r.output
    for cmd in ("stats", "clear"):
        r = _invoke(cmd, "--store", _dead_redis(), *(["--yes"] if cmd == "clear" else []))
        assert r.exit_code == 1 and SECRET_TAIL not in r.output, r.output
    r = _invoke("stats", "--store", f"redix://:{SECRET}@h/0")
    assert r.exit_code == 2 and SECRET_TAIL not in r.output


@pytest.mark.redis
def test_clear_with_a_glob_namespace_is_refused_and_other_tenants_survive(redis_server):
    a, b = f"{redis_server.url}?namespace=tenantA", f"{redis_server.url}?namespace=tenantB"
    for uri in (a, b):
        with open_store(uri) as s:
            s.clear()
            _put(s, 2)
    r = _invoke("clear", "--store", f"{redis_server.url}?namespace=t*", "--yes")
    assert r.exit_code == 2 and "namespace" in r.output
    for uri in (a, b):
        with open_store(uri) as s:
            assert len(list(s.keys())) == 2
            s.clear()


def test_bad_store_uri():
    r = _invoke("stats", "--store", "ftp://x")
    assert r.exit_code == 2 and "unknown store scheme" in r.output


@pytest.mark.parametrize("spec", ["2/2", "1", "a/b", "-1/2", "0/0", "1/2/3"])
def test_precompute_bad_shard(tmp_path, spec):
    r = _invoke("precompute", str(tmp_path), "--store", "memory", "--shard", spec)
    assert r.exit_code == 2 and "--shard" in r.output, r.output


def test_precompute_quant_axis_needs_int8(tmp_path):
    r = _invoke("precompute", str(tmp_path), "--store", "memory", "--quant-axis", "token")
    assert r.exit_code == 2 and "--dtype int8" in r.output


def test_stats_counts_entries_of_the_old_key_scheme_as_stale(disk_uri):
    """Entries written by ragkv <= 0.3 (ragkv1- keys, another fingerprint) are never read: stats says
    how many there are and what to do, instead of counting them as usable entries silently."""
    from dataclasses import replace

    with open_store(disk_uri) as store:  # (the fixture stored 3 entries)
        key = next(iter(store.keys()))
        meta = store.get_meta(key)
        old = "ragkv1-" + key.removeprefix("ragkv2-")
        kv = [(layer[0], layer[1]) for layer in store.get(key).layers]
        assert store.put(replace(meta, key=old), kv)
    r = _invoke("stats", "--store", disk_uri, "--json")
    (row,) = json.loads(r.stdout)["tiers"]
    assert row["entries"] == 4 and row["stale"] == 1
    r = _invoke("stats", "--store", disk_uri)
    assert "stale" in r.output and "ragkv <= 0.3" in r.output and "ragkv precompute" in r.output
