"""The write path (ragkv.precompute, `ragkv precompute`): reading sources, idempotence, keys equal to
the read path's, shards, kill -9 + restart, Redis. Plumbing tests use a tiny random model with
SmolLM2's tokenizer (``tiny_smollm2``); one end-to-end test runs the real SmolLM2."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis_server import start_or_skip

from ragkv.blend import BlendEngine
from ragkv.chunking import chunk_document
from ragkv.cli import main
from ragkv.keys import KEY_PREFIX
from ragkv.policy import PrecomputePolicy, StorageFormat
from ragkv.precompute import key_shard, parse_shard, precompute
from ragkv.prefill import Prefiller
from ragkv.sources import Report, read_documents
from ragkv.store import open_store

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "examples" / "data" / "docs").glob("*.md"))
JSONL = (
    '{"text": "Tea is brewed from the leaves of Camellia sinensis."}\n'
    "not json\n"
    '{"nope": 1}\n'
    '{"text": "Rivers carry boats and sediment to the sea."}\n'
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "sub").mkdir()
    for i, p in enumerate(DOCS):
        ((d / "sub") if i % 2 else d).joinpath(p.name).write_text(p.read_text())
    (d / "blob.txt").write_bytes(b"\x89PNG\x00\x01\x02\x03" * 10)
    (d / "empty.md").write_text("")
    (d / "latin1.txt").write_bytes("café crème, très bien".encode("latin-1"))
    (d / "more.jsonl").write_text(JSONL)
    return d


def _chunk_texts(tok, paths, chunk_tokens):
    from ragkv.prompt import PromptTemplate

    tpl = PromptTemplate.for_tokenizer(tok)
    texts = [p.read_text() for p in paths]
    return [c for t in texts for c in chunk_document(t, tpl, chunk_tokens)]


def _cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r, (json.loads(r.stdout) if "--json" in args and r.stdout.strip() else None)


# ----------------------------------------------------------------------------- fast, no model


def test_parse_shard():
    assert parse_shard("1/4") == (1, 4) and parse_shard(None) is None and parse_shard((0, 1)) == (0, 1)
    for bad in ("4/4", "x", "1/0", "-1/3", "1/2/3", ""):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_key_shard_stable():
    key = KEY_PREFIX + "0" * 62 + "0b"
    assert key_shard(key, 4) == 11 % 4 and key_shard(key, 1) == 0


def test_read_documents_reports_bad_files(corpus):
    s = Report()
    docs = read_documents([corpus, corpus / "missing.md"], ["an inline text", "  "], s)
    names = {Path(d.split(":")[0]).name for d, _ in docs if not d.startswith("<")}
    assert names == {p.name for p in DOCS} | {"more.jsonl"}
    assert len(docs) == len(DOCS) + 2 + 1  # 4 files, 2 good .jsonl lines, 1 inline text
    reasons = {Path(f["path"]).name: f["reason"] for f in s.files_skipped}
    assert reasons["blob.txt"].startswith("binary") and reasons["empty.md"] == "empty"
    assert reasons["latin1.txt"].startswith("not UTF-8") and "no such file" in reasons["missing.md"]
    assert [b["line"] for b in s.bad_lines] == [2, 3]


def test_only_regular_files_are_read_and_folder_links_are_reported(tmp_path):
    """A FIFO named like a document made the job wait forever; a device was read like a file; a
    symlinked folder was skipped without a word."""
    import threading

    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    corpus.mkdir()
    elsewhere.mkdir()
    (corpus / "good.md").write_text("A document about lighthouses.")
    (elsewhere / "other.md").write_text("A document about bread.")
    os.mkfifo(corpus / "pipe.txt")
    (corpus / "null.md").symlink_to("/dev/null")  # a character device
    (corpus / "alias.md").symlink_to(elsewhere / "other.md")  # a link to a file is read
    (corpus / "linked").symlink_to(elsewhere, target_is_directory=True)
    out, report = [], Report()
    t = threading.Thread(target=lambda: out.extend(read_documents([corpus], report=report)), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # the old reader blocks in open(): let it go, then fail
        os.close(os.open(corpus / "pipe.txt", os.O_WRONLY | os.O_NONBLOCK))
        t.join(30)
        pytest.fail("read_documents waited on a FIFO")
    assert sorted(Path(d).name for d, _ in out) == ["alias.md", "good.md"]
    reasons = {Path(f["path"]).name: f["reason"] for f in report.files_skipped}
    assert reasons["pipe.txt"] == "not a regular file (a FIFO): skipped"
    assert reasons["null.md"] == "not a regular file (a character device): skipped"
    assert reasons["linked"].startswith("symbolic link to a folder: not followed")
    assert len(reasons) == 3


def test_a_jsonl_line_with_a_lone_surrogate_is_reported_with_its_line(tmp_path, tiny_smollm2_dir):
    """JSON may escape a lone surrogate (\\ud800); such a line reached the tokenizer (a TypeError)."""
    (tmp_path / "d.jsonl").write_text('{"text": "Tea is brewed from leaves."}\n{"text": "bad \\ud800 text"}\n'
                                      '{"text": "Rivers carry boats."}\n')
    report = Report()
    docs = read_documents([tmp_path / "d.jsonl"], report=report)
    assert [d for d, _ in docs] == [f"{tmp_path / 'd.jsonl'}:1", f"{tmp_path / 'd.jsonl'}:3"]
    assert report.bad_lines == [{"path": str(tmp_path / "d.jsonl"), "line": 2,
                                 "reason": '"text" holds a lone surrogate (\\ud800) at character 4, not valid Unicode'}]
    r = CliRunner().invoke(main, ["precompute", str(tmp_path / "d.jsonl"), "--store", "memory", "--model",
                                  str(tiny_smollm2_dir), "--no-progress", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["docs"] == 2 and summary["failed"] == 0 and summary["bad_lines"][0]["line"] == 2
    assert "d.jsonl:2" in r.stderr and "surrogate" in r.stderr


# ----------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_cli_disk_idempotent_stats_and_engine_keys(corpus, tmp_path, smollm2):
    uri = f"disk://{tmp_path / 'store'}"
    r, first = _cli("precompute", corpus, "--store", uri, "--chunk-tokens", 256, "--json")
    assert r.exit_code == 0, r.output
    assert first["docs"] == len(DOCS) + 2 and first["failed"] == 0 and first["skipped"] == 0
    # two entries per chunk: its gap/context entry and its lead entry (PrecomputePolicy.lead)
    assert first["new"] == 2 * first["chunks"] and first["chunks"] > len(DOCS) and first["bytes_written"] > 0
    assert first["tokens_per_s"] > 0 and len(first["files_skipped"]) == 3
    assert "tokens/s" in r.stderr  # the summary (and the progress bar) go to stderr

    r, second = _cli("precompute", corpus, "--store", uri, "--chunk-tokens", 256, "--json")
    assert r.exit_code == 0 and second["new"] == 0 and second["skipped"] == first["new"]
    assert second["bytes_written"] == 0

    r, st = _cli("stats", "--store", uri, "--json")
    assert st["tiers"][0]["entries"] == first["new"]

    # the read path finds every chunk the job wrote: 0 misses
    model, tok = smollm2
    texts = _chunk_texts(tok, DOCS, 256)
    with open_store(uri) as store:
        engine = BlendEngine(model, tok, store)
        assert {k for t in texts for k, _ in engine.keys.entry_keys(engine.template.chunk_ids(t))} <= set(store.keys())
        res = engine.prefill("What is this about?", texts[:3])
        assert res.stats.misses == 0 and res.stats.hits == 3


def test_shards_cover_every_chunk_once(tiny_smollm2):
    model, tok = tiny_smollm2
    texts = [p.read_text() for p in DOCS[:2]]
    halves = []
    for i in range(2):
        store = open_store("memory")
        engine = BlendEngine(model, tok, store, storage=StorageFormat("int8"))
        s = precompute(engine.prefiller, texts=texts, chunk_tokens=96, shard=f"{i}/2")
        assert s.failed == 0 and s.new == 2 * s.chunks == len(list(store.keys()))
        halves.append(set(store.keys()))
    engine = BlendEngine(model, tok, open_store("memory"))
    every = {k for c in _chunk_texts(tok, DOCS[:2], 96) for k, _ in engine.keys.entry_keys(engine.template.chunk_ids(c))}
    assert halves[0] and halves[1] and not halves[0] & halves[1]
    assert halves[0] | halves[1] == every


@pytest.mark.slow
def test_kill9_mid_run_then_rerun(corpus, tmp_path, smollm2):
    root = tmp_path / "store"
    cmd = [sys.executable, "-m", "ragkv.cli", "precompute", str(corpus), "--store", f"disk://{root}",
           "--chunk-tokens", "64", "--batch-tokens", "256", "--no-progress"]  # small batches: many writes
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(root.glob("objects/*/*.kv")):
            assert proc.poll() is None, "the job ended before it could be killed"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    model, tok = smollm2
    with open_store(f"disk://{root}") as store:
        before = len(list(store.keys()))
        s = precompute(Prefiller(model, tok, store), paths=[corpus], chunk_tokens=64)
        assert s.failed == 0 and s.skipped >= before >= 1 and s.new >= 1
        keys = list(store.keys())
        assert len(keys) == 2 * s.chunks  # each chunk's gap/context and lead entries
        assert all(store.get(k) is not None for k in keys)
        assert store.stats()["corruptions"] == 0


def test_failed_writes_are_counted_not_fatal(tiny_smollm2):
    from ragkv.store import StoreError
    from ragkv.store.memory import MemoryStore

    class Broken(MemoryStore):
        def _store(self, key, enc, layout, owned):
            raise StoreError("disk on fire")

    model, tok = tiny_smollm2
    engine = BlendEngine(model, tok, Broken(), policy=PrecomputePolicy(lead=False))  # one entry per chunk
    s = precompute(engine.prefiller, texts=["A short note about lighthouses.", "Another one."])
    assert s.chunks == 2 and s.failed == 2 and s.new == 0 and "disk on fire" in s.errors[0]
    assert s.stopped is None  # two failures in a row do not stop a job


# ----------------------------------------------------------------------------- redis


def _redis_url() -> str:
    """127.0.0.1:6379 (db 9), else a redis-server of our own; no redis: skip, or FAIL under CI."""
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return "redis://127.0.0.1:6379/9"
    except OSError:
        pass
    srv = start_or_skip()
    _SERVERS.append(srv)
    return srv.url


_SERVERS: list = []


@pytest.fixture
def redis_uri():
    ns = f"ragkv-test-{uuid.uuid4().hex[:10]}:"
    uri = f"{_redis_url()}?namespace={ns}"
    yield uri, ns
    with open_store(uri) as store:
        store.clear()
    while _SERVERS:
        _SERVERS.pop().stop()


@pytest.mark.slow
@pytest.mark.redis
def test_cli_redis_twice(redis_uri, tmp_path, smollm2):
    uri, ns = redis_uri
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / DOCS[0].name).write_text(DOCS[0].read_text())
    args = ("precompute", tmp_path / "d", "--store", uri, "--namespace", ns, "--chunk-tokens", 128, "--json")
    r, first = _cli(*args)
    assert r.exit_code == 0, r.output
    assert first["new"] == 2 * first["chunks"] and first["chunks"] >= 2 and first["failed"] == 0
    r, second = _cli(*args)
    assert second["new"] == 0 and second["skipped"] == first["new"]
    r, st = _cli("stats", "--store", uri, "--json")
    assert st["tiers"][0]["entries"] == first["new"]
    model, tok = smollm2
    with open_store(uri) as store:
        engine = BlendEngine(model, tok, store, namespace=ns)
        texts = _chunk_texts(tok, DOCS[:1], 128)
        keys = [k for t in texts for k, _ in engine.keys.entry_keys(engine.template.chunk_ids(t))]
        assert set(keys) == set(store.keys()) and all(store.get(k) is not None for k in keys)


# ----------------------------------------------------------------------------- trust: inputs, budget, failures


def test_paths_and_texts_are_separate_arguments(tiny_smollm2, tmp_path):
    model, tok = tiny_smollm2
    engine = BlendEngine(model, tok, open_store("memory"))
    with pytest.raises(TypeError, match="paths and texts are lists"):
        precompute(engine.prefiller, str(tmp_path))  # a bare string was once indexed as the literal text "/tmp/..."
    (tmp_path / "a.md").write_text("A document about lighthouses and their keepers.")
    s = precompute(engine.prefiller, paths=[str(tmp_path)], texts=["An inline document about bread."])
    assert s.docs == 2 and s.chunks == 2 and s.new == 4 and s.failed == 0


@pytest.mark.parametrize("setup", ["missing", "empty dir", "binary only"])
def test_a_run_that_read_nothing_exits_non_zero(tmp_path, tiny_smollm2_dir, setup):
    src = tmp_path / "src"
    if setup != "missing":
        src.mkdir()
    if setup == "binary only":
        (src / "x.txt").write_bytes(b"\x00\x01\x02" * 50)
    r = CliRunner().invoke(main, ["precompute", str(src), "--store", f"disk://{tmp_path / 's'}", "--model",
                                  str(tiny_smollm2_dir), "--no-progress", "--json"])
    assert r.exit_code == 2, r.output
    assert "no document could be read" in r.stderr and "Traceback" not in r.output


def test_a_corpus_over_the_store_budget_is_refused_before_computing(tmp_path, tiny_smollm2_dir, tiny_smollm2):
    from ragkv.precompute import OverBudget

    model, tok = tiny_smollm2
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i}.md").write_text(f"Document {i}. " + f"Some words about topic {i}. " * 60)
    engine = BlendEngine(model, tok, open_store(f"disk://{tmp_path / 's'}?max_bytes=1M"))
    with pytest.raises(OverBudget, match=r"would write ~.* holds at most 1.0 MiB.*--dtype int8"):
        precompute(engine.prefiller, paths=[docs], chunk_tokens=256)
    assert list(engine.store.keys()) == []  # refused before any compute or write
    r = CliRunner().invoke(main, ["precompute", str(docs), "--store", f"disk://{tmp_path / 's'}?max_bytes=1M",
                                  "--model", str(tiny_smollm2_dir), "--no-progress", "--chunk-tokens", "256"])
    assert r.exit_code == 2 and "holds at most" in r.stderr
    r = CliRunner().invoke(main, ["precompute", str(docs), "--store", f"disk://{tmp_path / 's'}?max_bytes=1M",
                                  "--model", str(tiny_smollm2_dir), "--no-progress", "--chunk-tokens", "256",
                                  "--json"])
    assert r.exit_code == 2 and "holds at most" in r.stderr
    refused = json.loads(r.stdout)  # --json prints JSON on this exit too, like the others
    assert "holds at most" in refused["error"] and refused["docs"] == 40 and refused["planned_bytes"] > 1 << 20
    assert refused["new"] == 0 and refused["bytes_written"] == 0
    r = CliRunner().invoke(main, ["precompute", str(docs), "--store", f"disk://{tmp_path / 's'}?max_bytes=1M",
                                  "--model", str(tiny_smollm2_dir), "--no-progress", "--chunk-tokens", "256",
                                  "--allow-eviction"])
    assert r.exit_code == 0, r.output


def test_repeated_write_failures_stop_the_job_with_what_was_saved(tiny_smollm2):
    import errno

    from ragkv.store import StoreFull
    from ragkv.store.memory import MemoryStore

    class FillsUp(MemoryStore):
        """Takes 2 entries, then every write fails with ENOSPC (a full disk)."""

        def _store(self, key, enc, layout, owned):
            if len(self._d) >= 2:
                raise StoreFull("no space left on device") from OSError(errno.ENOSPC, "No space left on device")
            return super()._store(key, enc, layout, owned)

    model, tok = tiny_smollm2
    texts = [f"Note number {i} is about a different thing entirely, number {i}." for i in range(30)]
    s = precompute(Prefiller(model, tok, FillsUp()), texts=texts, batch_tokens=64)
    assert s.new == 2 and s.failed == 3  # stopped after three failures in a row, 25 never attempted
    assert "3 writes in a row failed with StoreFull" in s.stopped and "rerun the same command" in s.stopped
    assert "STOPPED" in s.describe()


def test_planning_shows_progress_before_any_compute(tiny_smollm2, capsys):
    model, tok = tiny_smollm2
    text = "\n\n".join(f"Paragraph {i} says something about item {i}." for i in range(400))
    precompute(Prefiller(model, tok, open_store("memory")), texts=[text], chunk_tokens=64, progress=True)
    err = capsys.readouterr().err
    assert "planning" in err and err.index("planning") < err.index("precompute")


def test_rerun_fills_every_tier_that_lacks_an_entry(tiny_smollm2, tmp_path):
    """After one tier lost its entries (a Redis restarted empty, a wiped cache disk), a rerun used to
    skip everything because *some* tier held each chunk; a truncated file also counted as present."""
    model, tok = tiny_smollm2
    texts = [f"Document {i} tells the story of item {i} in a few words." for i in range(6)]
    uri = f"disk://{tmp_path / 'a'},disk://{tmp_path / 'b'}"
    with open_store(uri) as store:
        first = precompute(Prefiller(model, tok, store), texts=texts)
        assert first.new == 12  # 6 chunks, each with its lead entry
    with open_store(f"disk://{tmp_path / 'b'}") as b:  # tier b loses everything ...
        b.clear()
    with open_store(f"disk://{tmp_path / 'a'}") as a:  # ... and one file of tier a is cut short
        victim = sorted(a.keys())[0]
        p = a.path(victim)
        p.write_bytes(p.read_bytes()[:100])
    with open_store(uri) as store:
        again = precompute(Prefiller(model, tok, store), texts=texts)
        assert (again.skipped, again.repaired, again.new, again.failed) == (0, 11, 1, 0)
        keys = list(store.keys())
        assert len(keys) == 12 and all(not store.missing_tiers(k) for k in keys)
        assert precompute(Prefiller(model, tok, store), texts=texts).skipped == 12


def test_unreadable_subdirectory_is_reported(tmp_path, monkeypatch):
    (tmp_path / "ok.md").write_text("A readable document.")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "hidden.md").write_text("Nobody may read this.")
    (tmp_path / "secret").chmod(0)
    if os.access(tmp_path / "secret", os.R_OK):  # root reads anything: make os.walk meet the error it would
        real = os.walk

        def walk(top, onerror=None, **kw):
            for root, dirs, files in real(top, onerror=onerror, **kw):
                if root.endswith("secret"):
                    onerror(PermissionError(13, "Permission denied", root))
                    continue
                yield root, dirs, files

        monkeypatch.setattr(os, "walk", walk)
    try:
        report = Report()
        docs = read_documents([tmp_path], [], report)
    finally:
        (tmp_path / "secret").chmod(0o700)
    assert [Path(d).name for d, _ in docs] == ["ok.md"]
    assert any(f["path"].endswith("secret") and "unreadable directory" in f["reason"] for f in report.files_skipped)
