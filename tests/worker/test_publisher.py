"""Publisher batching on fakeredis: one script call per flush, events in order, the ack after the last event."""

from __future__ import annotations

import asyncio
from typing import Any

import fakeredis
import pytest

from client.protocol import DoneEvent, ErrorEvent, TokensEvent, Usage, decode_event
from client.store import CONSUMER_GROUP, Keys
from worker.publisher import Publisher, Target

KEYS = Keys("default")


class CountingRedis(fakeredis.FakeAsyncRedis):
    """Counts script calls: the publisher must make one round trip per flush, whatever it carries."""

    executed = 0

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if args and str(args[0]).upper() in ("EVALSHA", "EVAL"):
            CountingRedis.executed += 1
        return await super().execute_command(*args, **kwargs)


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


async def test_one_round_trip_carries_a_whole_step(redis: Any) -> None:
    publisher = Publisher(redis, KEYS)
    flusher = asyncio.create_task(publisher.run())
    entries = await enqueue(redis, 3)
    publisher.tokens(Target("warm-up", 60), TokensEvent(seq=0, ids=[1], text="a"))  # loads the script
    await publisher.wait_idle()
    CountingRedis.executed = 0
    for i in range(3):  # one engine step: three requests advanced, the last one finished
        publisher.tokens(Target(f"r{i}", 60), TokensEvent(seq=0, ids=[1, 2], text="ab"))
    publisher.finish(Target("r2", 60, entry_id=entries[2]), done(2), seq=2)
    await publisher.wait_idle()
    assert CountingRedis.executed == 1 and publisher.stats.flushes == 2 and publisher.stats.events == 5
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
        publisher.tokens(Target("r", 60), TokensEvent(seq=seq, ids=[seq, seq + 1, seq + 2], text="x"))
        await asyncio.sleep(0)
    error = ErrorEvent(code="engine_failed", message="boom", retryable=True)
    publisher.finish(Target("r", 60, entry_id=entry), error, seq=30)
    await publisher.wait_idle()
    events = [decode_event(f[b"m"]) for _, f in await redis.xrange(KEYS.result("r"))]
    assert [e.seq for e in events[:-1]] == list(range(0, 30, 3)) and events[-1].type == "error"
    assert CountingRedis.executed < 11  # batched, not one round trip per event
    assert await redis.xlen(KEYS.requests) == 0
    flusher.cancel()


async def test_events_wait_out_an_outage_in_order() -> None:
    server = fakeredis.FakeServer()
    server.connected = False  # Redis is down
    redis = fakeredis.FakeAsyncRedis(server=server)
    errors: list[Exception] = []
    publisher = Publisher(redis, KEYS, on_error=errors.append)
    flusher = asyncio.create_task(publisher.run())
    for seq in range(5):
        publisher.tokens(Target("r", 60), TokensEvent(seq=seq, ids=[seq], text="a"))
        await asyncio.sleep(0.02)
    assert publisher.backlog == 5 and publisher.stats.failures >= 1 and errors
    server.connected = True
    await asyncio.wait_for(publisher.wait_idle(), 10)
    events = [decode_event(f[b"m"]) for _, f in await redis.xrange(KEYS.result("r"))]
    assert [e.seq for e in events] == [0, 1, 2, 3, 4] and publisher.backlog == 0
    flusher.cancel()


async def test_fenced_writes_are_dropped_and_reported(redis: Any) -> None:
    fenced: list[tuple[str, int]] = []
    publisher = Publisher(redis, KEYS, on_fenced=lambda request_id, attempt: fenced.append((request_id, attempt)))
    flusher = asyncio.create_task(publisher.run())
    (entry,) = await enqueue(redis, 1)
    await redis.hset(KEYS.fence("r"), "a", 2)  # another worker claimed the request: attempt 2
    publisher.tokens(Target("r", 60, attempt=1), TokensEvent(seq=0, ids=[1], text="a"))
    publisher.finish(Target("r", 60, attempt=1, entry_id=entry), done(1), seq=1)
    publisher.tokens(Target("r", 60, attempt=2), TokensEvent(seq=0, ids=[7], text="b"))
    publisher.tokens(Target("r", 60, attempt=2), TokensEvent(seq=0, ids=[7], text="b"))  # a retried duplicate
    await publisher.wait_idle()
    events = [decode_event(f[b"m"]) for _, f in await redis.xrange(KEYS.result("r"))]
    assert [(e.seq, e.ids) for e in events] == [(0, [7])]
    assert fenced == [("r", 1)] and publisher.stats.fenced == 1
    assert (await redis.xpending(KEYS.requests, CONSUMER_GROUP))["pending"] == 1  # the stale ack was refused
    flusher.cancel()


async def test_each_client_gets_one_notice_per_flush_naming_its_streams(redis: Any) -> None:
    publisher = Publisher(redis, KEYS)
    flusher = asyncio.create_task(publisher.run())
    for request_id, client_id in (("r0", "c1"), ("r1", "c1"), ("r2", "c2"), ("r3", None)):
        publisher.tokens(Target(request_id, 60, notify=client_id), TokensEvent(seq=0, ids=[1], text="a"))
    await publisher.wait_idle()
    c1, c2 = await redis.xrange(KEYS.wake("c1")), await redis.xrange(KEYS.wake("c2"))
    assert [fields[b"r"].split() for _, fields in c1] == [[KEYS.result("r0").encode(), KEYS.result("r1").encode()]]
    assert [fields[b"r"] for _, fields in c2] == [KEYS.result("r2").encode()]
    assert 0 < await redis.ttl(KEYS.wake("c1")) <= 600
    assert len(await redis.keys(f"{KEYS.tag}:wake:*")) == 2  # r3 named no client: no notice
    flusher.cancel()


async def test_an_event_past_what_the_stream_holds_is_not_written_and_reported_behind(redis: Any) -> None:
    """After a failover lost a stream's last writes, the fence says it holds fewer tokens than the worker's next
    event follows. Writing it would leave a gap every later reader trips over; the publisher reports the request
    instead (to be handed back and resumed from what the stream holds) and drops its other queued events."""
    behind: list[Target] = []
    publisher = Publisher(redis, KEYS, on_behind=behind.append)
    flusher = asyncio.create_task(publisher.run())
    (entry,) = await enqueue(redis, 1)
    target = Target("r", 60, attempt=1, entry_id=entry)
    await redis.hset(KEYS.fence("r"), mapping={"a": 1})
    publisher.tokens(target, TokensEvent(seq=0, ids=[1, 2], text="ab"))
    await publisher.wait_idle()
    await redis.hset(KEYS.fence("r"), "n", 1)  # the promoted replica had only the first token
    publisher.tokens(target, TokensEvent(seq=2, ids=[3], text="c"))
    publisher.finish(target, done(3), seq=3)
    await publisher.wait_idle()
    assert behind == [target] and publisher.stats.behind == 1
    assert [e.type for e in [decode_event(f[b"m"]) for _, f in await redis.xrange(KEYS.result("r"))]] == ["tokens"]
    assert (await redis.xpending(KEYS.requests, CONSUMER_GROUP))["pending"] == 1  # not acknowledged
    flusher.cancel()


class OneShardHangs(fakeredis.FakeAsyncRedis):
    """Script calls on the keys that contain `hung` get no answer until `back` is set (their shard's master
    killed, the connect timing out); every other call is answered at once."""

    hung = "{llmq:default#1}"
    back: asyncio.Event

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        script = bool(args) and str(args[0]).upper() in ("EVALSHA", "EVAL")
        if script and any(isinstance(arg, str) and self.hung in arg for arg in args):
            await self.back.wait()
        return await super().execute_command(*args, **kwargs)


async def test_a_partition_whose_shard_hangs_holds_back_its_own_events_only() -> None:
    redis = OneShardHangs()
    redis.back = asyncio.Event()
    publisher = Publisher(redis, KEYS, partitions=2)
    flusher = asyncio.create_task(publisher.run())
    healthy, hurt = Target("healthy", 60, partition=0), Target("hurt", 60, partition=1)
    publisher.tokens(hurt, TokensEvent(seq=0, ids=[7], text="h"))
    for seq in range(5):  # five engine steps while the other shard hangs: each is written as it comes
        publisher.tokens(healthy, TokensEvent(seq=seq, ids=[seq], text="x"))
        await wait_until_written(redis, KEYS.result("healthy"), seq + 1)
    assert await redis.xlen(KEYS.partitioned(2)[1].result("hurt")) == 0  # still waiting on its shard
    redis.back.set()
    publisher.tokens(hurt, TokensEvent(seq=1, ids=[8], text="i"))
    await publisher.wait_idle()
    hurt_events = [decode_event(f[b"m"]) for _, f in await redis.xrange(KEYS.partitioned(2)[1].result("hurt"))]
    assert [event.ids for event in hurt_events if isinstance(event, TokensEvent)] == [[7], [8]]  # in order, once
    publisher.stop()
    await flusher
    await redis.aclose()


async def wait_until_written(redis: Any, stream: str, count: int) -> None:
    async with asyncio.timeout(10):
        while await redis.xlen(stream) < count:
            await asyncio.sleep(0.01)


async def test_a_failing_callback_stops_the_flusher_with_its_error(redis: Any) -> None:
    """A bug in what hears a flush's answers is not swallowed by the partition's flight: `run` raises it."""
    publisher = Publisher(redis, KEYS)
    flusher = asyncio.create_task(publisher.run())

    def broken(outcome: Any) -> None:
        raise RuntimeError("a bug in on_written")

    publisher.finish(Target("r", 60), done(0), on_written=broken)
    with pytest.raises(RuntimeError, match="a bug in on_written"):
        async with asyncio.timeout(10):
            await flusher
