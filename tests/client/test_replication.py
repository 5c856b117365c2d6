"""`wait_replicas`: a submission returns only once a replica has it (WAIT on the connection that wrote it, on a
Cluster the node of the queue's slot), else `RedisUnavailable` after `failover_timeout`. Real Sentinel sets and
a real Cluster, counted by the nodes' own `INFO commandstats`."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.cluster import key_slot

from client import AsyncClient, Client, RedisUnavailable
from client.replication import NotReplicated
from client.store import Keys
from testing.redis_topologies import RedisClusterSet, RedisNode, SentinelSet


def waits(node: RedisNode) -> int:
    """WAIT commands `node` has run. (A client's first submit sends two: the script is loaded after its first
    EVALSHA fails, and the pipeline sent again.)"""
    stats = node.client().info("commandstats").get("cmdstat_wait")
    return int(stats["calls"]) if stats else 0


async def test_a_submit_through_sentinel_waits_for_the_replica(sentinel_set: SentinelSet) -> None:
    master = sentinel_set.master()
    async with AsyncClient(sentinel_set.url, wait_replicas=1, queue="w") as client:
        job = await client.submit("hello", max_new_tokens=1)
        assert waits(master) == 2
        again = await client.submit("hello", max_new_tokens=1, request_id=job.id)  # a duplicate waits too
        assert again.id == job.id and waits(master) == 3
    with Client(sentinel_set.url, wait_replicas=1, queue="w") as sync:
        sync.submit("hello", max_new_tokens=1)
    assert waits(master) == 4
    replica = next(node for node in sentinel_set.data_nodes if node is not master)
    assert replica.client().xlen(Keys("w").requests) == 2  # both submissions are on the replica already


async def test_without_wait_replicas_nothing_waits(sentinel_set: SentinelSet) -> None:
    async with AsyncClient(sentinel_set.url, queue="w") as client:
        await client.submit("hello", max_new_tokens=1)
    assert waits(sentinel_set.master()) == 0


async def test_a_submit_no_replica_acknowledges_fails_typed_after_the_window_and_can_be_repeated(
    sentinel_set: SentinelSet,
) -> None:
    master = sentinel_set.master()
    replica = next(node for node in sentinel_set.data_nodes if node is not master)
    replica.kill()
    async with AsyncClient(sentinel_set.url, wait_replicas=1, failover_timeout=1.5, queue="w") as client:
        started = time.monotonic()
        with pytest.raises(RedisUnavailable, match="0 of 1 replicas acknowledged") as raised:
            await client.submit("hello", max_new_tokens=1, request_id="r1")
        assert time.monotonic() - started >= 1.0
        assert isinstance(raised.value.__cause__, NotReplicated)
        assert "data secret" not in str(raised.value)
        replica.start().wait_ready()
        job = await client.submit("hello", max_new_tokens=1, request_id="r1")  # the same id: no second entry
        assert job.id == "r1"
    assert master.client().xlen(Keys("w").requests) == 1
    assert replica.client().xlen(Keys("w").requests) == 1


async def test_two_replicas_asked_of_a_set_with_one_is_refused(sentinel_set: SentinelSet) -> None:
    async with AsyncClient(sentinel_set.url, wait_replicas=2, failover_timeout=0.5, queue="w") as client:
        with pytest.raises(RedisUnavailable, match="1 of 2 replicas"):
            await client.submit("hello", max_new_tokens=1)


def test_wait_replicas_must_be_a_whole_number() -> None:
    for wrong in (-1, 1.5, True):
        with pytest.raises(ValueError, match="wait_replicas"):
            AsyncClient("redis://127.0.0.1:1/0", wait_replicas=wrong)  # type: ignore[arg-type]


async def test_on_a_cluster_the_wait_goes_to_the_node_of_the_queue(redis_cluster: RedisClusterSet) -> None:
    masters = redis_cluster.masters()
    owner = masters[1]
    queue = redis_cluster.queue_on(owner)
    before = {master.port: waits(master) for master in masters}
    async with AsyncClient(redis_cluster.seed_url, queue=queue) as client:
        await client.submit("loads the script", max_new_tokens=1)
    async with AsyncClient(redis_cluster.seed_url, wait_replicas=1, queue=queue) as client:
        for i in range(3):
            await client.submit(f"hello {i}", max_new_tokens=1)

    def submit_sync() -> None:
        with Client(redis_cluster.seed_url, wait_replicas=1, queue=queue) as sync:
            sync.submit("hello sync", max_new_tokens=1)

    await asyncio.to_thread(submit_sync)
    grown = {master.port: waits(master) - before[master.port] for master in masters}
    assert grown == {master.port: 4 if master is owner else 0 for master in masters}
    replica = redis_cluster.replicas_of(owner)[0]
    replica.execute("READONLY")
    assert replica.client().xlen(Keys(queue).requests) == 5


async def test_a_submit_that_waits_follows_its_queues_slot_to_a_new_master(redis_cluster: RedisClusterSet) -> None:
    """The WAIT pipeline is pinned to the node the client's slot map names: when the slot has moved since (here an
    empty slot handed to another master with `CLUSTER SETSLOT ... NODE`), that node answers MOVED, the map is read
    again and the retried submit lands on the new owner, waited for there; sync and asyncio alike."""
    owner, target = redis_cluster.masters()[:2]
    queue = redis_cluster.queue_on(owner)
    slot = key_slot(Keys(queue).tag.encode())
    async with AsyncClient(redis_cluster.seed_url, wait_replicas=1, queue=queue) as aclient:
        with Client(redis_cluster.seed_url, wait_replicas=1, queue=queue) as client:
            await aclient.submit("on the first owner", max_new_tokens=1, queue="elsewhere")  # both learn the map
            client.submit("on the first owner", max_new_tokens=1, queue="elsewhere")
            for master in redis_cluster.masters():
                master.execute("CLUSTER", "SETSLOT", slot, "NODE", redis_cluster.ids[target.port])
            before = waits(target)
            await aclient.submit("moved", max_new_tokens=1)
            await asyncio.to_thread(client.submit, "moved too", max_new_tokens=1)
    assert redis_cluster.master_for_slot(slot) is target
    assert target.client().xlen(Keys(queue).requests) == 2
    assert waits(target) - before >= 2
