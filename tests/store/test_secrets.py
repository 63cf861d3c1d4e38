"""A password in a store URI is never shown: not in uri/repr/stats, logs, error messages."""

import logging

import pytest
from redis_server import SECRET, SECRET_TAIL, free_port
from store_testlib import make_entry

import ragkv.store.uri as uri_mod
from ragkv.store import open_store


@pytest.mark.parametrize(
    "raw,shown",
    [
        (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
        (f"redis://user:{SECRET}@h:6379/0", "redis://user:***@h:6379/0"),
        ("redis://S3CRET@h/0", "redis://***@h/0"),
        ("redis://:%40S3CRET%3A@h/0", "redis://:***@h/0"),
        (f"rediss://h:6380/0?password={SECRET}&ttl=5", "rediss://h:6380/0?password=***&ttl=5"),
        ("redis://h/0?ttl=5&PWD=S3CRET", "redis://h/0?ttl=5&PWD=***"),
        ("redis://h/0?token=S3CRET&pass=S3CRET", "redis://h/0?token=***&pass=***"),
        ("redis://h/0?secret=S3CRET&auth=S3CRET", "redis://h/0?secret=***&auth=***"),
        ("redis://h/0?ssl_password=S3CRET&namespace=a", "redis://h/0?ssl_password=***&namespace=a"),
        ("redix://:S3CRET@h", "redix://:***@h"),
        ("memory,disk:///x?max_bytes=1G", "memory,disk:///x?max_bytes=1G"),
        ("memory,redis://:a,S3CRET@h/0,disk:///x", "memory,redis://:***@h/0,disk:///x"),
        ("disk:///var/cache/user@host", "disk:///var/cache/user@host"),
    ],
)
def test_redact_uri(raw, shown):
    assert uri_mod.redact_uri(raw) == shown


AUTH_URIS = [
    lambda port, ns: f"redis://:{SECRET}@127.0.0.1:{port}/0?namespace={ns}",
    lambda port, ns: f"redis://127.0.0.1:{port}/0?password={SECRET.replace('@', '%40')}&namespace={ns}",
    lambda port, ns: f"redis://127.0.0.1:{port}/0?password={SECRET}&namespace={ns}",
]


@pytest.mark.redis
@pytest.mark.parametrize("form", range(len(AUTH_URIS)), ids=["userinfo", "query_encoded", "query_raw"])
def test_password_not_in_uri_repr_or_stats(redis_auth_server, redis_ns, form):
    one = AUTH_URIS[form](redis_auth_server.port, redis_ns)
    for uri in (one, "memory," + one):
        s = open_store(uri)
        meta, layers = make_entry()
        assert s.put(meta, layers) and s.get(meta.key) is not None  # the password does work
        for shown in (s.uri, repr(s), str(s), str(s.stats())):
            assert SECRET_TAIL not in shown, shown
        assert "***" in s.uri
        s.clear()
        s.close()


@pytest.mark.parametrize("form", range(len(AUTH_URIS)), ids=["userinfo", "query_encoded", "query_raw"])
def test_password_not_in_logs_or_errors_of_a_failed_connection(caplog, redis_ns, form):
    caplog.set_level(logging.DEBUG)
    s = open_store(AUTH_URIS[form](free_port(), redis_ns))  # nothing listens there
    meta, layers = make_entry()
    assert s.get(meta.key) is None and s.get_layer(meta.key, 0) is None
    with pytest.raises(Exception) as ei:
        s.put(meta, layers)
    assert SECRET_TAIL not in str(ei.value)
    assert caplog.records and SECRET_TAIL not in caplog.text
    for shown in (s.uri, repr(s), str(s.stats())):
        assert SECRET_TAIL not in shown
    s.close()


@pytest.mark.parametrize(
    "uri",
    [
        f"redix://:{SECRET}@h:6379/0",
        f"redis://:{SECRET}@h:6379/0?bogus=1",
        f"redis://:{SECRET}@h:6379/0?ttl=abc",
        f"redis://:{SECRET}@h:6379/0?socket_timeout=abc",
        f"redis://h:6379/0?password={SECRET}&ttl=abc",
        f"redis://:{SECRET}@h:6379/zero",
        f"memory,redis://:{SECRET}@h:6379/0?namespace=t*",
    ],
)
def test_password_not_in_uri_error_messages(uri):
    with pytest.raises(ValueError) as ei:
        open_store(uri)
    assert SECRET_TAIL not in str(ei.value), str(ei.value)
