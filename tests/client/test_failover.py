"""A client's calls across an outage of Redis: retried while it lasts less than `failover_timeout`, then one typed
error (`RedisUnavailable`) that names no password; no redis-py exception reaches the caller. Real redis-server
processes, stopped and started again on the same port."""

from __future__ import annotations

import asyncio
import builtins
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio
from redis.asyncio.sentinel import MasterNotFoundError as AsyncMasterNotFoundError
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
)
from redis.sentinel import MasterNotFoundError

from client import AsyncClient, Client, LLMQError
from client.errors import RedisUnavailable
from client.failover import FailoverBackoff, heals, unavailable
from worker.embedded_redis import RedisServer

PASSWORD = "hunter2"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", "--requirepass", PASSWORD).start()
    yield server
    server.stop()


def url_of(server: RedisServer) -> str:
    return f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"


def restart_after(server: RedisServer, down_s: float) -> threading.Thread:
    """Stops `server` now and starts it again on the same port `down_s` later, from a thread."""
    server.stop()
    thread = threading.Thread(target=lambda: (time.sleep(down_s), server.start()))
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("error", "healing"),
    [
        (ConnectionError("Connection refused"), True),
        (ClusterDownError("The cluster is down"), True),
        (ReadOnlyError("You can't write against a read only replica."), True),
        (SlotNotCoveredError("Slot 6918 is not covered by the cluster"), True),
        (AttributeError("'NoneType' object has no attribute 'writelines'"), True),
        (AuthenticationError("invalid username-password pair"), False),
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
        (MovedError("9875 127.0.0.1:7002"), False),
    ],
)
def test_what_heals_with_a_failover_is_retried_and_what_repeats_is_not(error: Exception, healing: bool) -> None:
    assert heals(error) is healing
    backoff = FailoverBackoff("a submit", url="redis://:hunter2@h:1/0", window_s=5.0)
    if healing:
        assert 0 < backoff.delay_after(error) <= 1.0
    else:
        with pytest.raises(RedisUnavailable) as raised:
            backoff.delay_after(error)
        assert raised.value.__cause__ is error


def test_the_backoff_doubles_and_stops_at_its_window() -> None:
    backoff = FailoverBackoff("a submit", url=None, window_s=0.5)
    delays = []
    with pytest.raises(RedisUnavailable, match="did not serve a submit"):
        while True:
            delay = backoff.delay_after(ConnectionError("refused"))
            delays.append(delay)
            time.sleep(delay)
    assert all(full / 2 <= delay <= full for delay, full in zip(delays[:3], [0.05, 0.1, 0.2], strict=True))
    assert sum(delays) <= 0.5


def test_the_typed_error_names_no_password_and_says_what_a_moved_reply_means() -> None:
    error = unavailable("a submit", "redis://:hunter2@10.0.0.1:6379/0", MovedError("9875 127.0.0.1:7002"))
    assert isinstance(error, LLMQError) and isinstance(error, builtins.ConnectionError)
    assert "hunter2" not in str(error) and "redis+cluster://" in str(error)


async def test_a_submit_during_a_restart_of_redis_is_served_when_it_is_back(server: RedisServer) -> None:
    async with AsyncClient(url_of(server)) as client:
        await client.submit("before", max_new_tokens=1)
        restarting = restart_after(server, down_s=1.5)
        job = await client.submit("during", max_new_tokens=1)  # retried until Redis is back (empty: no persistence)
        await asyncio.to_thread(restarting.join)
        assert (await client.status()).depth == 1
        assert job.id


def test_the_sync_clients_submit_and_status_ride_out_a_restart(server: RedisServer) -> None:
    with Client(url_of(server)) as client:
        client.submit("before", max_new_tokens=1)
        restarting = restart_after(server, down_s=1.5)
        client.submit("during", max_new_tokens=1)
        restarting.join()
        assert client.status().depth == 1


async def test_an_outage_longer_than_the_window_is_one_typed_error_without_the_password(server: RedisServer) -> None:
    async with AsyncClient(url_of(server), failover_timeout=0.5) as client:
        job = await client.submit("before", max_new_tokens=1)
        server.stop()
        started = time.monotonic()
        for call in (lambda: client.submit("during", max_new_tokens=1), client.status, job.cancel, client.check):
            with pytest.raises(RedisUnavailable) as raised:
                await call()
            assert PASSWORD not in str(raised.value) and ":***@" in str(raised.value)
        assert time.monotonic() - started < 10


def test_the_sync_client_raises_the_same_typed_error(server: RedisServer) -> None:
    with Client(url_of(server), failover_timeout=0.5) as client:
        job = client.submit("before", max_new_tokens=1)
        server.stop()
        for call in (lambda: client.submit("during", max_new_tokens=1), client.status, job.cancel, client.check):
            with pytest.raises(RedisUnavailable) as raised:
                call()
            assert PASSWORD not in str(raised.value)


async def test_a_wrong_password_fails_at_once_instead_of_retrying(server: RedisServer) -> None:
    wrong = url_of(server).replace(PASSWORD, "wrong")
    async with AsyncClient(wrong, failover_timeout=30) as client:
        started = time.monotonic()
        with pytest.raises(RedisUnavailable) as raised:
            await client.submit("x", max_new_tokens=1)
        assert time.monotonic() - started < 5
        assert isinstance(raised.value.__cause__, AuthenticationError)


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_result_reader_that_gives_up_raises_the_typed_error(
    server: RedisServer, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("client._mux.RECONNECT_BUDGET_S", 0.5)
    if kind == "async":
        async with AsyncClient(url_of(server)) as client:
            job = await client.submit("x", max_new_tokens=1)
            server.stop()
            with pytest.raises(RedisUnavailable, match="did not serve reading results"):
                await job.result(timeout=30)
        return
    with Client(url_of(server)) as sync_client:
        sync_job = sync_client.submit("x", max_new_tokens=1)
        server.stop()
        with pytest.raises(RedisUnavailable, match="did not serve reading results"):
            await asyncio.to_thread(sync_job.result, 30)


def test_sentinels_refusing_the_password_is_not_retried_but_no_master_is() -> None:
    refused = "No master found for 'llmq' through the sentinels at h:1: 3 failed, the first with AuthenticationError"
    for kind in (MasterNotFoundError, AsyncMasterNotFoundError):
        assert not heals(kind(refused))
        assert heals(kind("No master found for 'llmq'"))  # during a failover


async def test_check_of_a_client_handed_a_redis_pings_it(server: RedisServer) -> None:
    async with redis.asyncio.Redis.from_url(url_of(server)) as conn, AsyncClient(redis=conn) as client:
        await client.check()
    with redis.Redis.from_url(url_of(server)) as sync_conn, Client(redis=sync_conn) as sync_client:
        sync_client.check()
    server.stop()
    async with redis.asyncio.Redis.from_url(url_of(server)) as conn, AsyncClient(redis=conn) as client:
        with pytest.raises(RedisUnavailable):
            await client.check()
