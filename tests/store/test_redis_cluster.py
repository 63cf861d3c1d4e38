"""The Redis store on a real 3-master Redis Cluster: what only a cluster can get wrong. (The whole
Redis suite also runs on the cluster: the ``redis_store``/``any_store`` fixtures' ``cluster`` param.)"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from redis.cluster import key_slot
from redis_cluster import start_cluster_or_skip
from store_testlib import make_entry

from ragkv.store import open_store
from ragkv.store.redis_store import RedisStore

pytestmark = pytest.mark.redis


def _entries(n, **kw):
    return [make_entry(n_tokens=8 + i % 5, n_layers=3, seed=i, **kw) for i in range(n)]


def _node_names(cluster, ns):
    """What each master holds of namespace ``ns``, asked of each node directly (not through ragkv)."""
    out = {}
    for p in cluster.ports:
        with cluster.master_of(p) as r:
            out[p] = {n.decode() for n in r.scan_iter(match=f"ragkv:{ns}/*", count=1000)}
    return out


def test_every_key_of_an_entry_shares_one_slot_and_entries_spread_over_all_masters(redis_cluster):
    ns = f"slots-{uuid.uuid4().hex[:8]}"
    s = open_store(f"{redis_cluster.url}?namespace={ns}")
    try:
        entries = _entries(24)
        for meta, layers in entries:
            assert s.put(meta, layers)
        per_node = _node_names(redis_cluster, ns)
        assert all(per_node.values()), f"some master holds nothing: { {p: len(v) for p, v in per_node.items()} }"
        for meta, _ in entries:
            names = [s._hkey(meta.key)] + [s._bkey(meta.key, i) for i in range(3)]
            assert len({key_slot(n.encode()) for n in names}) == 1
            holders = [p for p, held in per_node.items() if set(names) <= held]
            assert len(holders) == 1  # the whole entry on one master
        # keys / stats / clear see every master
        assert sorted(s.keys()) == sorted(m.key for m, _ in entries)
        st = s.stats()
        assert st["entries"] == 24
        assert st["bytes"] == sum(s.get_encoded(m.key).nbytes for m, _ in entries)
        for meta, layers in entries[::5]:
            got = s.get(meta.key)
            assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got.layers, layers))
        s.clear()
        assert list(s.keys()) == [] and not any(_node_names(redis_cluster, ns).values())
    finally:
        s.clear()
        s.close()


def test_tenants_stay_apart_on_every_master(redis_cluster):
    uid = uuid.uuid4().hex[:6]
    a = open_store(f"{redis_cluster.url}?namespace=tenantA-{uid}")
    b = open_store(f"{redis_cluster.url}?namespace=tenantB-{uid}")
    prefix = open_store(f"{redis_cluster.url}?namespace=tenant")  # a prefix of both names
    try:
        ea, eb = _entries(9), _entries(12)[9:]
        for m, layers in ea:
            a.put(m, layers)
        for m, layers in eb:
            b.put(m, layers)
        assert sorted(a.keys()) == sorted(m.key for m, _ in ea)
        assert sorted(b.keys()) == sorted(m.key for m, _ in eb)
        assert list(prefix.keys()) == [] and prefix.stats()["entries"] == 0
        assert a.get(eb[0][0].key) is None and b.get(ea[0][0].key) is None
        assert b.stats()["entries"] == 3
        a.clear()
        assert list(a.keys()) == [] and sorted(b.keys()) == sorted(m.key for m, _ in eb)
        assert all(b.get(m.key) is not None for m, _ in eb)
    finally:
        for s in (a, b, prefix):
            s.clear()
            s.close()


def test_concurrent_writers_on_a_cluster_leave_one_complete_entry(redis_cluster):
    from concurrent.futures import ThreadPoolExecutor

    ns = f"race-{uuid.uuid4().hex[:8]}"
    stores = [RedisStore(redis_cluster.client_url, namespace=ns, cluster=True) for _ in range(4)]
    try:
        meta, layers = make_entry(n_tokens=64, n_layers=6)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda s: [s.put(meta, layers) for _ in range(5)], stores))
        got = stores[0].get(meta.key)
        assert got is not None and all(torch.equal(g[1], w[1]) for g, w in zip(got.layers, layers))
        assert stores[0].stats()["entries"] == 1
    finally:
        stores[0].clear()
        for s in stores:
            s.close()


def test_a_master_killed_mid_run_gives_misses_never_wrong_data_and_the_lost_entries_are_rewritten():
    """Kill one of three masters while entries are being read and written: every read is the stored
    value or a miss, writes fail with StoreError (never a partial entry); the node restarted empty
    (no persistence) is found missing and a rerun rewrites exactly what it lost."""
    cluster = start_cluster_or_skip()
    try:
        s = RedisStore(cluster.client_url, namespace="kill", cluster=True, backoff_s=0.2, max_backoff_s=0.5)
        entries = _entries(18)
        for meta, layers in entries:
            assert s.put(meta, layers)
        lost = {n.split("{")[1].split("}")[0] for n in _node_names(cluster, "kill")[cluster.ports[1]]}
        assert lost and len(lost) < len(entries)
        cluster.kill(cluster.ports[1])

        deadline = time.monotonic() + 8  # through the node timeout (2 s): cluster ok -> fail
        reads = 0
        while time.monotonic() < deadline:
            for meta, layers in entries:
                got = s.get(meta.key)
                reads += 1
                if got is not None:  # a hit must be the exact stored entry
                    assert meta.key not in lost
                    assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1])
                               for g, w in zip(got.layers, layers))
            extra, extra_layers = make_entry(n_tokens=9, seed=1000 + reads)
            try:
                s.put(extra, extra_layers)
            except Exception as e:  # the store says why; the job counts it and stops after a streak
                assert type(e).__name__ in ("StoreError", "StoreUnavailable"), e
        st = s.stats()
        print("during the outage:", reads, "reads", {k: st[k] for k in ("hits", "misses", "errors")})
        assert st["errors"] > 0 and st["hits"] < reads

        cluster.restart(cluster.ports[1])
        s2 = RedisStore(cluster.client_url, namespace="kill", cluster=True)
        missing = {m.key for m, _ in entries if not s2.contains(m.key)}
        assert missing == lost  # exactly what the dead master held, nothing else
        for meta, layers in entries:
            if meta.key in missing:
                assert s2.put(meta, layers)
        assert all(s2.contains(m.key) for m, _ in entries)
        s.close()
        s2.close()
    finally:
        cluster.stop()
