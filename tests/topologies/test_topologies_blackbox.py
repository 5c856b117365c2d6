"""Black-box: the service on a real Redis Cluster and a real Sentinel set, used carelessly and under faults.

The promise under test (README "Redis beyond one node", `client/connection.py`):

- every component takes `redis+cluster://` and `redis+sentinel://` URLs; a bad URL is a ValueError whose
  message never holds the password, and no message or log does;
- both clients work on either topology (submit, stream, result, cancel, status, check), one client follows
  jobs of queues on different shards; `llmq` works there too and explains a plain URL that hits a Cluster;
- the worker refuses a URL of the wrong kind in one line, before loading its model;
- a master killed with `kill -9` while requests stream: every accepted request ends exactly once, its tokens
  contiguous and equal to the idle answer, and the worker serves new requests afterwards.

Everything runs on the scripted engine (testing/scripted_engine.py), whose tokens are a pure function of the prompt
and the position, so each output is checked token for token. Cases already in
tests/topologies/test_cluster_and_sentinel.py
(one client, 20 requests, a failover) are not repeated; these go for volume, races and careless usage. The bugs
they found were pinned here as `xfail` until fixed; each test's docstring says what it once caught.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import structlog
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

from client import AsyncClient, AsyncJob, Cancelled, Client, ClientClosed, Job, RedisUnavailable
from client.cli import main as cli
from client.connection import open_async, parse_url, redact_url
from client.protocol import decode_event
from client.store import Keys
from testing.redis_topologies import HOST, RedisClusterSet, SentinelSet
from testing.scripted_engine import expected_tokens
from tests.gateway.conftest import gateway  # noqa: F401 - gateways on free ports, here on a Sentinel URL
from tests.polling import wait_until
from tests.topologies.test_cluster_and_sentinel import serving
from worker.embedded_redis import free_port
from worker.logging import configure, redact

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

LONG = 400  # tokens; at 10 ms a step a request streams for 4 s, long enough to be cut by a failover
DATA_PASSWORD, SENTINEL_PASSWORD = "data secret", "watch:secret"  # the `sentinel_set` fixture's
# Every form a password of these tests could take in a message: raw, percent-encoded, and its distinctive tail.
SECRETS = (
    *("data secret", "data%20secret", "watch:secret", "watch%3Asecret", "secret"),
    *("hunter2", "wrong pass", "wrong%20pass"),  # the wrong passwords these tests pass on purpose
)


def ids_of(prompt: str) -> list[int]:
    return list(prompt.encode())


def scripted_text(prompt: str, count: int) -> str:
    return "".join(f"<{token}>" for token in expected_tokens(ids_of(prompt), count))


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} shown in {text[:300]!r}"


def sentinel_url(sentinels: SentinelSet, *, password: str, sentinel_password: str, service: str = "llmq") -> str:
    hosts = ",".join(f"{host}:{port}" for host, port in sentinels.sentinel_addresses)
    query = f"sentinel_password={quote(sentinel_password)}"
    return f"redis+sentinel://:{quote(password, safe='')}@{hosts}/{service}?{query}"


async def follow(job: AsyncJob) -> list[int]:
    """The whole output of `job`, asserting every delta starts where the previous one ended."""
    tokens: list[int] = []
    async for delta in job.stream(timeout=120):
        assert delta.seq == len(tokens), "a gap or a duplicate"
        tokens += delta.token_ids
    return tokens


async def terminal_events(url: str, keys: Keys, request_ids: list[str]) -> Counter[str]:
    """How many terminal events (`done`, `error`) each request's raw result stream holds."""
    raw = open_async(url)
    try:
        counts: Counter[str] = Counter()
        for request_id in request_ids:
            counts[request_id] += 0
            for _, fields in await raw.xrange(keys.result(request_id)):
                if decode_event(fields[b"m"]).type != "tokens":
                    counts[request_id] += 1
        return counts
    finally:
        await raw.aclose()


def join_client_threads(timeout: float = 10.0) -> None:
    """Waits for closed sync clients' threads (`llmq-*`) to end. In a failing test below they would still be
    retrying when pytest reports the failure, and on CPython 3.11 `ast.parse` (pytest reads the failing
    source with it) can raise SystemError 'AST constructor recursion depth mismatch' while another thread runs
    (python/cpython#106905, pytest-dev/pytest#10763): it ended one run of this file in an INTERNALERROR."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name.startswith("llmq-") and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


@pytest.fixture
def worker_logs() -> Iterator[io.StringIO]:
    """The worker's own log setup (`worker.logging.configure`, redaction included), written here; restored after."""
    saved = structlog.get_config()
    sink = io.StringIO()
    configure("json")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sink))
    try:
        yield sink
    finally:
        structlog.configure(**saved)


# -- URLs ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://:hunter2@",  # no host at all
        "redis+cluster://:hunter2@h",  # a cluster seed needs its port
        "redis+cluster://:hunter2@h:0",
        "redis+cluster://:hunter2@h:65536",
        "redis+cluster://:hunter2@h:1:2",
        "redis+cluster://:hunter2@h:1,,h:2",
        "redis+cluster://:hunter2@h:1/1",
        "redis+cluster://:hunter2@h:1?sentinel_password=hunter2",  # a sentinel option on a cluster URL
        "redis+cluster://:hunter2@[::1:7000",
        "rediss+cluster://user:hunter2@h:1/0/0",
        "redis+sentinel://:hunter2@h1,h2",  # no service
        "redis+sentinel://:hunter2@h/svc/db",
        "redis+sentinel://:hunter2@h/svc/0/extra",
        "redis+sentinel://h/svc?sentinel_password=hunter2&sentinel_pasword=x",
        "rediss+sentinel://u:hunter2@h:abc/svc",
        "REDIS+CLUSTER://:hunter2@h:1",
        "redis+clusters://:hunter2@h:1",
        "http://:hunter2@h:1",
    ],
)
def test_bad_urls_are_refused_without_showing_the_password(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_url(url)
    assert_no_secret(str(caught.value))
    assert_no_secret(redact_url(url))


@pytest.mark.parametrize(
    ("url", "hosts", "user", "password", "service", "db", "sentinel"),
    [
        # a seed list of IPv6 and named hosts, reserved characters encoded in user and password
        (
            "rediss+cluster://al%40ice:p%40ss%3Aw%2Fo%23rd%3Fhunter2@[::1]:7000,node-2.example:7001/0",
            (("::1", 7000), ("node-2.example", 7001)),
            "al@ice",
            "p@ss:w/o#rd?hunter2",
            "",
            0,
            {},
        ),
        # sentinels on the default port and not, IPv6 among them; a database; the sentinels' user only
        (
            "redis+sentinel://[::1],[fe80::1]:26380,s3/my.service-1/15?sentinel_username=ops",
            (("::1", 26379), ("fe80::1", 26380), ("s3", 26379)),
            None,
            None,
            "my.service-1",
            15,
            {"username": "ops"},
        ),
        # a password of one space, a user and no password, an encoded service name
        (
            "rediss+sentinel://:%20@h/svc%2Fone?sentinel_password=hunter2",
            (("h", 26379),),
            None,
            " ",
            "svc/one",
            0,
            {"password": "hunter2"},
        ),
        ("redis+cluster://bob@127.0.0.1:7000", (("127.0.0.1", 7000),), "bob", None, "", 0, {}),
    ],
)
def test_odd_but_valid_urls_mean_what_they_say_and_are_shown_without_passwords(
    url: str,
    hosts: tuple[tuple[str, int], ...],
    user: str | None,
    password: str | None,
    service: str,
    db: int,
    sentinel: dict[str, str],
) -> None:
    address = parse_url(url)
    assert address.hosts == hosts
    assert (address.username, address.password, address.service_name, address.db) == (user, password, service, db)
    assert dict(address.sentinel_credentials) == sentinel
    assert address.tls == url.startswith("rediss")
    assert_no_secret(address.redacted)
    assert_no_secret(redact(f"connecting to {url} now"))


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://u:pa#hunter2@h:1",  # '#' starts a fragment: the host part is read as "u:pa"
        "redis+cluster://u:pa/hunter2@h:1",
        "redis+cluster://u:pa?hunter2@h:1",
        "redis+sentinel://:pa#hunter2@h/svc",
        "redis+sentinel://h/svc/x?sentinel_password=pa#hunter2",
        "redis+sentinel://h/svc?sentinel_password=pa&hunter2",  # an unencoded '&' in the sentinels' password
    ],
)
def test_a_password_with_an_unencoded_reserved_character_is_not_echoed_when_refused(url: str) -> None:
    """A password pasted without percent-encoding makes the URL unreadable; the refusal must still not show it
    (`python -m worker --redis-url 'redis+cluster://u:pa#hunter2@h:1'` prints it on stderr today)."""
    with pytest.raises(ValueError) as caught:
        parse_url(url)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:p@hunter2@127.0.0.1:6379/0",  # redis-py and parse_url both read the password as "p@hunter2"
        "redis+cluster://u:p@hunter2@127.0.0.1:7000",
        "redis+sentinel://:p@hunter2@127.0.0.1/llmq",
        "redis+clusters://:hunter2@127.0.0.1:7000",  # a typo in the scheme
        "REDIS://:hunter2@127.0.0.1:6379",
        "rediss+sentinal://:hunter2@127.0.0.1/llmq",
    ],
)
def test_the_worker_log_redaction_hides_the_password_of_any_url_a_user_passes(url: str) -> None:
    """The worker prints `cannot use Redis at <redact(url)>: ...` on stderr: `python -m worker --redis-url
    'redis+clusters://:hunter2@h:1'` and `--redis-url 'redis://:p@hunter2@h:1'` show hunter2 today."""
    assert "hunter2" not in redact_url(url)  # the connection module hides it ...
    assert "hunter2" not in redact(f"cannot use Redis at {url}")  # ... and so must the worker's logs


def test_llmq_explains_a_cluster_url_that_reaches_no_node(capsys: pytest.CaptureFixture[str]) -> None:
    """`llmq status --url redis+cluster://<nothing listening>`: one line, not a traceback (redis-py raises
    RedisClusterException there, which is no RedisError)."""
    url = f"redis+cluster://:hunter2@{HOST}:{free_port()}"
    assert cli(["status", "--url", url, "--queue", "q"]) == 4  # Exit.UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith("llmq: error:") and len(err.strip().splitlines()) == 1
    assert_no_secret(err)


# -- Cluster ---------------------------------------------------------------------------------------------------


async def test_210_short_requests_over_3_queues_on_3_shards_each_end_once(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    """One async client submits 150 jobs to three queues (one per master) and awaits them all at once, while one
    sync client's `submit_many` sends 60 more from its threads."""
    queues = [redis_cluster.queue_on(master, prefix=f"s{i}q") for i, master in enumerate(redis_cluster.masters())]
    assert len({redis_cluster.master_for_key(Keys(queue).requests).port for queue in queues}) == 3
    url = redis_cluster.seed_url
    async with (
        serving(url, queues[0], tmp_path),
        serving(url, queues[1], tmp_path),
        serving(url, queues[2], tmp_path),
        AsyncClient(url, queue=queues[0]) as client,
    ):
        prompts = {f"many {i}": (queues[i % 3], 4 + i % 9) for i in range(150)}
        jobs = {}
        for prompt, (queue, count) in prompts.items():
            jobs[prompt] = await client.submit(prompt, max_new_tokens=count, queue=queue)
        more = [
            {"prompt": f"sync {i}", "max_new_tokens": 3 + i % 5, "queue": queues[i % 3], "request_id": f"sync-{i}"}
            for i in range(60)
        ]

        def through_the_sync_client() -> list[Any]:
            with Client(url, queue=queues[0]) as sync:
                return list(sync.submit_many(more, window=16, timeout=90))

        outputs, outcomes = await asyncio.gather(
            asyncio.gather(*(follow(job) for job in jobs.values())), asyncio.to_thread(through_the_sync_client)
        )
        for (prompt, (_, count)), tokens in zip(prompts.items(), outputs, strict=True):
            assert tokens == expected_tokens(ids_of(prompt), count), prompt
        assert sorted(outcome.index for outcome in outcomes) == list(range(60))
        for outcome in outcomes:
            request = more[outcome.index]
            assert outcome.error is None, outcome.error
            assert outcome.result is not None and outcome.result.request_id == request["request_id"]
            assert outcome.result.token_ids == expected_tokens(ids_of(request["prompt"]), request["max_new_tokens"])
        for queue in queues:
            ids = [job.id for job in jobs.values() if job.keys.queue == queue]
            ids += [request["request_id"] for request in more if request["queue"] == queue]
            assert set((await terminal_events(url, Keys(queue), ids)).values()) == {1}, queue
            status = await client.status(queue=queue)
            assert (status.depth, status.dead, len(status.workers)) == (0, 0, 1), queue


SHORT = 12  # tokens of a racing request: at 2 ms a step, about as long as a cancel takes to arrive


async def cancel_racing(i: int, job: AsyncJob, other: AsyncClient) -> list[int]:
    """Cancel `job` the `i % 6`-th way, then read its whole stream through `other` from the start."""
    mode = i % 6
    if mode == 0:
        await job.cancel()
    elif mode == 1:
        await asyncio.sleep(0.004 * (i % 5))
        await job.cancel()
    elif mode == 2:  # someone else cancels it, knowing only its id and queue
        await AsyncJob.attach(other, job.id, queue=job.keys.queue).cancel()
    elif mode == 3:
        await job.cancel()
        await job.cancel()
    elif mode == 4:  # after the end: no effect
        await job.result(timeout=60)
        await job.cancel()
    else:  # after the first tokens
        async for _ in job.stream(timeout=60):
            await job.cancel()
            break
    return await follow(AsyncJob.attach(other, job.id, queue=job.keys.queue))


async def cancel_after(job: AsyncJob, count: int) -> tuple[list[int], str]:
    """Cancel `job` (again and again, as an impatient caller would) once it has `count` tokens."""
    tokens: list[int] = []
    async for delta in job.stream(timeout=60):
        tokens += delta.token_ids
        if len(tokens) >= count:
            await job.cancel()
    try:
        await job.result(timeout=60)
    except Cancelled as cancelled:
        return cancelled.result.token_ids, cancelled.result.finish_reason
    return tokens, "not cancelled"


async def raced_outcome(i: int, prompt: str, job: AsyncJob, tokens: list[int]) -> str:
    """'cancelled' or 'complete', asserting what the other client read is what the job's own result says."""
    answer = expected_tokens(ids_of(prompt), SHORT)
    assert tokens == answer[: len(tokens)], prompt
    try:
        result = await job.result(timeout=30)
    except Cancelled as cancelled:
        assert i % 6 != 4, f"{prompt}: cancelled after it had ended"
        assert cancelled.result.token_ids == tokens
        return "cancelled"
    assert (result.finish_reason, result.token_ids) == ("length", answer), prompt
    return "complete"


async def test_cancels_racing_completion_on_two_shards_end_every_request_exactly_once(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    """Cancels at once, a little later, from another client, twice, after the end, and after the first tokens of
    long requests: each request ends once, cancelled with a prefix of its answer or complete."""
    first, second = redis_cluster.queues_on_different_masters()
    url = redis_cluster.seed_url
    async with (
        serving(url, first, tmp_path),
        serving(url, second, tmp_path),
        AsyncClient(url, queue=first) as client,
        AsyncClient(url, queue=second) as other,
    ):
        short = {f"race {i}": (first, second)[i % 2] for i in range(48)}
        jobs: dict[str, AsyncJob] = {}

        async def submit_and_race(i: int, prompt: str, queue: str) -> list[int]:
            # Each cancel follows its own submit at once: submitting all 48 first gave the workers (in this event
            # loop) time to finish every request before the first cancel, and nothing raced (a slow CI machine).
            jobs[prompt] = job = await client.submit(prompt, max_new_tokens=SHORT, queue=queue)
            return await cancel_racing(i, job, other)

        long = {f"long {i}": (first, second)[i % 2] for i in range(6)}
        long_jobs = {p: await client.submit(p, max_new_tokens=LONG, queue=q) for p, q in long.items()}
        raced, cuts = await asyncio.gather(
            asyncio.gather(*(submit_and_race(i, p, q) for i, (p, q) in enumerate(short.items()))),
            asyncio.gather(*(cancel_after(job, 5) for job in long_jobs.values())),
        )
        outcomes = Counter(
            [await raced_outcome(i, p, jobs[p], tokens) for i, (p, tokens) in enumerate(zip(short, raced, strict=True))]
        )
        assert outcomes["cancelled"] >= 1, outcomes
        for (prompt, _), (tokens, reason) in zip(long.items(), cuts, strict=True):
            assert reason == "cancelled" and 5 <= len(tokens) < LONG, (prompt, len(tokens), reason)
            assert tokens == expected_tokens(ids_of(prompt), len(tokens)), prompt
        for queue in (first, second):
            ids = [job.id for job in [*jobs.values(), *long_jobs.values()] if job.keys.queue == queue]
            assert set((await terminal_events(url, Keys(queue), ids)).values()) == {1}, queue

            async def settled(queue: str = queue) -> bool:
                status = await client.status(queue=queue)
                return (status.depth, status.pending, status.dead) == (0, 0, 0)

            await wait_until(settled, within_s=30)


async def test_clients_closed_mid_stream_stop_waiting_and_a_new_client_reads_the_whole_answers(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    first, second = redis_cluster.queues_on_different_masters()
    url = redis_cluster.seed_url
    prompts = {"closed a": first, "closed b": second}
    async with serving(url, first, tmp_path, step_s=0.01), serving(url, second, tmp_path, step_s=0.01):
        closing = AsyncClient(url, queue=first)
        jobs = [await closing.submit(prompt, max_new_tokens=LONG, queue=queue) for prompt, queue in prompts.items()]
        seen: dict[str, list[int]] = {job.id: [] for job in jobs}

        async def read(job: AsyncJob) -> str:
            try:
                async for delta in job.stream(timeout=60):
                    seen[job.id] += delta.token_ids
            except ClientClosed:
                return "closed"
            return "ended"

        readers = [asyncio.ensure_future(read(job)) for job in jobs]
        await wait_until(lambda: all(seen.values()), within_s=30)
        await closing.aclose()
        assert await asyncio.wait_for(asyncio.gather(*readers), 30) == ["closed", "closed"]
        await closing.aclose()  # a second close is harmless
        with pytest.raises(ClientClosed):
            await closing.submit("after close")

        # the sync twin, closed from another thread while one of its threads streams
        sync = Client(url, queue=second)
        sync_job = sync.submit("closed c", max_new_tokens=LONG)
        sync_seen: list[int] = []
        sync_end: list[str] = []

        def read_sync() -> None:
            try:
                for delta in sync_job.stream(timeout=60):
                    sync_seen.extend(delta.token_ids)
                sync_end.append("ended")
            except ClientClosed:
                sync_end.append("closed")

        thread = threading.Thread(target=read_sync)
        thread.start()
        await wait_until(lambda: sync_seen, within_s=30)
        await asyncio.to_thread(sync.close)
        await asyncio.to_thread(thread.join, 30)
        assert sync_end == ["closed"]

        # the requests went on: another client reads each one's whole answer from the start
        async with AsyncClient(url) as fresh:
            for job, prompt in zip([*jobs, sync_job], [*prompts, "closed c"], strict=True):
                answer = await AsyncJob.attach(fresh, job.id, queue=job.keys.queue).result(timeout=60)
                assert answer.token_ids == expected_tokens(ids_of(prompt), LONG), prompt
                partial = seen.get(job.id, sync_seen)  # what the closed client had shown
                assert answer.token_ids[: len(partial)] == partial, prompt


STARTED_LOCK = threading.Lock()


def stream_in_a_thread(client: Client, prompt: str, queue: str, started: Counter[str]) -> tuple[str, list[int], str]:
    """Submit and stream one request through the shared sync `client`; `started` counts streams with tokens."""
    job: Job = client.submit(prompt, max_new_tokens=LONG, queue=queue)
    tokens: list[int] = []
    for delta in job.stream(timeout=90):
        assert delta.seq == len(tokens), f"{prompt}: a gap or a duplicate"
        if not tokens:
            with STARTED_LOCK:
                started[queue] += 1
        tokens += delta.token_ids
    return job.id, tokens, job.result(timeout=1).finish_reason


async def streams_in_threads(
    client: Client, work: list[tuple[str, str]], fault: Any, *, return_exceptions: bool = False
) -> list[Any]:
    """`work` (prompt, queue) streamed by one thread each; `fault()` runs once every stream has its first tokens.
    Each thread's (request id, tokens, finish reason), or its exception with `return_exceptions`."""
    started: Counter[str] = Counter()
    with ThreadPoolExecutor(len(work)) as pool:
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(pool, stream_in_a_thread, client, p, q, started) for p, q in work]
        await wait_until(lambda: sum(started.values()) == len(work), within_s=60)
        await fault()
        gathered = asyncio.gather(*futures, return_exceptions=return_exceptions)
        return list(await asyncio.wait_for(gathered, 120))


async def test_streams_on_a_healthy_shard_survive_a_short_outage_of_another_shard(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    """While a shard is down (its master and replica dead), every node answers CLUSTERDOWN; once it is back the
    streams of the other shards must go on. This caught three bugs: the sync client's reader took CLUSTERDOWN for
    fatal, the async client's reader task died silently (its streams hung until their timeout although the worker
    wrote every answer), and about one run in five the worker died too, of an AttributeError ('NoneType' object
    has no attribute 'writelines') that redis-py's asyncio cluster raises from a connection torn down under it."""
    masters = redis_cluster.masters()
    queue = redis_cluster.queue_on(masters[2])
    down, replica = masters[1], redis_cluster.replicas_of(masters[1])[0]
    url = redis_cluster.seed_url
    async with (
        serving(url, queue, tmp_path, step_s=0.01),
        AsyncClient(url, queue=queue) as client,
    ):
        async_jobs = {f"async {i}": await client.submit(f"async {i}", max_new_tokens=LONG) for i in range(6)}
        async_seen: dict[str, list[int]] = {prompt: [] for prompt in async_jobs}

        async def follow_async(prompt: str) -> list[int]:
            async for delta in async_jobs[prompt].stream(timeout=20):
                async_seen[prompt] += delta.token_ids
            return async_seen[prompt]

        async def outage() -> None:
            await wait_until(lambda: all(async_seen.values()), within_s=30)
            replica.kill()
            down.kill()
            await asyncio.sleep(3)  # the fault's length
            await asyncio.to_thread(redis_cluster.restart, down)

        following = asyncio.gather(*(follow_async(prompt) for prompt in async_jobs), return_exceptions=True)
        try:
            with Client(url, queue=queue) as sync:
                work = [(f"sync {i}", queue) for i in range(6)]
                sync_outputs = await streams_in_threads(sync, work, outage, return_exceptions=True)
        finally:
            await asyncio.to_thread(join_client_threads)
        async_outputs = await following
    outputs = {"sync": sync_outputs, "async": async_outputs}
    failed = {
        kind: [type(o).__name__ for o in found if isinstance(o, BaseException)] for kind, found in outputs.items()
    }
    assert not any(failed.values()), failed
    for (prompt, _), (_, tokens, _) in zip(work, sync_outputs, strict=True):
        assert tokens == expected_tokens(ids_of(prompt), LONG), prompt
    for prompt, tokens in zip(async_jobs, async_outputs, strict=True):
        assert tokens == expected_tokens(ids_of(prompt), LONG), prompt


async def test_the_sync_client_reads_results_after_the_first_master_is_killed(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    """The sync `Client` on a Cluster URL, after `kill -9` of the master of slot 0 and its replica's promotion,
    reads result streams on every shard. It once could not: redis-py 8.1's sync RedisCluster runs COMMAND GETKEYS
    for XREAD on its default node (the first master) and never replaces it, so every XREAD was refused."""
    masters = redis_cluster.masters()
    queue = redis_cluster.queue_on(masters[2])  # a shard that stays up
    async with serving(redis_cluster.seed_url, queue, tmp_path):
        try:
            with Client(redis_cluster.seed_url, queue=queue) as client:
                before = await asyncio.to_thread(client.generate, "before", max_new_tokens=4, timeout=30)
                assert before.token_ids == expected_tokens(ids_of("before"), 4)
                redis_cluster.kill_master(masters[0])
                await asyncio.to_thread(redis_cluster.wait_for_promotion, masters[0], 40)
                after = await asyncio.to_thread(client.generate, "after", max_new_tokens=4, timeout=4)
                assert after.token_ids == expected_tokens(ids_of("after"), 4)
        finally:
            await asyncio.to_thread(join_client_threads)  # its reader thread retries connection refused meanwhile


async def test_a_cancel_as_the_first_call_of_an_async_client_on_a_cluster_url(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    """An AsyncClient whose first call is `cancel()` (an admin tool holding only ids) cancels. It once raised
    RuntimeError('Event loop is closed'), and so did its `aclose()`: redis-py's asyncio ClusterPipeline in a
    transaction queued each command through `asyncio.run` in a thread, setting up connections on a throwaway loop."""
    queue = redis_cluster.queues_on_different_masters()[0]
    url = redis_cluster.seed_url
    async with serving(url, queue, tmp_path), AsyncClient(url, queue=queue) as submitter:
        job = await submitter.submit("cancel me", max_new_tokens=LONG)
        async for _ in job.stream(timeout=30):
            break
        canceller = AsyncClient(url, queue=queue)
        try:
            await AsyncJob.attach(canceller, job.id).cancel()
        finally:
            await canceller.aclose()
        with pytest.raises(Cancelled):
            await job.result(timeout=30)


async def test_a_cluster_url_with_a_dead_seed_reaches_the_cluster_through_the_live_one(
    redis_cluster: RedisClusterSet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seeds listed as an operator might after losing a node: a dead one first, then a replica."""
    queue = redis_cluster.queues_on_different_masters()[1]
    replica = redis_cluster.replicas_of(redis_cluster.masters()[0])[0]
    dead = f"{HOST}:{free_port()}"
    worker_url = f"redis+cluster://{dead},{HOST}:{replica.port}/0"
    client_url = f"redis+cluster://{HOST}:{replica.port},{dead}"
    async with serving(worker_url, queue, tmp_path), AsyncClient(worker_url, queue=queue) as client:
        await client.check()
        result = await client.generate("seeded", max_new_tokens=6, timeout=60)
        assert result.token_ids == expected_tokens(ids_of("seeded"), 6)
        with Client(client_url, queue=queue) as sync:
            await asyncio.to_thread(sync.check)
            job = await asyncio.to_thread(sync.submit, "seeded sync", max_new_tokens=LONG)
            await asyncio.to_thread(next, iter(job.stream(timeout=30)))  # running (a cancel before may be lost)
            await asyncio.to_thread(job.cancel)
            with pytest.raises(Cancelled):
                await asyncio.to_thread(job.result, 60)
        capsys.readouterr()
        assert await asyncio.to_thread(cli, ["status", "--url", client_url, "--queue", queue, "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out)["workers"]) == 1


async def test_llmq_submit_and_cancel_on_a_plain_url_to_the_wrong_node_name_the_cluster_url(
    redis_cluster: RedisClusterSet, capsys: pytest.CaptureFixture[str]
) -> None:
    node = redis_cluster.masters()[0]
    elsewhere = redis_cluster.queue_on(redis_cluster.masters()[2])
    for argv in (["submit", "hi", "--max-new-tokens", "2", "--timeout", "5"], ["cancel", "some-id"]):
        assert await asyncio.to_thread(cli, [*argv, "--url", node.url, "--queue", elsewhere]) == 4  # Exit.UNAVAILABLE
        err = capsys.readouterr().err
        assert "redis+cluster://" in err and "MOVED" not in err, err
    client = Client(node.url, queue=elsewhere)  # the library itself refuses the plain URL up front
    try:
        with pytest.raises(ValueError, match=r"redis\+cluster://"):
            await asyncio.to_thread(client.check)
    finally:
        client.close()


# -- Sentinel --------------------------------------------------------------------------------------------------


async def test_the_gateway_streams_through_a_sentinel_master_kill_and_a_restarted_worker_serves_after(
    sentinel_set: SentinelSet,
    tmp_path: Path,
    gateway: Any,  # noqa: F811 - the fixture imported above
    worker_logs: io.StringIO,
) -> None:
    url = sentinel_set.url  # both passwords in it
    prompts = [f"gateway {i}" for i in range(12)]
    started: set[str] = set()
    async with serving(url, "default", tmp_path, step_s=0.01, model="sentinel-model"):
        served = await gateway(redis_url=url, queues="default")
        model = await served.model()
        sdk = served.sdk(timeout=120)

        async def stream(prompt: str) -> tuple[str, str | None]:
            text, finish = "", None
            chunks = await sdk.completions.create(model=model, prompt=prompt, max_tokens=LONG, stream=True)
            async for chunk in chunks:
                for choice in chunk.choices:
                    text += choice.text
                    finish = choice.finish_reason or finish
                    started.add(prompt)
            return text, finish

        async def kill_the_master() -> None:
            await wait_until(lambda: len(started) == len(prompts), within_s=60)
            old = sentinel_set.kill_master()
            await asyncio.to_thread(sentinel_set.wait_for_new_master, old, 40)

        *answers, _ = await asyncio.gather(*(stream(prompt) for prompt in prompts), kill_the_master())
        for prompt, (text, finish) in zip(prompts, answers, strict=True):
            assert (finish, text) == ("length", scripted_text(prompt, LONG)), prompt
    # a new worker, started after the failover on the same URL, serves the gateway's next request
    async with serving(url, "default", tmp_path, model="sentinel-model"):
        assert await served.model() == model  # listed again once its first heartbeat is in
        answer = await sdk.completions.create(model=model, prompt="after", max_tokens=5)
        assert answer.choices[0].text == scripted_text("after", 5)
        async with served.http() as http:
            assert (await http.get("/health")).status_code == 200
    logs = worker_logs.getvalue()
    assert '"worker ready"' in logs and '"worker stopped"' in logs  # the capture saw the workers
    assert_no_secret(logs)


async def test_a_sentinel_master_killed_while_50_requests_stream_through_the_sync_client_in_threads(
    sentinel_set: SentinelSet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One sync client shared by 50 threads; the master dies once every stream has its first tokens."""
    url = sentinel_set.url

    async def kill_the_master() -> None:
        old = sentinel_set.kill_master()
        await asyncio.to_thread(sentinel_set.wait_for_new_master, old, 40)

    async with serving(url, "default", tmp_path, step_s=0.01):
        with Client(url) as client:
            work = [(f"thread {i}", "default") for i in range(50)]
            outputs = await streams_in_threads(client, work, kill_the_master)
            for (prompt, _), (_, tokens, reason) in zip(work, outputs, strict=True):
                assert (reason, tokens) == ("length", expected_tokens(ids_of(prompt), LONG)), prompt
            # the same client and the same worker, no restart: a new request
            result = await asyncio.to_thread(client.generate, "after", max_new_tokens=5, timeout=60)
            assert result.token_ids == expected_tokens(ids_of("after"), 5)
        counts = await terminal_events(url, Keys("default"), [request_id for request_id, _, _ in outputs])
        assert set(counts.values()) == {1}
        capsys.readouterr()
        assert await asyncio.to_thread(cli, ["status", "--url", url, "--queue", "default", "--json"]) == 0
        out, err = capsys.readouterr()
        status = json.loads(out)
        assert (status["queue"], status["depth"], status["dead"], len(status["workers"])) == ("default", 0, 0, 1)
        assert_no_secret(out + err)


async def test_wrong_credentials_and_an_unknown_service_on_a_sentinel_url_fail_check_without_showing_secrets(
    sentinel_set: SentinelSet, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong_data = sentinel_url(sentinel_set, password="wrong pass", sentinel_password=SENTINEL_PASSWORD)
    async with AsyncClient(wrong_data) as client:
        with pytest.raises(RedisUnavailable) as caught:  # the client's typed error, redis-py's as its cause
            await client.check()
    assert isinstance(caught.value.__cause__, redis.AuthenticationError)
    assert_no_secret(str(caught.value))
    with Client(wrong_data) as sync, pytest.raises(RedisUnavailable) as caught:
        await asyncio.to_thread(sync.check)
    assert isinstance(caught.value.__cause__, redis.AuthenticationError)
    assert_no_secret(str(caught.value))
    capsys.readouterr()
    assert await asyncio.to_thread(cli, ["status", "--url", wrong_data, "--queue", "default"]) == 4  # Exit.UNAVAILABLE
    err = capsys.readouterr().err
    assert err.startswith("llmq: error:") and len(err.strip().splitlines()) == 1, err
    assert_no_secret(err)

    # the sentinels' own password wrong: one sentinel and no retries, as the refusal is retried like a lost
    # connection, about 16 s per sentinel listed by default
    one = sentinel_set.sentinels[0].port
    wrong_watch = f"redis+sentinel://:{quote(DATA_PASSWORD)}@{HOST}:{one}/llmq?sentinel_password=hunter2"
    async with AsyncClient(wrong_watch, retry=AsyncRetry(NoBackoff(), 0)) as client:
        with pytest.raises(RedisUnavailable) as caught:
            await client.check()
    assert "AuthenticationError" in str(caught.value)
    assert_no_secret(str(caught.value))

    unknown = sentinel_url(
        sentinel_set, password=DATA_PASSWORD, sentinel_password=SENTINEL_PASSWORD, service="no-such-service"
    )
    async with AsyncClient(unknown, failover_timeout=1) as client:  # no master is retried: a failover shows one
        with pytest.raises(RedisUnavailable, match="no-such-service") as caught:
            await client.check()
        assert_no_secret(str(caught.value))
        with pytest.raises(RedisUnavailable):
            await client.submit("never accepted")
    capsys.readouterr()
    assert await asyncio.to_thread(cli, ["status", "--url", unknown, "--queue", "default"]) == 4  # Exit.UNAVAILABLE
    err = capsys.readouterr().err
    assert "no-such-service" in err
    assert_no_secret(err)

    # and the right URL still works, from the same process
    async with AsyncClient(sentinel_set.url) as client:
        await client.check()
        assert (await client.status()).depth == 0


# -- the worker process ----------------------------------------------------------------------------------------


def test_the_worker_process_refuses_a_sentinel_url_it_cannot_use_in_one_line_before_loading_its_model(
    sentinel_set: SentinelSet, tmp_path: Path
) -> None:
    """An unknown service and a wrong data password: one line naming the problem, no secret, no traceback."""
    model = tmp_path / "no-such-model"
    wrong = {
        sentinel_url(sentinel_set, password=DATA_PASSWORD, sentinel_password=SENTINEL_PASSWORD, service="nosuch"): (
            "No master found for 'nosuch'"
        ),
        sentinel_url(sentinel_set, password="wrong pass", sentinel_password=SENTINEL_PASSWORD): "password",
    }
    runs = {
        url: subprocess.Popen(
            [sys.executable, "-m", "worker", "--redis-url", url, "--model", str(model), "--metrics-port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for url in wrong
    }
    try:
        for url, run in runs.items():
            _, stderr = run.communicate(timeout=150)
            assert run.returncode != 0 and wrong[url] in stderr, stderr
            assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
            assert str(model) not in stderr  # refused before the model
            assert_no_secret(stderr)
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
