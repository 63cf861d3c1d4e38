"""Fixtures for the store tests. Redis tests start their own redis-server on a free port; without
the binary they skip locally and FAIL when CI is set (they must never vanish silently in CI)."""

from __future__ import annotations

import uuid

import pytest
from redis_server import SECRET, start_or_skip


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


@pytest.fixture
def redis_store(redis_server, redis_ns):
    from ragkv.store.redis_store import RedisStore

    s = RedisStore(redis_server.url, namespace=redis_ns)
    yield s
    s.clear()
    s.close()


@pytest.fixture(params=["memory", "disk", "redis", "tiered"])
def any_store(request, tmp_path):
    """Each kind of store; tiered = memory over disk (both written by ``put``)."""
    from ragkv.store.disk import DiskStore
    from ragkv.store.memory import MemoryStore
    from ragkv.store.tiered import TieredStore

    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "disk":
        s = DiskStore(tmp_path / "kv", fsync=False)
    elif request.param == "redis":
        request.applymarker(pytest.mark.redis)
        s = request.getfixturevalue("redis_store")
    else:
        s = TieredStore([MemoryStore(), DiskStore(tmp_path / "kv", fsync=False)])
    yield s
    s.close()
