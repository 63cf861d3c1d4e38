"""`ragkv stats / clear / evict` and the precompute command's argument checks (no model needed)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ragkv.cli import main
from ragkv.keys import chunk_key
from ragkv.store import EntryMeta, open_store


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


def test_evict_to_size(disk_uri):
    total = json.loads(_invoke("stats", "--store", disk_uri, "--json").stdout)["tiers"][0]["bytes"]
    r = _invoke("evict", "--store", disk_uri, "--max-bytes", str(total // 2))  # entries ~ total/3 each
    assert r.exit_code == 0 and "evicted 2" in r.stderr
    assert json.loads(_invoke("stats", "--store", disk_uri, "--json").stdout)["tiers"][0]["entries"] == 1
    assert _invoke("evict", "--store", disk_uri, "--max-bytes", "lots").exit_code == 2


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
