"""Reading results, cancelling and queue status on a real redis-server, through both twins.

The test plays the worker: it writes events to the result stream with XADD, as the publisher does.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from client import Cancelled, Delta, RequestExpired, RequestFailed, ResultTimeout, protocol, store
from tests.client.twins import KEYS, Twin, TwinFactory, done, emit, tokens
from tests.polling import wait_until

pytestmark = pytest.mark.redis


async def test_stream_yields_deltas_as_they_arrive(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit()
    got: list[Delta] = []
    reading = asyncio.create_task(job.collect(got, wait_s=10))
    await emit(server, job.id, tokens(0, [1, 2], "He"))
    await wait_until(lambda: len(got) == 1)  # delivered before the request finished
    await emit(server, job.id, tokens(2, [3], "llo"), done(completion_tokens=3))
    await reading
    assert got == [Delta("He", [1, 2], 0), Delta("llo", [3], 2)]
    assert job.finish_reason == "eos"


async def test_result_collects_everything(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit()
    await emit(server, job.id, tokens(0, [1], "a"), tokens(0, [1], "a"), tokens(1, [2, 3], "bc"), done("length", 3))
    result = await job.result(wait_s=5)
    assert (result.request_id, result.text, result.token_ids, result.finish_reason) == (
        job.id,
        "abc",
        [1, 2, 3],
        "length",
    )
    assert result.usage == protocol.Usage(prompt_tokens=3, completion_tokens=3)
    assert result.timings.ttft_ms == 2.0
    assert await job.result() == result  # asking again needs no new events


async def test_generate_is_submit_then_result(twin: Twin, server: aioredis.Redis) -> None:
    async def worker() -> None:
        [[_key, [(_entry, fields)]]] = await server.xread({KEYS.requests: "0-0"}, block=5000)
        request = protocol.decode_request(fields[protocol.ENTRY_FIELD])
        await emit(server, request.id, tokens(0, [7], request.prompt or ""), done())

    serving = asyncio.create_task(worker())
    result = await twin.generate("echo", timeout=5)
    await serving
    assert result.text == "echo"


@pytest.mark.parametrize(
    ("code", "cls"),
    [("expired", RequestExpired), ("engine_failed", RequestFailed), ("not_yet_invented", RequestFailed)],
)
async def test_error_events_become_typed_errors(
    twin: Twin, server: aioredis.Redis, code: str, cls: type[RequestFailed]
) -> None:
    job = await twin.submit()
    await emit(server, job.id, tokens(0, [1], "a"), protocol.ErrorEvent(code=code, message="nope", retryable=True))
    with pytest.raises(RequestFailed) as info:
        await job.result(wait_s=5)
    assert type(info.value) is cls
    assert (info.value.code, info.value.message, info.value.retryable) == (code, "nope", True)
    with pytest.raises(cls):  # the stream raises too, after the output that came first
        await job.collect(wait_s=5)


async def test_result_timeout_names_the_request(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit()
    with pytest.raises(ResultTimeout, match=f"'{job.id}'.*first event"):
        await job.result(wait_s=0.3)
    await emit(server, job.id, tokens(0, [1, 2], "ab"))
    with pytest.raises(TimeoutError, match="'done' event after 2 tokens"):
        await job.result(wait_s=0.3)


async def test_cancel_marks_and_publishes(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit()
    pubsub = server.pubsub()
    await pubsub.subscribe(KEYS.cancel_channel)
    assert (await pubsub.get_message(timeout=1))["type"] == "subscribe"  # type: ignore[index]
    await job.cancel()
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
    await pubsub.aclose()
    assert message is not None and message["data"] == job.id.encode()
    assert 0 < await server.ttl(KEYS.cancel(job.id)) <= 3600


async def test_a_cancelled_request_ends_the_stream_and_fails_result(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit()
    await emit(server, job.id, tokens(0, [1], "par"), tokens(1, [2], "tial"), done("cancelled", 2))
    assert "".join(d.text for d in await job.collect(wait_s=5)) == "partial"
    assert job.finish_reason == "cancelled"
    with pytest.raises(Cancelled) as info:
        await job.result(wait_s=5)
    assert (info.value.result.text, info.value.result.finish_reason) == ("partial", "cancelled")


async def test_attach_reads_from_the_start(make_twin: TwinFactory, server: aioredis.Redis) -> None:
    submitter, follower = make_twin(), make_twin()
    job = await submitter.submit(request_id="elsewhere")
    await emit(server, job.id, tokens(0, [1], "x"), tokens(1, [2], "y"), done())
    attached = follower.attach("elsewhere")
    assert (await attached.result(wait_s=5)).text == "xy"
    other_queue = follower.attach("elsewhere", queue="other")
    with pytest.raises(ResultTimeout):
        await other_queue.result(wait_s=0.2)
    with pytest.raises(ValueError, match="request id"):
        follower.attach("not a valid id")


async def kill_blocked_read(server: aioredis.Redis) -> bool:
    """Kills the client's connection while it is blocked in XREAD (Redis flags it `b`), if it is now."""
    for client in await server.client_list():
        if "b" in client.get("flags", "") and client.get("cmd") == "xread":
            return bool(await server.client_kill_filter(_id=client["id"]))
    return False


@pytest.mark.parametrize("redis_retries", [False, True], ids=["own-retry", "redis-py-retry"])
async def test_stream_resumes_after_the_connection_drops(
    make_twin: TwinFactory, server: aioredis.Redis, redis_retries: bool, caplog: pytest.LogCaptureFixture
) -> None:
    twin = make_twin(redis_retries=redis_retries)
    job = await twin.submit()
    got: list[Delta] = []
    with caplog.at_level(logging.WARNING, logger="llmq.client"):
        reading = asyncio.create_task(job.collect(got, wait_s=20))
        await emit(server, job.id, tokens(0, [1], "a"), tokens(1, [2], "b"))
        await wait_until(lambda: len(got) == 2)
        await wait_until(lambda: kill_blocked_read(server))  # mid-read: an idle connection the pool would renew
        # The worker re-sends around the drop (as after its own reconnect): duplicates must vanish.
        await emit(server, job.id, tokens(1, [2, 3], "bc"), tokens(3, [4], "d"), done(completion_tokens=4))
        await reading
    assert [d.seq for d in got] == [0, 1, 2, 3]
    assert ("".join(d.text for d in got), [t for d in got for t in d.token_ids]) == ("abcd", [1, 2, 3, 4])
    if not redis_retries:
        assert "retrying" in caplog.text  # our own backoff did the reconnecting


async def test_pooled_connections_closed_by_redis_are_replaced_without_failing_a_call(
    twin: Twin, server: aioredis.Redis
) -> None:
    """A Redis restart (here: every client connection killed) leaves the pool holding closed connections; the
    next calls on them are retried on new ones instead of failing (the gateway answered one 503 per restart)."""
    await asyncio.gather(*(twin.status() for _ in range(6)))  # several pooled connections
    await twin.submit()
    assert await server.client_kill_filter(_type="normal", skipme=True) >= 1
    for _ in range(6):
        await twin.status()
        await twin.submit()


async def test_status_counts(twin: Twin, server: aioredis.Redis) -> None:
    empty = await twin.status()
    assert (empty.queue, empty.depth, empty.pending, empty.lag, empty.dead, empty.workers) == (
        "default",
        0,
        None,
        None,
        0,
        [],
    )
    for _ in range(3):
        await twin.submit()
    await server.xgroup_create(KEYS.requests, store.CONSUMER_GROUP, id="0")
    await server.xreadgroup(store.CONSUMER_GROUP, "w1", {KEYS.requests: ">"}, count=1)
    await server.xadd(KEYS.dead, {"m": b"junk"})
    now = protocol.ms_now()
    live = protocol.WorkerInfo(
        id="w1",
        host="h",
        pid=1,
        queue="default",
        model="m",
        running=1,
        waiting=0,
        kv_used_blocks=5,
        kv_total_blocks=50,
        tokens_generated=9,
        started=now,
        heartbeat=now,
    )
    stale = live.model_copy(update={"id": "w0", "heartbeat": now - 60_000})
    await server.hset(KEYS.workers, mapping={"w1": protocol.encode(live), "w0": protocol.encode(stale), "bad": b"?"})
    status = await twin.status()
    assert (status.depth, status.pending, status.lag, status.dead) == (3, 1, 2, 1)
    assert status.workers == [live]
    assert [w.id for w in (await twin.status(stale_after_s=120)).workers] == ["w0", "w1"]
    assert status.as_dict()["workers"][0]["kv_used_blocks"] == 5
