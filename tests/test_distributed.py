"""``ragkv precompute --ray`` (ragkv.distributed) on a real local Ray, writing to a real 3-master
Redis Cluster: the same keys, summary and resumability as the local job, and a reader in another
process finds every chunk. The model is the tiny random Llama with SmolLM2's tokenizer, loaded by
each actor from its directory (``tiny_smollm2_dir``)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from ragkv.cli import main
from ragkv.policy import StorageFormat
from ragkv.precompute import precompute
from ragkv.spec import EngineSpec
from ragkv.store import open_store

pytestmark = pytest.mark.redis

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "examples" / "data" / "docs"
CHUNK = 64  # small chunks: ~20 of them in examples/data/docs
SUMMARY_COUNTS = ("docs", "chunks", "new", "skipped", "repaired", "failed", "tokens")


def _same_bytes(a: int, b: int, chunks: int) -> bool:
    """Blobs are the same size; a header holds per-layer checksums as decimal numbers, and an actor
    with another torch thread count sums in another order (last-bit differences), so checksum digits
    and with them header lengths may differ by a few bytes per entry."""
    return abs(a - b) <= 8 * chunks


def _uri(cluster, ns: str) -> str:
    return f"{cluster.url}?namespace={ns}"


def _keys(uri: str) -> set[str]:
    with open_store(uri) as s:
        return set(s.keys())


def _clear(*uris: str) -> None:
    for uri in uris:
        with open_store(uri) as s:
            s.clear()


@pytest.fixture
def spaces(redis_cluster):
    """Two fresh store namespaces on the session's cluster (local job, Ray job), cleared after."""
    uid = uuid.uuid4().hex[:8]
    uris = (_uri(redis_cluster, f"local-{uid}"), _uri(redis_cluster, f"ray-{uid}"))
    yield uris
    _clear(*uris)


def test_ray_job_writes_the_local_jobs_keys_resumes_and_another_process_reads_them_all(
        ray_session, tiny_smollm2_dir, spaces):
    from ragkv.distributed import precompute_ray

    local_uri, ray_uri = spaces
    spec = EngineSpec(str(tiny_smollm2_dir), "float32", storage=StorageFormat("float16"))
    with open_store(local_uri) as store:
        local = precompute(spec.prefiller(store), paths=[DOCS], chunk_tokens=CHUNK)
    first = precompute_ray(EngineSpec(**{**spec.__dict__, "store_uri": ray_uri}), paths=[DOCS],
                           chunk_tokens=CHUNK, workers=2)
    assert local.failed == 0 and local.new == 2 * local.chunks and local.chunks > 10  # (+ lead entries)
    assert {k: getattr(first, k) for k in SUMMARY_COUNTS} == {k: getattr(local, k) for k in SUMMARY_COUNTS}
    assert _same_bytes(first.bytes_written, local.bytes_written, local.new)
    assert _keys(ray_uri) == _keys(local_uri) and len(_keys(ray_uri)) == local.new

    second = precompute_ray(EngineSpec(**{**spec.__dict__, "store_uri": ray_uri}), paths=[DOCS],
                            chunk_tokens=CHUNK, workers=1)
    assert second.new == 0 and second.skipped == local.new and second.chunks == local.chunks
    assert second.bytes_written == 0

    reader = f"""
import json, sys
from pathlib import Path
from ragkv import models
from ragkv.blend import BlendEngine
from ragkv.chunking import chunk_document
from ragkv.store import open_store
model, tok = models.load({str(tiny_smollm2_dir)!r}, dtype="float32")
store = open_store({ray_uri!r})
engine = BlendEngine(model, tok, store)
texts = [c for p in sorted(Path({str(DOCS)!r}).glob("*.md")) for c in chunk_document(p.read_text(), engine.template, {CHUNK})]
hits = misses = 0
for i in range(0, len(texts), 3):
    st = engine.prefill("What is this about?", texts[i:i + 3]).stats
    hits, misses = hits + st.hits, misses + st.misses
print(json.dumps({{"chunks": len(texts), "hits": hits, "misses": misses}}))
"""
    out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["misses"] == 0 and got["hits"] == got["chunks"] >= local.chunks


def test_cli_ray_json_and_exit_codes_match_the_local_job(ray_session, tiny_smollm2_dir, spaces):
    local_uri, ray_uri = spaces
    common = [str(DOCS), "--model", str(tiny_smollm2_dir), "--model-dtype", "float32", "--chunk-tokens", str(CHUNK),
              "--json", "--no-progress"]
    loc = CliRunner().invoke(main, ["precompute", *common, "--store", local_uri], catch_exceptions=False)
    ray = CliRunner().invoke(main, ["precompute", *common, "--store", ray_uri, "--ray", "--workers", "2"],
                             catch_exceptions=False)
    assert loc.exit_code == 0 and ray.exit_code == 0, ray.output
    a, b = json.loads(loc.stdout), json.loads(ray.stdout)
    assert a.keys() == b.keys() and {k: a[k] for k in SUMMARY_COUNTS} == {k: b[k] for k in SUMMARY_COUNTS}
    assert _same_bytes(a["bytes_written"], b["bytes_written"], a["new"])
    assert _keys(ray_uri) == _keys(local_uri)


@pytest.mark.parametrize("extra,message", [
    (["--shard", "0/2"], "--shard splits a corpus"),
    (["--store", "memory://"], "memory store lives inside one process"),
    (["--store", "disk:///tmp/ragkv-ray-bounded?max_bytes=1G"], "cannot check the corpus"),
    (["--store", "memory://,redis+cluster://127.0.0.1:1/0"], "store"),
])
def test_cli_ray_refuses_what_cannot_work_before_starting_ray(tiny_smollm2_dir, redis_cluster, extra, message):
    args = ["precompute", str(DOCS), "--model", str(tiny_smollm2_dir), "--ray", "--no-progress"]
    if "--store" not in extra:
        args += ["--store", redis_cluster.url]
    r = CliRunner().invoke(main, args + extra)
    assert r.exit_code in (1, 2) and message in r.output, r.output
    assert "Traceback" not in r.output


def test_the_actor_and_the_merge_without_ray_give_the_local_summary(tiny_smollm2_dir, spaces):
    """The actor class is plain Python: two 'actors' on overlapping work units (a document twice)
    write each chunk once between them, and the merged summary equals the local job's."""
    from ragkv.distributed import _PrecomputeActor, merge, units
    from ragkv.precompute import PrecomputeSummary
    from ragkv.sources import Report, read_documents

    local_uri, ray_uri = spaces
    spec = EngineSpec(str(tiny_smollm2_dir), "float32")
    with open_store(local_uri) as store:
        local = precompute(spec.prefiller(store), paths=[DOCS], chunk_tokens=CHUNK)
    docs = read_documents([DOCS], (), Report([], []))
    a, b = (_PrecomputeActor(EngineSpec(**{**spec.__dict__, "store_uri": ray_uri}), CHUNK, 4096, 1) for _ in "ab")
    work = units(docs, 2)
    assert len(work) == 2
    out_a = a({"docs": [work[0]["docs"]]})
    out_b = b({"docs": [work[1]["docs"], work[0]["docs"]]})  # b sees a's documents again: all stored
    rows = [dict(zip(o, vals)) for o in (out_a, out_b) for vals in zip(*o.values())]
    merged = PrecomputeSummary(docs=len(docs))
    merge(rows, merged)
    assert {k: getattr(merged, k) for k in SUMMARY_COUNTS} == {k: getattr(local, k) for k in SUMMARY_COUNTS}
    assert merged.planned_bytes == local.planned_bytes > 0
    assert _keys(ray_uri) == _keys(local_uri)
