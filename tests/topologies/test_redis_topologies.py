"""The topologies of testing/redis_topologies.py, checked through redis-py's own cluster and sentinel clients."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from client.store import Keys
from testing.redis_topologies import HOST, NoSlotOwner, RedisClusterSet, RedisNode, SentinelSet

pytestmark = pytest.mark.redis


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    """Without passwords (the suite's `sentinel_set` has both kinds)."""
    with SentinelSet(tmp_path / "sentinel") as topology:
        yield topology


def cluster_client(cluster: RedisClusterSet) -> RedisCluster:
    return RedisCluster(host=HOST, port=cluster.masters()[0].port, decode_responses=True, socket_timeout=2)


def sentinel_client(topology: SentinelSet) -> Sentinel:
    return Sentinel(
        topology.sentinel_addresses,
        sentinel_kwargs={"password": topology.sentinel_password, "socket_timeout": 1},
        password=topology.password,
        socket_timeout=2,
        decode_responses=True,
    )


def test_cluster_serves_keys_on_all_three_masters(redis_cluster: RedisClusterSet) -> None:
    cluster = redis_cluster
    masters = cluster.masters()
    assert len(masters) == 3
    assert all(len(cluster.replicas_of(master)) == 1 for master in masters)
    assert cluster.seed_url == f"redis+cluster://{HOST}:{cluster.nodes[0].port}"
    assert sorted(cluster.node_urls) == sorted(f"redis://{HOST}:{node.port}" for node in cluster.nodes)
    keys = [Keys(cluster.queue_on(master)).requests for master in masters]
    with cluster_client(cluster) as client:
        for key in keys:
            client.set(key, key)
        assert [client.get(key) for key in keys] == keys
    for master, key in zip(masters, keys, strict=True):
        assert cluster.master_for_key(key) is master
        assert master.client().get(key) == key  # stored on that master itself: no MOVED
    first, second = cluster.queues_on_different_masters()
    assert cluster.master_for_key(Keys(first).tag) is not cluster.master_for_key(Keys(second).tag)


def test_cluster_promotes_a_replica_after_kill_9_of_its_master(redis_cluster: RedisClusterSet) -> None:
    cluster = redis_cluster
    key = Keys(cluster.queue_on(cluster.masters()[1])).requests
    old = cluster.master_for_key(key)
    (replica,) = cluster.replicas_of(old)
    with cluster_client(cluster) as client:
        client.set(key, "before")
        assert old.execute("WAIT", 1, 2000) == 1
        cluster.kill_master(old)
        assert not old.alive
        new = cluster.wait_for_promotion(old, timeout=15)
        assert new is replica
        assert cluster.master_for_key(key) is new
        assert client.get(key) == "before"
        client.set(key, "after")
        assert new.client().get(key) == "after"
    cluster.restart(old)
    assert cluster.replicas_of(new) == [old]
    assert old.client().info("replication")["master_port"] == new.port


def test_waiting_for_a_promotion_rides_out_a_view_where_no_master_owns_the_slot(
    redis_cluster: RedisClusterSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mid-failover, a node's CLUSTER NODES can list the killed master's slot under no master (a CI run under load
    saw `no master owns slot`): the wait takes such views (fed here) as "not yet" and goes on to the promotion. Any
    other lookup error (a port of no node of the set: a bug) ends the wait at once instead of hiding as a timeout."""
    cluster = redis_cluster
    old = cluster.masters()[1]
    (replica,) = cluster.replicas_of(old)
    owner_of = RedisClusterSet.master_for_slot

    def unknown_port(self: RedisClusterSet, slot: int) -> RedisNode:
        raise KeyError("no node of this set on port 1")

    with monkeypatch.context() as patch:
        patch.setattr(RedisClusterSet, "master_for_slot", unknown_port)
        with pytest.raises(KeyError):  # not TopologyTimeout, which a wait that took it as "not yet" would raise
            cluster.wait_for_promotion(old, timeout=15)

    cluster.kill_master(old)
    ownerless_views = iter(range(3))

    def first_views_ownerless(self: RedisClusterSet, slot: int) -> RedisNode:
        if next(ownerless_views, None) is not None:
            raise NoSlotOwner(f"no master owns slot {slot}")
        return owner_of(self, slot)

    monkeypatch.setattr(RedisClusterSet, "master_for_slot", first_views_ownerless)
    assert cluster.wait_for_promotion(old, timeout=15) is replica
    assert next(ownerless_views, None) is None  # every ownerless view was seen, and waited out


def test_sentinel_master_can_be_written(sentinels: SentinelSet) -> None:
    hosts = ",".join(f"{HOST}:{port}" for _, port in sentinels.sentinel_addresses)
    assert sentinels.url == f"redis+sentinel://{hosts}/llmq"
    sentinel = sentinel_client(sentinels)
    assert sentinel.discover_master(sentinels.service_name) == sentinels.master_address()
    master = sentinel.master_for(sentinels.service_name)
    master.set("k", "v")
    assert master.get("k") == "v"
    assert sentinels.master() is sentinels.data_nodes[0]


def test_sentinel_failover_names_a_new_master_that_kept_acknowledged_writes(sentinels: SentinelSet) -> None:
    sentinel = sentinel_client(sentinels)
    client = sentinel.master_for(sentinels.service_name)
    client.set("k", "before")
    assert client.execute_command("WAIT", 1, 2000) == 1
    old_node = sentinels.master()
    old = old_node.address
    new = sentinels.failover(settle=True)
    assert new != old
    assert sentinel.discover_master(sentinels.service_name) == new
    assert old_node.client().info("replication")["role"] == "slave"
    assert client.get("k") == "before"  # the pooled connection to the old master was dropped: it followed
    client.set("k", "after")
    assert sentinels.node_at(new[1]).client().get("k") == "after"


def test_sentinel_kill_9_of_the_master_with_passwords(sentinel_set: SentinelSet) -> None:
    topology = sentinel_set
    assert topology.url.startswith("redis+sentinel://:data%20secret@")
    assert topology.url.endswith("/llmq?sentinel_password=watch%3Asecret")
    for port in (topology.sentinels[0].port, topology.master_address()[1]):
        with pytest.raises(redis.AuthenticationError):  # redis-py retries this by default, with a backoff of seconds
            redis.Redis(host=HOST, port=port, retry=Retry(NoBackoff(), 0)).ping()
    client = sentinel_client(topology).master_for(topology.service_name)
    client.set("k", "before")
    assert client.execute_command("WAIT", 1, 2000) == 1
    started = time.monotonic()
    old = topology.kill_master()
    new = topology.wait_for_new_master(old, timeout=20)
    assert new != old
    assert time.monotonic() - started < 20
    assert client.get("k") == "before"
    client.set("k", "after")
    assert topology.node_at(new[1]).client().get("k") == "after"
    topology.restart(topology.node_at(old[1]))
    assert topology.wait_healthy() == new, topology.log_tails(40)
