"""Redis URLs of every kind: parsed, redacted, refused with a clear message; plain URLs opened as before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.sentinel import MasterNotFoundError

from client.connection import (
    SENTINEL_PORT,
    check_async,
    check_sync,
    explain,
    open_async,
    open_sync,
    parse_url,
    redact_url,
    secrets_of,
)
from worker.embedded_redis import RedisServer
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
        # what follows a sentinel password is hidden up to the sentinels' user name: it may be a '&' of the password
        ("redis+sentinel://h/svc?sentinel_password=hunter2&x=1", "redis+sentinel://h/svc?sentinel_password=***"),
        (
            "redis+sentinel://h/svc?sentinel_password=hunter2&sentinel_username=ops",
            "redis+sentinel://h/svc?sentinel_password=***&sentinel_username=ops",
        ),
        ("unix://:hunter2@/tmp/redis.sock?db=1", "unix://:***@/tmp/redis.sock?db=1"),
    ],
)
def test_passwords_of_every_scheme_are_redacted_in_messages_and_logs(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "hunter2" not in redact(f"connecting to {url}")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # redis-py reads the user part up to the last '@': this password is "p@hunter2"
        ("redis://:p@hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("redis+cluster://u:p@hunter2@127.0.0.1:7000", "redis+cluster://u:***@127.0.0.1:7000"),
        # schemes with a typo, or in capitals: still URLs, still hidden
        ("redis+clusters://:hunter2@127.0.0.1:7000", "redis+clusters://:***@127.0.0.1:7000"),
        ("rediss+sentinal://:hunter2@127.0.0.1/llmq", "rediss+sentinal://:***@127.0.0.1/llmq"),
        ("REDIS://:hunter2@127.0.0.1:6379", "REDIS://:***@127.0.0.1:6379"),
        # unencoded reserved characters in the password
        ("redis+cluster://u:pa#hunter2@h:1", "redis+cluster://u:***@h:1"),
        ("redis+cluster://u:pa/hunter2@h:1", "redis+cluster://u:***@h:1"),
        # an '@' in the sentinels' password: the last '@' is in the query, so all before it is hidden
        ("redis+sentinel://h/svc?sentinel_password=pa@hunter2", "redis+sentinel://***"),
        ("redis+sentinel://h/svc?sentinel_password=pa&hunter2", "redis+sentinel://h/svc?sentinel_password=***"),
        ("redis+cluster://bob@h:1", "redis+cluster://bob@h:1"),  # a user name alone is no secret
    ],
)
def test_any_url_a_user_passes_is_shown_without_its_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact(f"cannot use Redis at {url} now") == f"cannot use Redis at {redact_url(url)} now"


def test_free_text_is_redacted_url_by_url() -> None:
    text = "from redis://:hunter2@a:1 to http://u:hunter2@b:2/x, then sentinel_password=hunter2 alone"
    assert redact(text) == "from redis://:***@a:1 to http://u:***@b:2/x, then sentinel_password=*** alone"


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://u:pa#hunter2@h:1",  # '#' starts a fragment: the host part would read as "u:pa"
        "redis+cluster://u:pa/hunter2@h:1",  # ... or host "u", port "pa", with the rest for a path
        "redis+cluster://u:pa?hunter2@h:1",
        "redis+sentinel://:pa#hunter2@h/svc",
        "redis+sentinel://h/svc/x?sentinel_password=pa#hunter2",
        "redis+sentinel://h/svc?sentinel_password=pa&hunter2",  # "hunter2" reads as an unknown option
        "redis+sentinel://:pa hunter2@h/svc",
    ],
)
def test_a_password_with_unencoded_reserved_characters_is_refused_without_any_piece_of_it(url: str) -> None:
    with pytest.raises(ValueError, match="percent-encode") as caught:
        parse_url(url)
    assert "hunter2" not in str(caught.value) and "'pa'" not in str(caught.value)
    assert secrets_of(url) == []  # llmq scrubs its messages with these: a refused URL must not raise again


def test_a_refusal_still_names_the_pieces_it_shows() -> None:
    with pytest.raises(ValueError, match="host 'h' needs a port"):
        parse_url("redis+cluster://:secret@h")
    with pytest.raises(ValueError, match=r"unknown option\(s\) sentinel_pasword$"):
        parse_url("redis+sentinel://h/svc?sentinel_pasword=x")


@pytest.mark.parametrize("url", ["redis+cluster://h:\u0666\u0663\u0667\u0669", "redis+sentinel://h:\u0662\u0666/svc"])
def test_a_port_in_other_digits_than_ascii_is_refused(url: str) -> None:
    """`int()` reads Arabic-Indic digits ('٦٣٧٩' is 6379); no Redis URL means them."""
    with pytest.raises(ValueError, match=r"bad port .*ASCII digits"):
        parse_url(url)


def test_a_database_in_other_digits_than_ascii_is_refused() -> None:
    with pytest.raises(ValueError, match="bad database"):
        parse_url("redis+sentinel://h/svc/\u0663")


def _sentinel_client_repr(port: int) -> str:
    """How redis-py names a sentinel's client in its MasterNotFoundError: the whole client, about 1 KB."""
    return str(redis.Redis(host="127.0.0.1", port=port, password="hunter2"))


def test_a_master_no_sentinel_names_is_explained_in_one_short_line() -> None:
    url = "redis+sentinel://:hunter2@127.0.0.1:1,[::1]:2/llmq?sentinel_password=hunter2"
    errors = ", ".join(f"{_sentinel_client_repr(port)} - {redis.AuthenticationError('refused')!r}" for port in (1, 2))
    error = MasterNotFoundError(f"No master found for 'llmq' : {errors}")
    assert len(str(error)) > 1000
    assert explain(error, url) == (
        "No master found for 'llmq' through the sentinels at 127.0.0.1:1, [::1]:2: 2 failed, the first with "
        "AuthenticationError (a wrong sentinel_username or sentinel_password?)"
    )
    assert explain(MasterNotFoundError(explain(error, url)), url) == explain(error, url)  # said once is enough
    unknown = MasterNotFoundError("No master found for 'llmq'")
    assert explain(unknown, url).endswith("127.0.0.1:1, [::1]:2: none knows a master of that name that is up")


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis that refuses every password but its own: a sentinel to a `sentinel_password` that is wrong."""
    server = RedisServer(Path(tmp_path_factory.mktemp("guarded")), "--requirepass", "the-right-one").start()
    yield server
    server.stop()


def _wrong_sentinel_password_url(server: RedisServer) -> str:
    return f"redis+sentinel://127.0.0.1:{server.port}/llmq?sentinel_password=hunter2"


@pytest.mark.redis
def test_a_wrong_sentinel_password_fails_the_sync_check_at_once_in_one_line(guarded_server: RedisServer) -> None:
    """redis-py retried the refusal 10 times (about 4.5 s) per sentinel, and all of it on each retry of the
    master's connection (25 to 50 s for a 3-sentinel URL); a refused password will not heal."""
    url = _wrong_sentinel_password_url(guarded_server)
    client = open_sync(url)
    started = time.monotonic()
    try:
        with pytest.raises(MasterNotFoundError, match="the first with AuthenticationError") as caught:
            check_sync(client, url)
    finally:
        client.close()
    assert time.monotonic() - started < 2
    assert len(str(caught.value)) < 200 and "hunter2" not in str(caught.value)


@pytest.mark.redis
def test_a_wrong_sentinel_password_fails_the_async_check_at_once_in_one_line(guarded_server: RedisServer) -> None:
    url = _wrong_sentinel_password_url(guarded_server)

    async def check() -> None:
        client = open_async(url)
        try:
            await check_async(client, url)
        finally:
            await client.aclose()

    started = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="the first with AuthenticationError") as caught:
        asyncio.run(check())
    assert time.monotonic() - started < 2
    assert len(str(caught.value)) < 200 and "hunter2" not in str(caught.value)


def test_a_sentinel_connection_still_retries_a_lost_connection() -> None:
    """Only the refused password fails at once: a sentinel that dropped the connection is asked again."""
    client = open_sync("redis+sentinel://127.0.0.1:1/llmq")
    retry = client.connection_pool.sentinel_manager.sentinels[0].get_connection_kwargs()["retry"]
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise redis.ConnectionError("lost")
        return "answered"

    def refused() -> str:
        calls.append(1)
        raise redis.AuthenticationError("refused")

    assert retry.call_with_retry(flaky, lambda _: None) == "answered" and len(calls) == 3
    calls.clear()
    with pytest.raises(redis.AuthenticationError):
        retry.call_with_retry(refused, lambda _: None)
    assert len(calls) == 1


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
