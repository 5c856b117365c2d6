"""One queue over several partitions (`LLMQ_QUEUE_PARTITIONS`): each request lives in the partition of its id, a
worker reads, claims, cancels, preempts and publishes in all of them, and status adds them up. In-process workers
on the scripted engine and a real redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Client
from client.store import CONSUMER_GROUP, Keys, merge_partitions, partition_of, status_from_replies
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until
from tests.topologies.partitions_support import ids_in

PARTITIONS = 3
PARTS = Keys("default").partitioned(PARTITIONS)


def test_partition_zero_is_the_queue_of_one_partition_and_the_others_are_other_slots() -> None:
    assert PARTS[0] == Keys("default") and PARTS[0].requests == "{llmq:default}:requests"
    assert [keys.tag for keys in PARTS] == ["{llmq:default}", "{llmq:default#1}", "{llmq:default#2}"]
    assert {keys.workers for keys in PARTS} == {Keys("default").workers}  # heartbeats: one hash for the queue
    assert partition_of("request-1", 1) == 0
    assert partition_of("request-1", 3) == partition_of("request-1", 3)  # the same in every process (CRC-32)
    spread = [partition_of(f"r{i}", 4) for i in range(4000)]
    assert all(900 < spread.count(p) < 1100 for p in range(4))


async def test_a_partitioned_queue_serves_every_request_and_status_adds_the_partitions_up(
    start_worker: Any, redis_url: str
) -> None:
    async with AsyncClient(redis_url, partitions=PARTITIONS) as client:
        jobs = {i: await client.submit(input_ids=[3, i], max_new_tokens=5, temperature=0) for i in range(60)}
        async with Redis.from_url(redis_url) as redis:
            depths = [await redis.xlen(keys.requests) for keys in PARTS]
        assert sum(depths) == 60 and min(depths) > 5  # spread by id over the three partitions
        for job in jobs.values():
            assert job.keys == PARTS[partition_of(job.id, PARTITIONS)]
        status = await client.status()
        assert status.depth == 60 and [p.depth for p in status.partitions] == depths
        await start_worker(queue_partitions=PARTITIONS)
        results = await asyncio.gather(*(job.result(timeout=30) for job in jobs.values()))
        assert [r.token_ids for r in results] == [expected_tokens([3, i], 5) for i in jobs]
        await wait_until(lambda: _drained(client))
        attached = AsyncJob.attach(client, jobs[7].id)  # by id alone: the partition follows from it
        assert (await attached.result(timeout=10)).token_ids == expected_tokens([3, 7], 5)

    def through_the_sync_client() -> list[int]:  # in a thread: the worker runs on this test's event loop
        with Client(redis_url, partitions=PARTITIONS) as sync:
            return sync.generate(input_ids=[9, 9], max_new_tokens=3, timeout=30).token_ids

    assert await asyncio.to_thread(through_the_sync_client) == expected_tokens([9, 9], 3)


async def _drained(client: AsyncClient) -> bool:
    status = await client.status()
    return status.depth == 0 and status.pending == 0


async def test_cancels_reach_requests_in_every_partition(start_worker: Any, redis_url: str) -> None:
    await start_worker(queue_partitions=PARTITIONS, step_s=0.02, max_running=16)
    async with AsyncClient(redis_url, partitions=PARTITIONS) as client:
        one_per_partition = [ids_in(partition, PARTITIONS)[0] for partition in range(PARTITIONS)]
        jobs = [await client.submit(input_ids=[5], max_new_tokens=500, request_id=i) for i in one_per_partition]
        jobs += [await client.submit(input_ids=[5, i], max_new_tokens=500) for i in range(6)]  # and random ids
        assert {partition_of(job.id, PARTITIONS) for job in jobs} == {0, 1, 2}
        for job in jobs:
            async for _ in job.stream(timeout=30):
                break
        for job in jobs:
            await job.cancel()
        finishes = set()
        for job in jobs:
            async for _ in job.stream(timeout=30):
                pass
            finishes.add(job.finish_reason)
        assert finishes == {"cancelled"}


async def test_a_dead_workers_request_in_another_partition_is_claimed_and_resumed(
    start_worker: Any, redis_url: str
) -> None:
    request_id = ids_in(2, PARTITIONS)[0]
    keys = PARTS[2]
    expected = expected_tokens([3, 4, 5], 12)
    async with AsyncClient(redis_url, partitions=PARTITIONS) as client:
        job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=12, temperature=0, request_id=request_id)
        async with Redis.from_url(redis_url) as redis:
            await redis.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
            await redis.xreadgroup(CONSUMER_GROUP, "ghost", {keys.requests: ">"})  # a worker that then died
            await redis.hset(keys.fence(request_id), mapping={"a": 1, "n": 4})
            event = {"v": 1, "type": "tokens", "seq": 0, "ids": expected[:4], "text": "partial"}
            await redis.xadd(keys.result(request_id), {b"m": msgpack.packb(event)})
            await start_worker(queue_partitions=PARTITIONS, lease_timeout_s=0.3, claim_interval_s=0.1)
            assert (await job.result(timeout=30)).token_ids == expected
            assert await redis.hget(keys.fence(request_id), "a") == b"2"


async def test_an_interactive_request_in_one_partition_preempts_batch_work_of_another(
    start_worker: Any, redis_url: str
) -> None:
    await start_worker(queue_partitions=PARTITIONS, max_running=2, step_s=0.03)  # batch: 15 s to finish
    async with AsyncClient(redis_url, partitions=PARTITIONS) as client:
        batch = [await client.submit(input_ids=[6, i], max_new_tokens=500, priority="batch") for i in range(2)]
        for job in batch:
            async for _ in job.stream(timeout=30):
                break
        batch_partitions = {partition_of(job.id, PARTITIONS) for job in batch}
        urgent_id = next(f"u{i}" for i in range(100) if partition_of(f"u{i}", PARTITIONS) not in batch_partitions)
        urgent = await client.submit(input_ids=[7], max_new_tokens=4, priority="interactive", request_id=urgent_id)
        assert (await urgent.result(timeout=5)).token_ids == expected_tokens([7], 4)  # preempted for it
        for job in batch:
            await job.cancel()


def test_merging_one_partition_is_that_partition() -> None:
    replies: list[Any] = [0, {}, None, {}] + [0, 0, [], {"pending": 0, "min": None}, [], []] * 3  # per lane: held too
    one = status_from_replies("q", replies, 15.0)
    assert merge_partitions([one]) is one and one.partitions == []
    three = status_from_replies("q", replies * 3, 15.0)
    assert len(three.partitions) == 3 and three.depth == 0


async def test_a_client_with_fewer_partitions_than_the_worker_is_served_where_it_wrote(
    start_worker: Any, redis_url: str
) -> None:
    """A rollout from 1 partition to 3, workers first: a client still at 1 writes to partition 0, whatever its ids'
    partitions at 3. The worker answers each request where it read it (it used to write to the id's partition, so
    the entry was never acknowledged, claimed again and again and dead-lettered each round)."""
    await start_worker(queue_partitions=PARTITIONS, lease_timeout_s=0.5, claim_interval_s=0.1)
    ids = [f"m{i}" for i in range(30) if partition_of(f"m{i}", PARTITIONS) != 0][:6]
    async with AsyncClient(redis_url) as client, AsyncClient(redis_url, partitions=PARTITIONS) as watcher:
        jobs = [await client.submit(input_ids=[4, n], max_new_tokens=4, request_id=rid) for n, rid in enumerate(ids)]
        results = [await job.result(timeout=30) for job in jobs]
        await asyncio.sleep(1.0)  # past the lease: nothing is claimed again
        status = await watcher.status()
    assert [r.token_ids for r in results] == [expected_tokens([4, n], 4) for n in range(len(ids))]
    assert status.dead == 0 and status.depth == 0
