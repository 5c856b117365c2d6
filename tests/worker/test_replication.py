"""`LLMQ_REDIS_WAIT_REPLICAS`: a worker's claims and terminal events wait for the replicas (WAIT on the connection
that wrote them); a terminal event no replica acknowledges is written again until one does. A real master,
replica and sentinels, and an in-process worker on the scripted engine."""

from __future__ import annotations

from pathlib import Path

from client import AsyncClient
from client.store import Keys
from testing.redis_topologies import RedisNode, SentinelSet
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until
from tests.worker.conftest import serving


def waits(node: RedisNode) -> int:
    stats = node.client().info("commandstats").get("cmdstat_wait")
    return int(stats["calls"]) if stats else 0


async def test_claims_and_terminal_events_wait_for_the_replica(sentinel_set: SentinelSet, tmp_path: Path) -> None:
    master = sentinel_set.master()
    async with (
        serving(sentinel_set.url, "w", tmp_path, step_s=0.005, redis_wait_replicas=1),
        AsyncClient(sentinel_set.url, queue="w") as client,
    ):
        results = [await (await client.submit(input_ids=[3, i], max_new_tokens=6)).result(timeout=30) for i in (4, 5)]
    assert [r.token_ids for r in results] == [expected_tokens([3, i], 6) for i in (4, 5)]
    assert waits(master) >= 4  # per request: its claim and its terminal event (more where batches met)


async def test_a_worker_without_wait_replicas_sends_no_wait(sentinel_set: SentinelSet, tmp_path: Path) -> None:
    async with (
        serving(sentinel_set.url, "w", tmp_path, step_s=0.005),
        AsyncClient(sentinel_set.url, queue="w") as client,
    ):
        await (await client.submit(input_ids=[3, 4], max_new_tokens=3)).result(timeout=30)
    assert waits(sentinel_set.master()) == 0


async def test_a_terminal_event_no_replica_acknowledges_is_written_again_until_one_does(
    sentinel_set: SentinelSet, tmp_path: Path
) -> None:
    master = sentinel_set.master()
    replica = next(node for node in sentinel_set.data_nodes if node is not master)
    async with (
        serving(sentinel_set.url, "w", tmp_path, step_s=0.005, redis_wait_replicas=1) as worker,
        AsyncClient(sentinel_set.url, queue="w") as client,
    ):
        await (await client.submit(input_ids=[3, 4], max_new_tokens=2)).result(timeout=30)  # claimed, served
        job = await client.submit(input_ids=[5, 6], max_new_tokens=40)
        stream = job.stream(timeout=60)
        first = await anext(stream)  # claimed while the replica was up
        replica.kill()
        await wait_until(lambda: worker.publisher.stats.failures >= 2, within_s=30)
        assert worker.publisher.backlog > 0  # the terminal batch is held, and tried again
        replica.start().wait_ready()
        await wait_until(lambda: worker.publisher.backlog == 0, within_s=30)
        tokens = first.token_ids + [token for delta in [d async for d in stream] for token in delta.token_ids]
    assert tokens == expected_tokens([5, 6], 40)
    assert replica.client().xlen(Keys("w").result(job.id)) > 0  # the answer is on the replica
