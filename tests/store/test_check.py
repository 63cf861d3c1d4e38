"""``check()``: can this backend be used at all? And URI options checked when the store is opened."""

import shutil

import pytest
from redis_server import SECRET, SECRET_TAIL, free_port

import ragkv.store as rs
from ragkv.store import open_store
from ragkv.store.memory import MemoryStore
from ragkv.store.redis_store import RedisStore


def test_check_of_usable_stores_passes(tmp_path):
    MemoryStore().check()
    open_store(f"disk://{tmp_path / 'kv'}").check()


def test_redis_check_unreachable_is_store_unavailable():
    port = free_port()
    s = RedisStore(f"redis://:{SECRET}@127.0.0.1:{port}/0")
    with pytest.raises(rs.StoreUnavailable, match=rf"127\.0\.0\.1:{port}.*(connect|refused)") as ei:
        s.check()
    assert isinstance(ei.value, rs.StoreError) and SECRET_TAIL not in str(ei.value)
    with pytest.raises(rs.StoreUnavailable):  # asked again: still a real attempt, still unavailable
        s.check()


@pytest.mark.redis
@pytest.mark.parametrize("auth", ["wrong", "none"])
def test_redis_check_auth_failure_is_store_unavailable(redis_auth_server, auth):
    userinfo = ":not-the-password@" if auth == "wrong" else ""
    s = open_store(f"redis://{userinfo}127.0.0.1:{redis_auth_server.port}/0")
    with pytest.raises(rs.StoreUnavailable, match="auth"):
        s.check()


@pytest.mark.redis
def test_redis_check_with_the_right_password_passes(redis_auth_server):
    open_store(f"redis://:{SECRET}@127.0.0.1:{redis_auth_server.port}/0").check()


def test_tiered_check_names_the_failing_tier(tmp_path):
    port = free_port()
    s = open_store(f"memory,disk://{tmp_path / 'kv'},redis://127.0.0.1:{port}/0")
    with pytest.raises(rs.StoreUnavailable, match=rf"tier 3 .*redis://127\.0\.0\.1:{port}/0") as ei:
        s.check()
    assert "memory" not in str(ei.value) and "disk" not in str(ei.value)


def test_disk_path_that_is_a_file_is_refused_at_open(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for path in (f, f / "sub", "/etc/passwd"):
        with pytest.raises(ValueError, match="not a directory"):
            open_store(f"disk://{path}")


def test_disk_check_fails_when_the_root_is_gone(tmp_path):
    s = open_store(f"disk://{tmp_path / 'kv'}")
    shutil.rmtree(tmp_path / "kv")
    (tmp_path / "kv").write_text("not a store")
    with pytest.raises(rs.StoreUnavailable, match=str(tmp_path / "kv")):
        s.check()


@pytest.mark.parametrize(
    "query,match",
    [
        ("socket_timeout=abc", r"socket_timeout='abc'.*seconds"),
        ("socket_connect_timeout=-1", r"socket_connect_timeout='-1'"),
        ("health_check_interval=1.5", r"health_check_interval='1.5'.*integer"),
        ("socket_keepalive=maybe", r"socket_keepalive='maybe'"),
        ("max_connections=0", r"max_connections='0'"),
        ("socket_timout=5", r"unknown option 'socket_timout'.*socket_timeout"),
        ("ttl=-5", r"ttl='-5'.*positive"),
        ("ttl=1.5", r"ttl='1.5'"),
        ("ttl=soon", r"ttl='soon'"),
        ("cluster=2", r"cluster='2'"),
        ("db=x", r"db='x'"),
    ],
)
def test_redis_uri_options_are_checked_at_open(query, match):
    with pytest.raises(ValueError, match=match):
        open_store(f"redis://127.0.0.1:6379/0?{query}")


@pytest.mark.parametrize("path", ["/zero", "/1/2", "/-1"])
def test_redis_db_path_must_be_a_number(path):
    with pytest.raises(ValueError, match="database"):
        open_store(f"redis://127.0.0.1:6379{path}")


def test_redis_uri_options_are_passed_typed():
    s = open_store(
        "redis://127.0.0.1:6379/3?socket_timeout=2.5&socket_connect_timeout=0.5&health_check_interval=10"
        "&socket_keepalive=yes&ttl=0&client_name=ragkv-test"
    )
    kw = s.client.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == 2.5 and kw["socket_connect_timeout"] == 0.5
    assert kw["health_check_interval"] == 10 and kw["socket_keepalive"] is True
    assert kw["db"] == 3 and kw["client_name"] == "ragkv-test" and s.ttl is None
    assert open_store("redis://127.0.0.1:6379/0?ttl=").ttl is None
    assert open_store("redis://127.0.0.1:6379/0?ttl=60").ttl == 60


@pytest.mark.parametrize("ttl", [-5, 0.5, "60"])
def test_redis_store_refuses_a_bad_ttl(ttl):
    with pytest.raises(ValueError, match="ttl"):
        RedisStore("redis://127.0.0.1:6379/0", ttl=ttl)
