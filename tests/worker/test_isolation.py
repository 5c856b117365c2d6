"""A Redis error caused by one request's keys fails that request alone, in every batch operation: the
intake's pipeline, the publisher's flush script and the hand-back script (real redis-server)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from client import AsyncClient, RequestFailed
from client.protocol import TokensEvent, decode_dead_letter, decode_event
from client.scripts import CONSUMER_GROUP, Fence, HandBackReason
from client.store import Keys
from worker.leases import Leases
from worker.publisher import Publisher, Target

KEYS = Keys("default")


@pytest.fixture
async def redis(redis_url: str) -> Any:
    async with Redis.from_url(redis_url) as client:
        await client.xgroup_create(KEYS.requests, CONSUMER_GROUP, id="0", mkstream=True)
        yield client


async def pending_entries(redis: Redis, count: int) -> list[bytes]:
    ids = [await redis.xadd(KEYS.requests, {b"m": b"x"}) for _ in range(count)]
    await redis.xreadgroup(CONSUMER_GROUP, "w", {KEYS.requests: ">"})
    return ids


async def test_publisher_isolates_an_event_redis_refuses(redis: Redis) -> None:
    refused: list[tuple[Target, str]] = []
    publisher = Publisher(redis, KEYS, on_failed=lambda target, message: refused.append((target, message)))
    flusher = asyncio.create_task(publisher.run())
    entries = await pending_entries(redis, 3)
    await redis.set(KEYS.result("r1"), "not a stream")  # r1's result stream is the wrong type
    targets = [Target(f"r{i}", 60, entry_id=entries[i]) for i in range(3)]
    for seq in range(3):
        for target in targets:
            publisher.tokens(target, TokensEvent(seq=seq, ids=[seq], text="a"))
    for target in targets:
        publisher.finish(target, None, seq=3)
    await publisher.wait_idle()
    assert [t.request_id for t, _ in refused] == ["r1"] and "WRONGTYPE" in refused[0][1]
    for good in ("r0", "r2"):
        assert [decode_event(f[b"m"]).seq for _, f in await redis.xrange(KEYS.result(good))] == [0, 1, 2]
    assert await redis.get(KEYS.result("r1")) == b"not a stream"
    # The good ones were acknowledged; r1's entry is left for the worker to dead-letter (it was told).
    assert [p["message_id"] for p in await redis.xpending_range(KEYS.requests, CONSUMER_GROUP, "-", "+", 10)] == [
        entries[1]
    ]
    assert publisher.stats.refused == 1 and publisher.backlog == 0
    publisher.stop()
    await flusher


async def test_hand_back_counts_each_request_on_its_own(redis: Redis) -> None:
    entries = await pending_entries(redis, 2)
    await redis.set(KEYS.fence("a"), "not a hash")
    await redis.hset(KEYS.fence("b"), Fence.ATTEMPT, 1)
    leases = Leases(redis, KEYS, "w", lease_timeout_s=5.0)
    handed = await leases.hand_back([(entries[0], "a"), (entries[1], "b")], HandBackReason.ENGINE_FAILURE)
    assert handed == 2
    assert await redis.hmget(KEYS.fence("b"), Fence.HANDED_BACK, Fence.ENGINE_FAILURES) == [b"1", b"1"]
    assert len(await leases.claim(10)) == 2  # both claimable at once


async def test_a_request_whose_fence_redis_refuses_fails_alone(start_worker: Any, client: AsyncClient) -> None:
    await start_worker()
    async with Redis.from_url(client._url) as redis:
        await redis.set(KEYS.fence("broken-fence"), "not a hash")
    good = [await client.submit(input_ids=[3, 4, 5 + i], max_new_tokens=6, temperature=0) for i in range(3)]
    bad = await client.submit(input_ids=[3, 4, 5], max_new_tokens=6, temperature=0, request_id="broken-fence")
    good += [await client.submit(input_ids=[6, 4, 5 + i], max_new_tokens=6, temperature=0) for i in range(3)]
    results = await asyncio.gather(*(job.result(timeout=30) for job in good))
    assert all(len(r.token_ids) == 6 for r in results)
    with pytest.raises(RequestFailed) as failure:
        await bad.result(timeout=30)
    assert failure.value.code == "internal" and "WRONGTYPE" in failure.value.message


async def test_a_request_whose_result_stream_redis_refuses_is_dead_lettered_alone(
    start_worker: Any, client: AsyncClient
) -> None:
    running = await start_worker()
    async with Redis.from_url(client._url) as redis:
        await redis.set(KEYS.result("broken-result"), "not a stream")
        good = [await client.submit(input_ids=[3, 4, 5 + i], max_new_tokens=6, temperature=0) for i in range(3)]
        await client.submit(input_ids=[3, 4, 5], max_new_tokens=6, temperature=0, request_id="broken-result")
        good += [await client.submit(input_ids=[6, 4, 5 + i], max_new_tokens=6, temperature=0) for i in range(3)]
        results = await asyncio.gather(*(job.result(timeout=30) for job in good))
        assert all(len(r.token_ids) == 6 for r in results)
        for _ in range(100):
            if await redis.xlen(KEYS.dead):
                break
            await asyncio.sleep(0.05)
        ((_, letter),) = await redis.xrange(KEYS.dead)
        body = decode_dead_letter(letter[b"m"])
        assert "refused" in body.reason and body.entry_id.split("-")[0].isdigit()  # its request stream entry
        assert await redis.xlen(KEYS.requests) == 0  # acknowledged: no worker meets it again
    assert running.worker.engine.stats().running == 0 and not running.worker.runs
