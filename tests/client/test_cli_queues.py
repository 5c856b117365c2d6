"""`llmq queues` on a real redis-server, and on a real Redis Cluster (queues on two masters): every queue under the
prefix, found from the keys a queue's own traffic creates, with its partitions, depth, dead letters and live workers;
a bounded scan."""

from __future__ import annotations

import json

import pytest
import redis
import redis.asyncio as aioredis

from client import store
from client.cli.exits import Exit
from client.connection import open_sync
from testing.redis_topologies import RedisClusterSet
from tests.client.cli_support import dead_letter, heartbeat, llmq

pytestmark = pytest.mark.redis


def fill(conn: redis.Redis) -> None:
    """alpha: 3 waiting in two lanes, a live and a stale worker; beta:x: 3 partitions, one request and one dead
    letter in partition 2; gamma: only a live worker; plus keys that name no queue."""
    alpha, beta, gamma = store.Keys("alpha"), store.Keys("beta:x", partition=2), store.Keys("gamma")
    conn.xadd(alpha.requests, {"m": b"x"})
    conn.xadd(alpha.requests, {"m": b"x"})
    conn.xadd(alpha.lane("batch"), {"m": b"x"})
    conn.hset(alpha.workers, mapping={"w1": heartbeat("w1"), "old": heartbeat("old", at_ms=1)})
    conn.xadd(beta.requests, {"m": b"x"})
    conn.xadd(beta.dead, {"m": dead_letter(None)})
    conn.hset(gamma.workers, "w2", heartbeat("w2", "gamma"))
    conn.xadd(store.Keys("results-only").result("r1"), {"m": b"x"})  # a request's key: no queue of its own
    conn.xadd(store.Keys("other", prefix="elsewhere").requests, {"m": b"x"})  # another prefix
    conn.set("unrelated", 1)


EXPECTED = [
    {"queue": "alpha", "partitions": 1, "depth": 3, "dead": 0, "live_workers": 1},
    {"queue": "beta:x", "partitions": 3, "depth": 1, "dead": 1, "live_workers": 0},
    {"queue": "gamma", "partitions": 1, "depth": 0, "dead": 0, "live_workers": 1},
]


async def test_queues_lists_every_queue_under_the_prefix(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with redis.Redis.from_url(redis_url) as conn:
        fill(conn)
    assert await llmq("queues", "--json", "--url", redis_url) == Exit.OK
    assert json.loads(capsys.readouterr().out) == EXPECTED
    assert await llmq("queues", "--url", redis_url) == Exit.OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["QUEUE", "PARTITIONS", "DEPTH", "DEAD", "LIVE", "WORKERS"]
    assert [line.split() for line in lines[1:]] == [["alpha", "1", "3", "0", "1"], ["beta:x", "3", "1", "1", "0"],
                                                    ["gamma", "1", "0", "0", "1"]]  # fmt: skip
    assert await llmq("queues", "--json", "--url", redis_url, "--prefix", "elsewhere") == Exit.OK
    assert [summary["queue"] for summary in json.loads(capsys.readouterr().out)] == ["other"]


async def test_queues_stops_after_max_keys_and_says_so(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("q1", "q2", "q3", "q4"):
        await server.xadd(store.Keys(name).requests, {"m": b"x"})
    assert await llmq("queues", "--json", "--url", redis_url, "--max-keys", "2") == Exit.OK
    out = capsys.readouterr()
    assert len(json.loads(out.out)) == 2 and "stopped after 2 queue keys (--max-keys)" in out.err
    assert await llmq("queues", "--url", redis_url) == Exit.OK
    assert "no queues" not in capsys.readouterr().out
    await server.flushdb()
    assert await llmq("queues", "--url", redis_url) == Exit.OK
    assert capsys.readouterr().out == "no queues under prefix 'llmq'\n"


async def test_queues_on_a_cluster_scans_every_master(
    redis_cluster: RedisClusterSet, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = redis_cluster.queues_on_different_masters()
    conn = open_sync(redis_cluster.seed_url)
    try:
        conn.xadd(store.Keys(first).requests, {"m": b"x"})
        conn.hset(store.Keys(second).workers, "w", heartbeat("w", second))
        conn.xadd(store.Keys(second).dead, {"m": dead_letter(None)})
    finally:
        conn.close()
    assert await llmq("queues", "--json", "--url", redis_cluster.seed_url) == Exit.OK
    assert sorted(json.loads(capsys.readouterr().out), key=lambda summary: summary["queue"]) == sorted(
        [
            {"queue": first, "partitions": 1, "depth": 1, "dead": 0, "live_workers": 0},
            {"queue": second, "partitions": 1, "depth": 0, "dead": 1, "live_workers": 1},
        ],
        key=lambda summary: summary["queue"],
    )
