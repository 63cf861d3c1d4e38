"""Fixtures for the store tests. Redis tests start their own redis-server on a free port, and the
same tests run again on a real 3-master Redis Cluster (``redis_cluster``, tests/conftest.py);
without the binaries they skip locally and FAIL when CI is set (they must never vanish silently)."""

from __future__ import annotations

import uuid

import pytest
from redis_server import SECRET, start_or_skip
from store_testlib import open_redis


@pytest.fixture(scope="session")
def redis_server():
    srv = start_or_skip()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def redis_auth_server():
    """A redis-server that requires the password SECRET."""
    srv = start_or_skip(password=SECRET)
    yield srv
    srv.stop()


@pytest.fixture
def redis_ns():
    return f"test-{uuid.uuid4().hex[:10]}:"


@pytest.fixture(params=["redis", "cluster"])
def redis_store(request, redis_ns):
    """Every test of the Redis backend runs on one server and on a real Redis Cluster."""
    return open_redis(request, request.param, redis_ns)


@pytest.fixture(params=["memory", "disk", "redis", "cluster", "tiered"])
def any_store(request, tmp_path):
    """Each kind of store; tiered = memory over disk (both written by ``put``)."""
    from ragkv.store.disk import DiskStore
    from ragkv.store.memory import MemoryStore
    from ragkv.store.tiered import TieredStore

    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "disk":
        s = DiskStore(tmp_path / "kv", fsync=False)
    elif request.param in ("redis", "cluster"):
        s = open_redis(request, request.param, request.getfixturevalue("redis_ns"))
    else:
        s = TieredStore([MemoryStore(), DiskStore(tmp_path / "kv", fsync=False)])
    yield s
    s.close()
