"""Redis URLs of every kind: parsed, redacted, refused with a clear message; plain URLs opened as before."""

from __future__ import annotations

import pytest

from client.connection import SENTINEL_PORT, check_sync, open_sync, parse_url, redact_url
from worker.logging import redact


def test_a_cluster_url_names_its_seed_nodes_and_credentials() -> None:
    address = parse_url("rediss+cluster://alice:p%40ss@10.0.0.1:7000,[::1]:7001/0")
    assert (address.kind, address.tls) == ("cluster", True)
    assert address.hosts == (("10.0.0.1", 7000), ("::1", 7001))
    assert (address.username, address.password, address.db) == ("alice", "p@ss", 0)


def test_a_sentinel_url_names_its_sentinels_service_db_and_the_sentinels_own_credentials() -> None:
    address = parse_url("redis+sentinel://:pw@s1,s2:26380/mymaster/3?sentinel_username=ops&sentinel_password=sp")
    assert (address.kind, address.tls, address.service_name, address.db) == ("sentinel", False, "mymaster", 3)
    assert address.hosts == (("s1", SENTINEL_PORT), ("s2", 26380))
    assert (address.username, address.password) == (None, "pw")
    assert dict(address.sentinel_credentials) == {"username": "ops", "password": "sp"}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h:1", "not a Redis URL"),
        ("redis+cluster://h", "needs a port"),
        ("redis+cluster://h:1/2", "database 0 only"),
        ("redis+cluster://h:99999", "bad port"),
        ("redis+cluster://:secret@,h:1", "a host is empty"),
        ("redis+sentinel://h:26379", "names its service"),
        ("redis+sentinel://h/svc/x", "bad database"),
        ("redis+sentinel://:secret@h/svc?sentinel_pasword=x", "unknown option"),
        ("redis+cluster://:secret@[::1:7000", "Invalid IPv6"),
    ],
)
def test_bad_urls_are_refused_without_showing_passwords(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_url(url)
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis+cluster://u:hunter2@a:1,b:2/0", "redis+cluster://u:***@a:1,b:2/0"),
        ("redis+sentinel://h/svc?sentinel_password=hunter2&x=1", "redis+sentinel://h/svc?sentinel_password=***&x=1"),
        ("unix://:hunter2@/tmp/redis.sock?db=1", "unix://:***@/tmp/redis.sock?db=1"),
    ],
)
def test_passwords_of_every_scheme_are_redacted_in_messages_and_logs(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "hunter2" not in redact(f"connecting to {url}")


def test_a_ca_file_needs_a_tls_url() -> None:
    with pytest.raises(ValueError, match="TLS"):
        open_sync("redis://localhost:6379/0", ssl_ca_certs="/etc/ca.pem")


@pytest.mark.redis
def test_a_plain_url_opens_a_bounded_pool_when_asked(redis_url: str) -> None:
    client = open_sync(redis_url, max_connections=2, timeout=1)
    try:
        check_sync(client, redis_url)
        assert client.connection_pool.max_connections == 2
        assert client.set("k", "v") and client.get("k") == b"v"
    finally:
        client.close()

