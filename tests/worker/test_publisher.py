"""Publisher batching on fakeredis: one pipeline per flush, events in order, the ack after the last event."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest

from client.protocol import CONSUMER_GROUP, DoneEvent, ErrorEvent, Keys, TokensEvent, Usage, decode_event
from worker.publisher import Publisher

KEYS = Keys("default")


class CountingRedis(fakeredis.FakeAsyncRedis):
    """Counts pipelines executed: the publisher must use one per flush, whatever it carries."""

    executed = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = super().pipeline(*args, **kwargs)
        execute = pipe.execute

        async def counted(*a: Any, **k: Any) -> Any:
            CountingRedis.executed += 1
            return await execute(*a, **k)

        pipe.execute = counted
        return pipe


@pytest.fixture
async def redis() -> Any:
    CountingRedis.executed = 0
    client = CountingRedis()
    await client.xgroup_create(KEYS.requests, CONSUMER_GROUP, id="0", mkstream=True)
    yield client
    await client.aclose()


async def enqueue(redis: Any, count: int) -> list[bytes]:
    ids = [await redis.xadd(KEYS.requests, {b"m": b"x"}) for _ in range(count)]
    await redis.xreadgroup(CONSUMER_GROUP, "w", {KEYS.requests: ">"})
    return ids


def done(tokens: int) -> DoneEvent:
    return DoneEvent(finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=tokens))


async def test_one_pipeline_carries_a_whole_step(redis: Any) -> None:
    publisher = Publisher(redis, KEYS)
    flusher = asyncio.create_task(publisher.run())
    entries = await enqueue(redis, 3)
    for i in range(3):  # one engine step: three requests advanced, the last one finished
        publisher.tokens(f"r{i}", 60, TokensEvent(seq=0, ids=[1, 2], text="ab"))
    publisher.finish("r2", 60, done(2), entries[2])
    await publisher.wait_idle()
    assert CountingRedis.executed == 1 and publisher.stats.flushes == 1 and publisher.stats.events == 4
    events = [decode_event(f[b"m"]) for _, f in await redis.xrange(KEYS.result("r2"))]
    assert [e.type for e in events] == ["tokens", "done"]
    assert await redis.xlen(KEYS.requests) == 2  # only r2's entry was acknowledged and deleted
    assert (await redis.xpending(KEYS.requests, CONSUMER_GROUP))["pending"] == 2
    assert 0 < await redis.ttl(KEYS.result("r0")) <= 60
    flusher.cancel()


async def test_events_stay_in_order_across_flushes(redis: Any) -> None:
    publisher = Publisher(redis, KEYS)
    flusher = asyncio.create_task(publisher.run())
    (entry,) = await enqueue(redis, 1)
    for seq in range(0, 30, 3):
        publisher.tokens("r", 60, TokensEvent(seq=seq, ids=[seq, seq + 1, seq + 2], text="x"))
        await asyncio.sleep(0)
    publisher.finish("r", 60, ErrorEvent(code="engine_failed", message="boom", retryable=True), entry)
    await publisher.wait_idle()
    events = [decode_event(f[b"m"]) for _, f in await redis.xrange(KEYS.result("r"))]
    assert [e.seq for e in events[:-1]] == list(range(0, 30, 3)) and events[-1].type == "error"
    assert CountingRedis.executed < 11  # batched, not one round trip per event
    assert await redis.xlen(KEYS.requests) == 0
    flusher.cancel()


async def test_a_failed_flush_is_reported() -> None:
    server = fakeredis.FakeServer()
    server.connected = False  # Redis is down
    down = fakeredis.FakeAsyncRedis(server=server)
    errors: list[Exception] = []
    publisher = Publisher(down, KEYS, on_error=errors.append)
    flusher = asyncio.create_task(publisher.run())
    publisher.tokens("r", 60, TokensEvent(seq=0, ids=[1], text="a"))
    await publisher.wait_idle()
    assert publisher.stats.failures == 1 and publisher.stats.flushes == 0 and errors
    flusher.cancel()
