"""Fixtures for the store tests. Redis tests start their own redis-server on a free port; without
the binary they skip locally and FAIL when CI is set (they must never vanish silently in CI)."""

from __future__ import annotations

import uuid

import pytest
from redis_server import start_or_skip


@pytest.fixture(scope="session")
def redis_server():
    srv = start_or_skip()
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
