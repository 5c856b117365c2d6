"""Black-box: the clients, the worker and the gateway while Redis goes away and comes back, used carelessly.

The promise under test (`client/errors.py`, `client/failover.py`, `client/replication.py`, the `AsyncClient` and
`Client` docstrings, `worker/config.py` and `gateway/settings.py`):

- no redis-py exception crosses the client's surface (submit, submit_many, generate, check, status, cancel,
  attach, stream, result, and `llmq`): a failure is `RedisUnavailable` (an `LLMQError` and a `ConnectionError`,
  redis-py's exception as `__cause__`, no password in the message) or is retried;
- a call retries for `failover_timeout` seconds while Redis is away and succeeds once it is back; after the
  window it raises `RedisUnavailable`; refused credentials fail at once. Followed result streams survive an
  outage shorter than the reader's ~30 s budget and end with `RedisUnavailable` after a longer one;
- `wait_replicas=N` (client) and `redis_wait_replicas` (worker, gateway): too few replicas acknowledging a
  submission within the window is `RedisUnavailable` ("k of N replicas acknowledged"), a re-submit of the same
  id once the replica is back adds no second entry, and a Sentinel failover loses no submission that returned;
- the gateway answers 503 (`unavailable`) when Redis stays away longer than `redis_failover_timeout_s` and
  serves again once it is back, without a restart.

The servers are real redis-server processes with an append-only file synced on every write, so one killed with
SIGKILL comes back with its data and every accepted request can be asked to end exactly once, its tokens
contiguous and equal to the scripted engine's (testing/scripted_engine.py). Bugs found are pinned as strict
`xfail`s whose reasons say what goes wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from client import (
    AsyncClient,
    AsyncJob,
    Cancelled,
    Client,
    Job,
    LLMQError,
    Outcome,
    RedisUnavailable,
)
from client.store import Keys
from gateway.settings import GatewaySettings
from testing.redis_topologies import HOST, RedisClusterSet, SentinelSet
from tests.gateway.conftest import gateway  # noqa: F401 - gateways on free ports, here on our own servers
from tests.polling import wait_until
from tests.topologies.failover_support import (
    PASSWORD,
    Run,
    Submitters,
    assert_no_secret,
    follow,
    follow_sync,
    llmq_async,
    master_and_replica,
    raw,
    request_ids_in,
    restart,
    restart_after,
    running,
    scripted,
    scripted_text,
    terminal_events,
    url_of,
)
from tests.worker.conftest import serving
from worker.config import Settings
from worker.embedded_redis import free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

KEYS = Keys("default")


def assert_typed(error: BaseException, *, cause: type[BaseException] = redis.RedisError) -> None:
    """The one failure the client may raise for Redis: typed, caused by redis-py's exception, without secrets."""
    assert isinstance(error, RedisUnavailable), repr(error)
    assert isinstance(error, LLMQError) and isinstance(error, ConnectionError)
    assert isinstance(error.__cause__, cause), repr(error.__cause__)
    assert_no_secret(str(error))
    assert_no_secret(repr(error))


async def timed(call: Awaitable[Any]) -> tuple[Any, float]:
    """What `call` returned or raised, and how long it took."""
    started = time.monotonic()
    try:
        value: Any = await call
    except Exception as error:  # the tests look at what came out
        value = error
    return value, time.monotonic() - started


async def gather(*calls: Awaitable[Any]) -> list[Any]:
    """`asyncio.gather` as a list of anything, to unpack."""
    return list(await asyncio.gather(*calls))


async def wait_for_workers(client: AsyncClient, count: int, queue: str | None = None) -> None:
    """Until `count` workers heartbeat on the queue: they are serving."""

    async def ready() -> bool:
        return len((await client.status(queue=queue)).workers) == count

    await wait_until(ready, within_s=30)


async def follow_first(client: AsyncClient, job: AsyncJob) -> None:
    """Until `job` has streamed its first tokens (it is running), read by a follower of its own, so that `job`
    itself is still to be read from its start."""
    async for _ in AsyncJob.attach(client, job.id).stream(timeout=30):
        return


# -- construction ----------------------------------------------------------------------------------------------


REFUSED_WINDOWS = [
    -1,
    -0.001,
    math.nan,
    math.inf,
    -math.inf,
    pytest.param(10**400, id="10**400"),
    pytest.param(
        True,
        id="True",
    ),
]


@pytest.mark.parametrize("kind", [Client, AsyncClient])
@pytest.mark.parametrize("window", REFUSED_WINDOWS)
def test_a_failover_timeout_that_is_no_duration_is_a_value_error_at_construction(kind: type, window: Any) -> None:
    with pytest.raises(ValueError, match="failover_timeout"):
        kind(f"redis://{HOST}:{free_port()}/0", failover_timeout=window)


@pytest.mark.parametrize("kind", [Client, AsyncClient])
@pytest.mark.parametrize("replicas", [-1, 1.0, 1.5, True, False, "1", None, math.nan])
def test_a_wait_replicas_that_is_no_count_is_a_value_error_at_construction(kind: type, replicas: Any) -> None:
    with pytest.raises(ValueError, match="wait_replicas"):
        kind(f"redis://{HOST}:{free_port()}/0", wait_replicas=replicas)


def test_a_wait_replicas_redis_cannot_take_is_refused_before_it_writes_anything(tmp_path: Path) -> None:
    with running(tmp_path / "redis") as node:
        try:
            client = Client(url_of(node), wait_replicas=2**63, failover_timeout=0)
        except ValueError:
            return  # refused up front
        with client, pytest.raises(RedisUnavailable):
            client.submit("too many replicas", max_new_tokens=1, request_id="huge")
        with raw(node) as conn:
            assert request_ids_in(conn, KEYS)["huge"] == 0, "the submit raised, yet its request will run"


def test_the_worker_and_gateway_read_their_failover_settings_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLMQ_REDIS_WAIT_REPLICAS", "2")
    monkeypatch.setenv("LLMQ_GATEWAY_REDIS_WAIT_REPLICAS", "3")
    monkeypatch.setenv("LLMQ_GATEWAY_REDIS_FAILOVER_TIMEOUT_S", "0.25")
    assert Settings(_env_file=None, model="m").redis_wait_replicas == 2  # type: ignore[call-arg]
    gateway_settings = GatewaySettings(_env_file=None)  # type: ignore[call-arg]
    assert (gateway_settings.redis_wait_replicas, gateway_settings.redis_failover_timeout_s) == (3, 0.25)
    for value in ("-1", "1.5", "two", "true"):
        monkeypatch.setenv("LLMQ_REDIS_WAIT_REPLICAS", value)
        monkeypatch.setenv("LLMQ_GATEWAY_REDIS_WAIT_REPLICAS", value)
        with pytest.raises(ValidationError):
            Settings(_env_file=None, model="m")  # type: ignore[call-arg]
        with pytest.raises(ValidationError):
            GatewaySettings(_env_file=None)  # type: ignore[call-arg]
    monkeypatch.delenv("LLMQ_GATEWAY_REDIS_WAIT_REPLICAS")
    for value in ("-1", "nan", "soon"):
        monkeypatch.setenv("LLMQ_GATEWAY_REDIS_FAILOVER_TIMEOUT_S", value)
        with pytest.raises(ValidationError):
            GatewaySettings(_env_file=None)  # type: ignore[call-arg]


@pytest.mark.parametrize("window", ["inf", "1e400"])
def test_the_gateway_refuses_an_endless_failover_timeout_in_its_settings(window: str) -> None:
    with pytest.raises(ValidationError):
        GatewaySettings(_env_file=None, redis_failover_timeout_s=window)  # type: ignore[call-arg, arg-type]


# -- one server, killed and back -------------------------------------------------------------------------------


async def test_every_call_of_both_clients_waits_out_a_sigkilled_redis_that_comes_back(tmp_path: Path) -> None:
    """Redis dies with SIGKILL; while it is away both clients submit, generate, ask the status and cancel (a job of
    their own, and one they only know by id). Each call returns once Redis is back 1.5 s later, none fails."""
    with running(tmp_path / "redis") as node:
        url = url_of(node)
        async with (
            serving(url, "default", tmp_path, step_s=0.01),
            AsyncClient(url, failover_timeout=10) as aclient,
        ):
            with Client(url, failover_timeout=10) as client:
                mine = await aclient.submit("cancel me", max_new_tokens=450)
                theirs = await asyncio.to_thread(client.submit, "cancel me too", max_new_tokens=450)
                await follow_first(aclient, mine)
                node.kill()
                killed = time.monotonic()

                async def back() -> float:
                    await asyncio.sleep(1.5)
                    await asyncio.to_thread(restart, node)
                    return time.monotonic()

                calls: dict[str, Awaitable[Any]] = {
                    "submit": aclient.submit("during", max_new_tokens=5),
                    "generate": aclient.generate("during generate", max_new_tokens=7, timeout=30),
                    "status": aclient.status(),
                    "cancel": mine.cancel(),
                    "cancel by id": AsyncJob.attach(aclient, theirs.id).cancel(),
                    "sync submit": asyncio.to_thread(client.submit, "during sync", max_new_tokens=6),
                    "sync generate": asyncio.to_thread(client.generate, "sync generate", max_new_tokens=4, timeout=30),
                    "sync status": asyncio.to_thread(client.status),
                    "sync cancel by id": asyncio.to_thread(Job.attach(client, mine.id).cancel),
                }
                *answers, up = await gather(*(timed(call) for call in calls.values()), back())
                results = dict(zip(calls, answers, strict=True))
                for name, (value, took) in results.items():
                    assert not isinstance(value, BaseException), f"{name}: {value!r}"
                    assert killed + took >= up - 0.5, f"{name} returned before Redis was back"
                assert await follow(results["submit"][0]) == scripted("during", 5)
                assert results["generate"][0].token_ids == scripted("during generate", 7)
                assert await asyncio.to_thread(follow_sync, results["sync submit"][0]) == scripted("during sync", 6)
                assert results["sync generate"][0].token_ids == scripted("sync generate", 4)
                for job in (mine, theirs):  # cancelled while Redis was away: the cancels arrive
                    with pytest.raises(Cancelled):
                        await AsyncJob.attach(aclient, job.id).result(timeout=30)
                after = await aclient.status()
                assert (after.depth, after.dead, len(after.workers)) == (0, 0, 1)


async def test_after_the_window_every_call_of_both_clients_raises_redis_unavailable(tmp_path: Path) -> None:
    """A password full of URL-reserved characters, Redis killed for good: every call is one typed error, caused
    by redis-py's, without the password, within the window and a few seconds; `submit_many` yields one typed
    outcome per request and raises nothing."""
    with running(tmp_path / "redis", password=PASSWORD) as node:
        url, window = url_of(node, PASSWORD), 0.75
        async with AsyncClient(url, failover_timeout=window) as aclient:
            with Client(url, failover_timeout=window) as client:
                ajob = await aclient.submit("before", max_new_tokens=1)
                job = await asyncio.to_thread(client.submit, "before sync", max_new_tokens=1)
                node.kill()
                calls: dict[str, Callable[[], Awaitable[Any]]] = {
                    "submit": lambda: aclient.submit("x", max_new_tokens=1),
                    "generate": lambda: aclient.generate("x", max_new_tokens=1, timeout=30),
                    "status": aclient.status,
                    "check": aclient.check,
                    "cancel": ajob.cancel,
                    "attach+cancel": AsyncJob.attach(aclient, "someone-elses").cancel,
                    "sync submit": lambda: asyncio.to_thread(client.submit, "x", max_new_tokens=1),
                    "sync generate": lambda: asyncio.to_thread(client.generate, "x", max_new_tokens=1, timeout=30),
                    "sync status": lambda: asyncio.to_thread(client.status),
                    "sync check": lambda: asyncio.to_thread(client.check),
                    "sync cancel": lambda: asyncio.to_thread(job.cancel),
                }
                answers = await asyncio.gather(*(timed(call()) for call in calls.values()))
                for name, (error, took) in zip(calls, answers, strict=True):
                    assert_typed(error)
                    assert took < window + 4, f"{name} took {took:.1f} s"
                requests = [{"prompt": f"many {i}", "max_new_tokens": 1} for i in range(8)]

                async def many() -> list[Outcome]:
                    return [outcome async for outcome in aclient.submit_many(requests, window=8, timeout=30)]

                def many_sync() -> list[Outcome]:
                    return list(client.submit_many(requests, window=8, timeout=30))

                outcomes: list[Outcome] = []
                # 8 requests through pools of 4 connections, each attempt waiting for its turn: more than the window
                for outcome_list, took in await asyncio.gather(timed(many()), timed(asyncio.to_thread(many_sync))):
                    assert sorted(outcome.index for outcome in outcome_list) == list(range(8))
                    assert took < window + 8, f"submit_many took {took:.1f} s"
                    outcomes += outcome_list
                for outcome in outcomes:
                    assert outcome.result is None
                    assert outcome.error is not None
                    assert_typed(outcome.error)


async def test_failover_timeout_zero_fails_at_once_yet_rides_out_a_dropped_connection(tmp_path: Path) -> None:
    with running(tmp_path / "redis") as node:
        url = url_of(node)
        async with AsyncClient(url, failover_timeout=0) as aclient:
            with Client(url, failover_timeout=0) as client:
                await aclient.submit("first", request_id="first")
                await asyncio.to_thread(client.submit, "first sync", request_id="first-sync")
                with raw(node) as conn:  # every client connection dropped (a proxy restarting, an idle timeout)
                    assert conn.execute_command("CLIENT", "KILL", "TYPE", "normal") >= 2
                await aclient.submit("second", request_id="second")
                await asyncio.to_thread(client.submit, "second sync", request_id="second-sync")
                assert (await aclient.status()).depth == 4
                node.kill()
                for call in (
                    lambda: aclient.submit("third"),
                    aclient.status,
                    AsyncJob.attach(aclient, "first").cancel,
                    lambda: asyncio.to_thread(client.submit, "third sync"),
                    lambda: asyncio.to_thread(Job.attach(client, "first-sync").cancel),
                ):
                    error, took = await timed(call())
                    assert_typed(error)
                    assert took < 1.5, f"{took:.2f} s for a call with failover_timeout=0"


async def test_refused_credentials_fail_every_call_at_once_not_after_the_window(tmp_path: Path) -> None:
    """A wrong password, a user that does not exist, no password at all, and a user whose ACL forbids the
    commands: 30 s windows, yet every call of both clients and `llmq` fails in a few seconds, naming no secret."""
    with running(tmp_path / "redis", password=PASSWORD) as node:
        with raw(node) as conn:
            conn.execute_command("ACL", "SETUSER", "pinger", "on", ">wrong horse", "+ping", "~*")
        refused = {
            "wrong password": url_of(node, "wrong horse"),
            "unknown user": url_of(node, PASSWORD, user="ghost"),
            "no password": url_of(node),
            "forbidden commands": url_of(node, "wrong horse", user="pinger"),
        }

        async def every_call(url: str) -> list[tuple[str, Any, float]]:
            async with AsyncClient(url, failover_timeout=30) as aclient:
                with Client(url, failover_timeout=30) as client:
                    calls: dict[str, Callable[[], Awaitable[Any]]] = {
                        "submit": lambda: aclient.submit("x", max_new_tokens=1),
                        "generate": lambda: aclient.generate("x", max_new_tokens=1, timeout=30),
                        "cancel": AsyncJob.attach(aclient, "some-id").cancel,
                        "sync submit": lambda: asyncio.to_thread(client.submit, "x", max_new_tokens=1),
                        "sync cancel": lambda: asyncio.to_thread(Job.attach(client, "some-id").cancel),
                    }
                    if "pinger" not in url:  # status: its refusals are tested below; check: PING allowed, INFO not
                        calls["status"] = aclient.status
                        calls["sync status"] = lambda: asyncio.to_thread(client.status)
                    calls["check"] = aclient.check
                    calls["sync check"] = lambda: asyncio.to_thread(client.check)
                    answers = await asyncio.gather(*(timed(call()) for call in calls.values()))
                    outcomes = await asyncio.to_thread(lambda: list(client.submit_many([{"prompt": "x"}] * 3)))
                    outcomes += [outcome async for outcome in aclient.submit_many([{"prompt": "x"}] * 3)]
                    assert [outcome.result for outcome in outcomes] == [None] * 6
                    return [(name, value, took) for name, (value, took) in zip(calls, answers, strict=True)] + [
                        ("submit_many", outcome.error, 0.0) for outcome in outcomes
                    ]

        started = time.monotonic()
        results = await asyncio.gather(*(every_call(url) for url in refused.values()))
        for what, answers in zip(refused, results, strict=True):
            for name, error, took in answers:
                assert_typed(error)
                assert took < 5, f"{what}, {name}: {took:.1f} s"
        assert time.monotonic() - started < 15
        runs = await asyncio.gather(
            *(llmq_async("status", "--url", url) for url in refused.values()),
            llmq_async("submit", "hello", "--url", refused["wrong password"], "--timeout", "5"),
            llmq_async("cancel", "some-id", "--url", refused["unknown user"]),
        )
        for run in runs:
            assert run.returncode == 4 and run.seconds < 10, run  # Exit.UNAVAILABLE
            assert run.stderr.strip().splitlines()[-1].startswith("llmq: error:"), run.stderr
            assert "Traceback" not in run.stderr, run.stderr
            assert_no_secret(run.stdout + run.stderr)


@pytest.mark.parametrize("trouble", ["acl", "wrongtype"])
@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_status_query_redis_refuses_is_the_typed_error(tmp_path: Path, trouble: str, kind: str) -> None:
    with running(tmp_path / "redis", password=PASSWORD) as node:
        with raw(node) as conn:
            conn.execute_command("ACL", "SETUSER", "pinger", "on", ">wrong horse", "+ping", "~*")
            conn.set(KEYS.dead, "not a stream")
        url = url_of(node, "wrong horse", user="pinger") if trouble == "acl" else url_of(node, PASSWORD)
        if kind == "async":
            async with AsyncClient(url, failover_timeout=1) as aclient:
                error, _ = await timed(aclient.status())
        else:
            with Client(url, failover_timeout=1) as client:
                error, _ = await timed(asyncio.to_thread(client.status))
        assert_typed(error)


async def llmq_during_a_restart(node: Any, *argv: str, down_s: float = 2.0) -> Any:
    """`llmq ARGV` started while `node` is down, `node` back `down_s` later."""
    node.kill()
    run = asyncio.create_task(llmq_async(*argv))
    await asyncio.sleep(down_s)
    await asyncio.to_thread(restart, node)
    return await run


async def test_llmq_rides_out_a_restart_of_redis(tmp_path: Path) -> None:
    with running(tmp_path / "redis", password=PASSWORD) as node:
        url = url_of(node, PASSWORD)
        async with serving(url, "default", tmp_path), AsyncClient(url) as aclient:
            await wait_for_workers(aclient, 1)  # a worker that starts while Redis is away stops at once
            status = await llmq_during_a_restart(node, "status", "--json", "--url", url)
            assert status.returncode == 0 and status.seconds > 2, status
            assert json.loads(status.stdout)["depth"] == 0
            submit = await llmq_during_a_restart(node, "submit", "hello", "--max-new-tokens", "5", "--url", url)
            assert submit.returncode == 0, submit
            assert submit.stdout == scripted_text("hello", 5) + "\n"
            assert_no_secret(status.stdout + status.stderr + submit.stdout + submit.stderr)


async def test_llmq_that_rides_out_a_restart_prints_nothing_but_its_answer(tmp_path: Path) -> None:
    with running(tmp_path / "redis") as node:
        status = await llmq_during_a_restart(node, "status", "--json", "--url", url_of(node))
        assert status.returncode == 0, status
        assert status.stderr == ""


# -- result streams across a restart ---------------------------------------------------------------------------

STREAMED = 300  # tokens; at 10 ms a step a request streams for 3 s, long enough to be cut by a restart


async def test_50_async_streams_cut_by_a_sigkill_restart_each_end_once_with_every_token(tmp_path: Path) -> None:
    """50 jobs streaming at once through one AsyncClient (32 running, 18 waiting for a slot); Redis is killed
    once every stream has tokens and comes back 3 s later. The worker and the client's one reader reconnect."""
    with running(tmp_path / "redis") as node:
        url = url_of(node)
        async with serving(url, "default", tmp_path, step_s=0.01), AsyncClient(url, failover_timeout=10) as aclient:
            prompts = [f"stream {i}" for i in range(50)]
            jobs = [await aclient.submit(prompt, max_new_tokens=STREAMED) for prompt in prompts]
            started: set[str] = set()

            async def stream(job: AsyncJob) -> list[int]:
                tokens: list[int] = []
                async for delta in job.stream(timeout=90):
                    assert delta.seq == len(tokens), "a gap or a duplicate"
                    tokens += delta.token_ids
                    started.add(job.id)
                return tokens

            async def restart_when_all_stream() -> float:
                await wait_until(lambda: len(started) >= 32, within_s=30)
                node.kill()
                await asyncio.sleep(3)
                await asyncio.to_thread(restart, node)
                return time.monotonic()

            *outputs, back = await gather(*(stream(job) for job in jobs), restart_when_all_stream())
            for prompt, job, tokens in zip(prompts, jobs, outputs, strict=True):
                assert (job.finish_reason, tokens) == ("length", scripted(prompt, STREAMED)), prompt
            with raw(node) as conn:
                assert set(terminal_events(conn, KEYS, [job.id for job in jobs]).values()) == {1}
            result = await aclient.generate("after", max_new_tokens=5, timeout=30)  # the same client and worker
            assert result.token_ids == scripted("after", 5)
            status = await aclient.status()
            assert (status.depth, status.dead, len(status.workers)) == (0, 0, 1)
            assert time.monotonic() > back


async def test_one_sync_client_shared_by_40_threads_rides_out_a_sigkill_restart(tmp_path: Path) -> None:
    """Half the threads submit before Redis dies and follow their streams through the outage; the other half
    submit while it is away (each such submit waits for it)."""
    with running(tmp_path / "redis") as node:
        url = url_of(node)
        async with serving(url, "default", tmp_path, step_s=0.005), AsyncClient(url) as aclient:
            await wait_for_workers(aclient, 1)
            with Client(url, failover_timeout=10) as client:
                down = threading.Event()

                def one(i: int) -> tuple[str, list[int]]:
                    if i % 2:
                        down.wait(30)
                    time.sleep(0.01 * (i % 7))
                    job = client.submit(f"thread {i}", max_new_tokens=80)
                    return job.id, follow_sync(job, 60)

                def restart_soon() -> None:
                    time.sleep(0.3)
                    node.kill()
                    down.set()
                    time.sleep(2)
                    restart(node)

                def all_threads() -> list[tuple[str, list[int]]]:
                    with ThreadPoolExecutor(41) as pool:
                        futures = [pool.submit(one, i) for i in range(40)]
                        pool.submit(restart_soon)
                        return [future.result() for future in futures]

                outputs = await asyncio.to_thread(all_threads)
                for i, (_, tokens) in enumerate(outputs):
                    assert tokens == scripted(f"thread {i}", 80), i
                with raw(node) as conn:
                    assert set(terminal_events(conn, KEYS, [request_id for request_id, _ in outputs]).values()) == {1}
                result = await asyncio.to_thread(client.generate, "after", max_new_tokens=3, timeout=30)
                assert result.token_ids == scripted("after", 3)


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_submit_many_with_redis_sigkilled_midway_and_back_delivers_every_request_once(
    tmp_path: Path, kind: str
) -> None:
    """150 requests, 16 in flight; Redis is killed after the 20th outcome and is back 1.5 s later."""
    with running(tmp_path / "redis") as node:
        url = url_of(node)
        requests: list[dict[str, Any]] = [
            {"prompt": f"many {i}", "max_new_tokens": 5 + i % 20, "request_id": f"{kind}-{i}"} for i in range(150)
        ]
        # A claim whose reply the kill cut off is taken again after the lease: 4 s here instead of 15.
        async with (
            serving(url, "default", tmp_path, step_s=0.005, lease_timeout_s=4, lease_renew_s=0.5),
            AsyncClient(url, failover_timeout=10) as aclient,
        ):
            await wait_for_workers(aclient, 1)
            killed = threading.Event()

            def seen(outcomes: list[Outcome]) -> None:
                if len(outcomes) == 20:
                    node.kill()
                    killed.set()
                    threading.Thread(target=restart_after, args=(node, 1.5)).start()

            outcomes: list[Outcome] = []
            if kind == "async":
                async for outcome in aclient.submit_many(requests, window=16, timeout=60):
                    outcomes.append(outcome)
                    seen(outcomes)
            else:

                def run_sync() -> None:
                    with Client(url, failover_timeout=10) as client:
                        for outcome in client.submit_many(requests, window=16, timeout=60):
                            outcomes.append(outcome)
                            seen(outcomes)

                await asyncio.to_thread(run_sync)
            assert killed.is_set()
            assert sorted(outcome.index for outcome in outcomes) == list(range(150))
            for outcome in outcomes:
                request = requests[outcome.index]
                assert outcome.error is None, (outcome.index, outcome.error)
                assert outcome.result is not None and outcome.result.request_id == request["request_id"]
                assert outcome.result.token_ids == scripted(request["prompt"], request["max_new_tokens"])
            with raw(node) as conn:
                assert set(terminal_events(conn, KEYS, [r["request_id"] for r in requests]).values()) == {1}
                assert sum(request_ids_in(conn, KEYS).values()) == 0  # each served and removed, none twice


@dataclass
class LongOutage:
    """What came out of one outage longer than the readers' budget (`long_outage`)."""

    stream_errors: list[BaseException]  # of the AsyncClient's stream, then the Client's
    waited_s: float
    outcomes: list[Outcome]
    cli: Run
    after: list[tuple[list[int], list[int]]]  # (streamed, expected) once Redis is back


async def outage_longer_than_the_readers_budget(workdir: Path) -> LongOutage:
    with running(workdir / "redis", password=PASSWORD) as node:
        url = url_of(node, PASSWORD)
        async with serving(url, "default", workdir, step_s=0.01), AsyncClient(url, failover_timeout=1) as aclient:
            with Client(url, failover_timeout=1) as client:
                ajob = await aclient.submit("endless", max_new_tokens=200)
                job = await asyncio.to_thread(client.submit, "endless sync", max_new_tokens=200)
                await follow_first(aclient, ajob)
                node.kill()
                killed = time.monotonic()

                async def submit_many() -> list[Outcome]:
                    requests = [{"prompt": f"lost {i}", "max_new_tokens": 3} for i in range(10)]
                    return [outcome async for outcome in aclient.submit_many(requests, window=10, timeout=120)]

                (error, _), (sync_error, _), cli, outcomes = await asyncio.gather(
                    timed(follow(ajob, 120)),
                    timed(asyncio.to_thread(follow_sync, job, 120)),
                    llmq_async("status", "--url", url, limit_s=60),
                    submit_many(),
                )
                waited = time.monotonic() - killed
                # Back: the worker finishes what it ran, and a new reader follows it to its end.
                await asyncio.to_thread(restart, node)
                after = [
                    (await follow(AsyncJob.attach(aclient, request_id), 60), scripted(prompt, 200))
                    for prompt, request_id in (("endless", ajob.id), ("endless sync", job.id))
                ]
    return LongOutage([error, sync_error], waited, outcomes, cli, after)


@pytest.fixture(scope="module")
def long_outage(tmp_path_factory: pytest.TempPathFactory) -> LongOutage:
    """Redis killed for good (for 30 s and more) under streams of both clients, a `submit_many` and `llmq status`,
    then back. Run once for the two tests below: the readers' budget is ~30 s whatever the test."""
    return asyncio.run(outage_longer_than_the_readers_budget(tmp_path_factory.mktemp("long-outage")))


def test_an_outage_longer_than_the_readers_budget_ends_followed_streams_with_redis_unavailable(
    long_outage: LongOutage,
) -> None:
    """Each ends with the typed error (the readers after their ~30 s budget), none hangs or leaks a redis-py
    exception, and the work is still there once Redis is back."""
    for failure in long_outage.stream_errors:
        assert isinstance(failure, RedisUnavailable), repr(failure)
        assert isinstance(failure, LLMQError) and isinstance(failure, ConnectionError)
        assert "reading results" in str(failure)
        assert_no_secret(str(failure))
    assert 20 < long_outage.waited_s < 50, f"the readers gave up after {long_outage.waited_s:.0f} s"
    assert sorted(outcome.index for outcome in long_outage.outcomes) == list(range(10))
    for outcome in long_outage.outcomes:
        assert outcome.error is not None
        assert_typed(outcome.error)
    cli = long_outage.cli
    assert cli.returncode == 4, cli  # Exit.UNAVAILABLE
    assert cli.stderr.strip().splitlines()[-1].startswith("llmq: error:"), cli.stderr
    assert "Traceback" not in cli.stderr
    assert_no_secret(cli.stdout + cli.stderr)
    for streamed, expected in long_outage.after:
        assert streamed == expected


def test_the_error_that_ends_a_followed_stream_carries_redis_pys_exception(long_outage: LongOutage) -> None:
    for failure in long_outage.stream_errors:
        assert_typed(failure, cause=redis.ConnectionError)


async def test_a_result_key_of_the_wrong_type_stalls_no_other_stream(tmp_path: Path) -> None:
    with running(tmp_path / "redis") as node:
        url = url_of(node)
        with raw(node) as conn:
            conn.set(KEYS.result("poisoned"), "not a stream")
        async with serving(url, "default", tmp_path), AsyncClient(url, failover_timeout=1) as aclient:
            await wait_for_workers(aclient, 1)
            with Client(url, failover_timeout=1) as client:
                poisoned = asyncio.gather(
                    timed(AsyncJob.attach(aclient, "poisoned").result(timeout=4)),
                    timed(asyncio.to_thread(Job.attach(client, "poisoned").result, 4)),
                )
                await asyncio.sleep(0.2)  # both readers follow the poisoned stream
                (innocent, _), (sync_innocent, _) = await asyncio.gather(  # 5 tokens: 10 ms of work
                    timed(aclient.generate("innocent", max_new_tokens=5, timeout=1.5)),
                    timed(asyncio.to_thread(client.generate, "innocent too", max_new_tokens=5, timeout=1.5)),
                )
                errors = await poisoned
        for prompt, result in (("innocent", innocent), ("innocent too", sync_innocent)):
            assert not isinstance(result, BaseException), repr(result)
            assert result.token_ids == scripted(prompt, 5)
        for error, took in errors:
            assert isinstance(error, LLMQError) and took < 3, (error, took)


async def test_a_password_rotated_under_a_followed_stream_ends_it_at_once(tmp_path: Path) -> None:
    with running(tmp_path / "redis", password=PASSWORD) as node:
        url = url_of(node, PASSWORD)
        async with AsyncClient(url, failover_timeout=1) as aclient:
            with Client(url, failover_timeout=1) as client:
                ajob = await aclient.submit("nobody serves this", max_new_tokens=1)
                job = await asyncio.to_thread(client.submit, "nobody serves this", max_new_tokens=1)
                reading = asyncio.gather(timed(ajob.result(timeout=4)), timed(asyncio.to_thread(job.result, 4)))
                await asyncio.sleep(0.3)
                with raw(node) as conn:  # the operator rotates the password and drops the old sessions
                    conn.config_set("requirepass", "wrong horse")
                    conn.execute_command("CLIENT", "KILL", "TYPE", "normal")
                for error, took in await reading:
                    assert_typed(error, cause=redis.AuthenticationError)
                    assert took < 3, f"{took:.1f} s"


# -- wait_replicas ---------------------------------------------------------------------------------------------


async def test_a_submit_no_replica_acknowledges_is_typed_and_its_resubmit_adds_no_second_entry(tmp_path: Path) -> None:
    """The replica dies: submits of both clients with wait_replicas=1 fail typed after the window, naming the
    acknowledgements, though the primary has them; once it is back, the same ids again are accepted without a
    second entry, and a worker with redis_wait_replicas=1 serves each exactly once."""
    with master_and_replica(tmp_path) as pair:
        url = url_of(pair.master)
        async with AsyncClient(url, wait_replicas=1, failover_timeout=1) as aclient:
            with Client(url, wait_replicas=1, failover_timeout=1) as client:
                await aclient.submit("replicated", max_new_tokens=3, request_id="replicated")
                await asyncio.to_thread(
                    client.submit, "replicated sync", max_new_tokens=3, request_id="replicated-sync"
                )
                pair.replica.kill()
                answers = await asyncio.gather(
                    timed(aclient.submit("lonely", max_new_tokens=4, request_id="lonely")),
                    timed(asyncio.to_thread(client.submit, "lonely sync", max_new_tokens=4, request_id="lonely-sync")),
                )
                for error, took in answers:
                    assert_typed(error)
                    assert "0 of 1 replicas acknowledged" in str(error), error
                    assert took < 1 + 5, f"{took:.1f} s"
                assert (await aclient.status()).depth == 4  # a read: no replica needed
                with raw(pair.master) as conn:
                    assert request_ids_in(conn, KEYS) == Counter(
                        {"replicated": 1, "replicated-sync": 1, "lonely": 1, "lonely-sync": 1}
                    )
                await asyncio.to_thread(restart, pair.replica)
                await asyncio.to_thread(pair.wait_linked)
                again = await aclient.submit("lonely", max_new_tokens=4, request_id="lonely")
                again_sync = await asyncio.to_thread(
                    client.submit, "lonely sync", max_new_tokens=4, request_id="lonely-sync"
                )
                assert (again.id, again_sync.id) == ("lonely", "lonely-sync")
                with raw(pair.master) as conn:
                    assert set(request_ids_in(conn, KEYS).values()) == {1}
                async with AsyncClient(url, wait_replicas=2, failover_timeout=0.5) as greedy:
                    error, _ = await timed(greedy.submit("two replicas", max_new_tokens=1))
                    assert_typed(error)
                    assert "1 of 2 replicas acknowledged" in str(error), error
        async with serving(url, "default", tmp_path, redis_wait_replicas=1), AsyncClient(url) as aclient:
            prompts = {"replicated": 3, "replicated sync": 3, "lonely": 4, "lonely sync": 4, "two replicas": 1}
            for prompt, count in prompts.items():
                request_id = prompt.replace(" ", "-") if prompt != "two replicas" else None
                if request_id is not None:
                    assert await follow(AsyncJob.attach(aclient, request_id), 30) == scripted(prompt, count), prompt
            with raw(pair.master) as conn:
                ids = ["replicated", "replicated-sync", "lonely", "lonely-sync"]
                assert set(terminal_events(conn, KEYS, ids).values()) == {1}


async def test_a_worker_waiting_for_its_replica_ends_each_request_once_when_the_replica_is_back(
    tmp_path: Path,
) -> None:
    """Requests stream from a worker with redis_wait_replicas=1 when the replica dies: their terminal events and
    a new request's claim cannot be acknowledged until it is back 2 s later; then each ends exactly once, on the
    replica too."""
    with master_and_replica(tmp_path) as pair:
        url = url_of(pair.master)
        # A claim no replica acknowledged is left to the lease (15 s by default, 3 here) to be claimed again.
        async with (
            serving(url, "default", tmp_path, step_s=0.01, redis_wait_replicas=1, lease_timeout_s=3, lease_renew_s=0.5),
            AsyncClient(url, failover_timeout=5) as aclient,
        ):
            await wait_for_workers(aclient, 1)
            prompts = [f"replicated {i}" for i in range(8)]
            jobs = [await aclient.submit(prompt, max_new_tokens=60) for prompt in prompts]
            await follow_first(aclient, jobs[0])
            pair.replica.kill()
            late = await aclient.submit("claimed while alone", max_new_tokens=5)

            async def replica_back() -> float:
                await asyncio.sleep(2)
                await asyncio.to_thread(restart, pair.replica)
                return time.monotonic()

            async def first_token_at(job: AsyncJob) -> float:
                await follow_first(aclient, job)
                return time.monotonic()

            *outputs, late_started, back = await gather(
                *(follow(job, 60) for job in jobs), first_token_at(late), replica_back()
            )
            for prompt, tokens in zip(prompts, outputs, strict=True):
                assert tokens == scripted(prompt, 60), prompt
            assert await follow(AsyncJob.attach(aclient, late.id), 30) == scripted("claimed while alone", 5)
            assert late_started > back - 0.5, "a claim went on without a replica acknowledging it"
            ids = [job.id for job in [*jobs, late]]

            async def settled() -> bool:
                status = await aclient.status()
                return status.depth == 0 and not status.pending

            await wait_until(settled, within_s=30)
            await asyncio.to_thread(pair.wait_linked)
            for node in (pair.master, pair.replica):
                with raw(node) as conn:
                    assert set(terminal_events(conn, KEYS, ids).values()) == {1}, node


# -- the gateway -----------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def model_served(
    start_gateway: Callable[..., Awaitable[Any]], url: str, workdir: Path, **settings: Any
) -> AsyncIterator[tuple[Any, str]]:
    """A worker on `url` and a gateway with `settings` in front of it; the gateway and its worker's model."""
    async with serving(url, "default", workdir, model="gateway-model"):
        served = await start_gateway(redis_url=url, **settings)
        yield served, await served.model()


def assert_unavailable(response: Any) -> None:
    """OpenAI's error shape, code `unavailable`, no secret."""
    assert response.status_code == 503, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["code"] == "unavailable" and isinstance(error["message"], str) and error["type"], error
    assert_no_secret(response.text)


async def test_the_gateway_answers_503_after_its_window_and_serves_again_once_redis_is_back(
    tmp_path: Path,
    gateway: Any,  # noqa: F811 - the fixture imported above
) -> None:
    """Three gateways on one Redis. Redis killed: the one with a 1 s window answers 503 `unavailable` to
    completions and chats, streamed or not, soon after its window (its model list cached, so each request meets
    Redis at its submit); one that reads the model list on every request answers /health and /v1/models with
    503; the one with a 10 s window holds a completion until Redis is back 1.5 s later and answers it. None is
    restarted: all serve the next requests."""
    with running(tmp_path / "redis", password=PASSWORD) as node:
        url = url_of(node, PASSWORD)
        async with serving(url, "default", tmp_path, model="failover-model"):
            short = await gateway(redis_url=url, redis_failover_timeout_s=1, models_refresh_s=3600)
            bare = await gateway(redis_url=url, redis_failover_timeout_s=1)
            patient = await gateway(redis_url=url, redis_failover_timeout_s=10)
            model = await short.model()
            assert await bare.model() == model and await patient.model() == model
            completion = {"model": model, "prompt": "while away", "max_tokens": 4}
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            node.kill()
            async with short.http(timeout=30) as http, bare.http(timeout=30) as bare_http:
                answers = await gather(
                    timed(http.post("/v1/completions", json=completion)),
                    timed(http.post("/v1/chat/completions", json=chat)),
                    timed(http.post("/v1/chat/completions", json={**chat, "stream": True})),
                    timed(http.post("/v1/completions", json={**completion, "stream": True})),
                )
                answers += [await timed(bare_http.get("/v1/models"))]
                for response, took in answers:
                    assert_unavailable(response)
                    assert took < 1 + 4, f"{took:.1f} s"
                health, took = await timed(bare_http.get("/health"))
                assert health.status_code == 503 and took < 1 + 4, (health.text, took)
                assert_no_secret(health.text)

            async def back_soon() -> None:
                await asyncio.sleep(1.5)
                await asyncio.to_thread(restart, node)

            async with patient.http(timeout=30) as http:
                held, _ = await asyncio.gather(http.post("/v1/completions", json=completion), back_soon())
            assert held.status_code == 200, held.text
            assert held.json()["choices"][0]["text"] == scripted_text("while away", 4)
            for served in (short, bare):
                sdk = served.sdk(timeout=30)
                again = await sdk.completions.create(model=model, prompt="after", max_tokens=5)
                assert again.choices[0].text == scripted_text("after", 5)
                text = ""
                chunks = await sdk.completions.create(model=model, prompt="streamed", max_tokens=6, stream=True)
                async for chunk in chunks:
                    text += "".join(choice.text for choice in chunk.choices)
                assert text == scripted_text("streamed", 6)
                async with served.http() as http:
                    assert (await http.get("/health")).status_code == 200


async def test_concurrent_requests_during_an_outage_each_get_their_503_after_one_window(
    tmp_path: Path,
    gateway: Any,  # noqa: F811 - the fixture imported above
) -> None:
    with running(tmp_path / "redis") as node:
        # With the default models_refresh_s (2 s) the same, once the cached list is 2 s old.
        settings = {"redis_failover_timeout_s": 1, "models_refresh_s": 0.2}
        async with model_served(gateway, url_of(node), tmp_path, **settings) as (served, model):
            node.kill()
            await asyncio.sleep(0.3)  # the cached model list is stale now
            completion = {"model": model, "prompt": "x", "max_tokens": 1}
            async with served.http(timeout=30) as http:
                answers = await asyncio.gather(
                    timed(http.post("/v1/completions", json=completion)),
                    timed(http.post("/v1/completions", json=completion)),
                    timed(http.get("/health")),
                )
        for response, took in answers:
            assert response.status_code == 503, response.text
            assert took < 1 + 3, f"{took:.1f} s"


async def test_a_gateway_waiting_for_a_missing_replica_answers_503(
    tmp_path: Path,
    gateway: Any,  # noqa: F811 - the fixture imported above
) -> None:
    """redis_wait_replicas=1 on a Redis without replicas: no submission can be acknowledged, so 503."""
    with running(tmp_path / "redis") as node:
        settings = {"redis_wait_replicas": 1, "redis_failover_timeout_s": 0.5}
        async with model_served(gateway, url_of(node), tmp_path, **settings) as (served, model):
            async with served.http(timeout=30) as http:
                response, took = await timed(
                    http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1})
                )
            assert_unavailable(response)
            assert took < 0.5 + 5


# -- Sentinel and Cluster --------------------------------------------------------------------------------------


async def test_a_sentinel_failover_during_submits_with_wait_replicas_loses_no_submission_that_returned(
    sentinel_set: SentinelSet,
) -> None:
    """Four async and two sync submitters with wait_replicas=1 submit without pause through a SENTINEL FAILOVER;
    the old master takes writes on its open connections for a while after the switch, which no replica copies.
    Every submit that returned must be on the new master; one that raised was not accepted."""
    url = sentinel_set.url
    async with AsyncClient(url, wait_replicas=1, failover_timeout=20) as aclient:
        with Client(url, wait_replicas=1, failover_timeout=20) as client:
            submitters = Submitters(aclient, client)

            async def fail_over() -> tuple[str, int]:
                await submitters.until_accepted(50)
                new = await asyncio.to_thread(sentinel_set.failover)
                await submitters.until_accepted(50)  # and on through the new master
                submitters.stop.set()
                return new

            new = await submitters.during(fail_over(), asyncs=4, syncs=2)
    for error in submitters.refused:
        assert_typed(error, cause=BaseException)
    lost = submitters.lost_on(sentinel_set.node_at(new[1]), KEYS)
    assert not lost, f"{len(lost)} of {len(submitters.accepted)} accepted submissions are not on the new master"
    assert len(submitters.accepted) >= 100


async def submit_through_a_cluster_failover(cluster: RedisClusterSet, *, alone_s: float) -> tuple[Any, ...]:
    """Three async and one sync submitter with wait_replicas=1 on a queue whose master is killed; once its
    replica is promoted, the old master is started again `alone_s` later and rejoins as the new one's replica.
    Returns the submitters, the accepted ids the new master lacks, and the ids accepted while it had no replica
    (each with its replica count then)."""
    queue = cluster.queue_on(cluster.masters()[1])
    keys = Keys(queue)
    old = cluster.master_for_key(keys.requests)
    url = "redis+cluster://" + ",".join(f"{HOST}:{node.port}" for node in cluster.nodes)
    async with AsyncClient(url, queue=queue, wait_replicas=1, failover_timeout=15) as aclient:
        with Client(url, queue=queue, wait_replicas=1, failover_timeout=15) as client:
            submitters = Submitters(aclient, client)

            async def kill_and_rejoin() -> tuple[Any, list[tuple[str, int]]]:
                await submitters.until_accepted(50)
                cluster.kill_master(old)
                new = await asyncio.to_thread(cluster.wait_for_promotion, old, 20)
                alone = len(submitters.accepted)
                await asyncio.sleep(alone_s)
                replicas = int(new.client().info("replication")["connected_slaves"])
                unreplicated = [(request_id, replicas) for request_id in submitters.accepted[alone:]]
                await asyncio.to_thread(cluster.restart, old)  # back as the new master's replica
                await submitters.until_accepted(50)
                submitters.stop.set()
                return new, unreplicated

            new, unreplicated = await submitters.during(kill_and_rejoin(), asyncs=3, syncs=1)
    return submitters, submitters.lost_on(new, keys), unreplicated


async def test_a_cluster_master_killed_under_submits_with_wait_replicas_loses_none_that_returned(
    redis_cluster: RedisClusterSet,
) -> None:
    """SIGKILL of the queue's master under submits with wait_replicas=1: every submit that returned is on the
    promoted replica; those that failed did so typed."""
    submitters, lost, _ = await submit_through_a_cluster_failover(redis_cluster, alone_s=0)
    for error in submitters.refused:
        assert_typed(error, cause=BaseException)
    assert not lost, f"{len(lost)} of {len(submitters.accepted)} accepted submissions are not on the new master"
    assert len(submitters.accepted) >= 100


async def test_no_cluster_submit_returns_while_its_new_master_has_no_replica(redis_cluster: RedisClusterSet) -> None:
    """As above, but the old master rejoins only 2 s after the promotion: meanwhile nothing can acknowledge."""
    *_, unreplicated = await submit_through_a_cluster_failover(redis_cluster, alone_s=2)
    assert unreplicated == [], "submits returned while their master had the replica counts shown"
