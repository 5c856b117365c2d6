"""`llmq dead list | show | replay | drop` on a real redis-server: letters as workers write them, unreadable ones
too; once end to end (a worker dead-letters a request, `replay` runs it again under its id), and once on a real
Redis Cluster with partitions."""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from client import Client, protocol, store
from client.admin import Admin
from client.cli.exits import Exit
from client.connection import open_sync
from client.store import CONSUMER_GROUP
from client.usage import read_usage
from testing.redis_topologies import RedisClusterSet
from testing.scripted_engine import expected_tokens
from tests.client.cli_support import dead_letter, llmq, scripted_worker
from tests.polling import wait_until

pytestmark = pytest.mark.redis
KEYS = store.Keys("default")


def request(request_id: str, **fields: object) -> protocol.GenerateRequest:
    return protocol.parse_request({"id": request_id, "prompt": f"prompt of {request_id}", "submitted": 1, **fields})


async def letters(server: aioredis.Redis) -> list[str]:
    """Writes three letters, as workers do (the middle one's entry is no request); returns their ids."""
    ids = []
    for body in (dead_letter(request("r1"), "claimed too often"), dead_letter(None, "not msgpack", b"\x00junk"),
                 dead_letter(request("r3", deadline=2), "quarantined")):  # fmt: skip
        ids.append((await server.xadd(KEYS.dead, {"m": body})).decode())
    return ids


async def test_list_and_show(redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    ids = await letters(server)
    assert await llmq("dead", "list", "--json", "--url", redis_url) == Exit.OK
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(one["id"], one["request_id"], one["reason"]) for one in listed] == [
        (ids[0], "r1", "claimed too often"),
        (ids[1], None, "not msgpack"),
        (ids[2], "r3", "quarantined"),
    ]
    assert await llmq("dead", "list", "--limit", "2", "--url", redis_url) == Exit.OK
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0] == "queue default: 3 dead letters, the oldest 2:" and len(lines) == 3
    assert lines[1].split()[:2] == [ids[0], "r1"] and "1 more" in out.err

    assert await llmq("dead", "show", "r1", "--url", redis_url) == Exit.OK
    shown = capsys.readouterr().out
    assert f"dead letter {ids[0]}" in shown and "reason: claimed too often" in shown
    assert '"prompt": "prompt of r1"' in shown
    assert await llmq("dead", "show", ids[1], "--json", "--url", redis_url) == Exit.OK
    unreadable = json.loads(capsys.readouterr().out)
    assert unreadable["request"] is None and unreadable["raw_hex"] == b"\x00junk".hex()
    assert await llmq("dead", "show", "no-such", "--url", redis_url) == Exit.NOT_FOUND
    assert "no dead letter 'no-such' on queue 'default'" in capsys.readouterr().err


async def test_drop(redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    ids = await letters(server)
    assert await llmq("dead", "drop", "r1", "--url", redis_url) == Exit.OK
    assert await llmq("dead", "drop", ids[0], "--url", redis_url) == Exit.NOT_FOUND  # gone already
    assert [entry_id.decode() for entry_id, _ in await server.xrange(KEYS.dead)] == ids[1:]
    assert await llmq("dead", "drop", "--all", "--limit", "1", "--url", redis_url) == Exit.OK
    assert [entry_id.decode() for entry_id, _ in await server.xrange(KEYS.dead)] == ids[2:]  # the oldest went
    assert await llmq("dead", "drop", "--all", "--url", redis_url) == Exit.OK
    assert await server.xlen(KEYS.dead) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dropped 1 dead letter",
        "dropped 1 dead letter",
        "dropped 1 dead letter",
    ]


async def test_replay_all_requeues_what_it_can_and_exits_1_for_the_rest(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = await letters(server)
    assert await llmq("dead", "replay", "--all", "--priority", "batch", "--url", redis_url) == Exit.FAILED
    queued = [protocol.decode_request(fields[b"m"]) for _, fields in await server.xrange(KEYS.lane("batch"))]
    assert queued == [request("r1"), request("r3", deadline=2)]  # as they were submitted
    assert [entry_id.decode() for entry_id, _ in await server.xrange(KEYS.dead)] == [ids[1]]  # the unreadable one
    assert await server.exists(KEYS.submitted("r1"), KEYS.submitted("r3")) == 2
    out = capsys.readouterr()
    assert "replayed 2 dead letters, skipped 1" in out.out
    assert "request r3's deadline has passed" in out.err and f"skipped: dead letter {ids[1]}" in out.err
    assert await llmq("dead", "replay", ids[1], "--url", redis_url) == Exit.FAILED
    assert "holds no readable request" in capsys.readouterr().err


async def test_a_replay_clears_the_first_run_and_runs_once(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = await letters(server)
    error = protocol.ErrorEvent(code=protocol.ErrorCode.DELIVERY_LIMIT, message="too often")
    await server.xadd(KEYS.result("r1"), {"m": protocol.encode(error)})  # what its reader got
    await server.hset(KEYS.fence("r1"), "h", 100)
    await server.set(KEYS.cancel("r1"), 1)
    assert await llmq("dead", "replay", ids[0], "--url", redis_url) == Exit.OK
    assert await llmq("dead", "replay", ids[0], "--url", redis_url) == Exit.NOT_FOUND  # someone was first
    assert await server.xlen(KEYS.requests) == 1
    assert not await server.exists(KEYS.result("r1"), KEYS.fence("r1"), KEYS.cancel("r1"))
    assert "replayed r1 (dead letter" in capsys.readouterr().out


async def test_a_request_a_worker_dead_lettered_completes_once_replayed(
    redis_url: str, server: aioredis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(redis_url) as client:
        client.submit("again", max_new_tokens=5, temperature=0, request_id="dl-1")
    await server.xgroup_create(KEYS.requests, CONSUMER_GROUP, id="0", mkstream=True)
    await server.xreadgroup(CONSUMER_GROUP, "ghost", {KEYS.requests: ">"})  # a worker that then died
    await server.hset(KEYS.fence("dl-1"), "h", 100)  # handed back 100 times: past what is forgiven
    settings = {"lease_timeout_s": 0.3, "claim_interval_s": 0.1, "max_deliveries": 1, "max_hand_backs": 0}
    async with scripted_worker(redis_url, tmp_path, **settings):
        await wait_until(lambda: server.xlen(KEYS.dead), within_s=30)
        assert await llmq("attach", "dl-1", "--url", redis_url) == Exit.FAILED
        assert "failed (delivery_limit)" in capsys.readouterr().err
        assert await llmq("dead", "replay", "dl-1", "--url", redis_url) == Exit.OK
        assert await llmq("attach", "dl-1", "--json", "--url", redis_url, "--timeout", "30") == Exit.OK
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["token_ids"] == expected_tokens(list(b"again"), 5) and result["finish_reason"] == "length"
    assert await server.xlen(KEYS.dead) == 0


async def test_a_replay_keeps_the_requests_tenant_and_cost(
    redis_url: str, server: aioredis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The letter keeps the entry's tenant and estimated cost beside its body, and the replay gives them back: the
    request's usage counts in its own tenant, never `default`."""
    with Client(redis_url, tenant="billing") as client:
        client.submit("again", max_new_tokens=5, temperature=0, request_id="dl-t")
    await server.xgroup_create(KEYS.requests, CONSUMER_GROUP, id="0", mkstream=True)
    await server.xreadgroup(CONSUMER_GROUP, "ghost", {KEYS.requests: ">"})  # a worker that then died
    await server.hset(KEYS.fence("dl-t"), "h", 100)
    settings = {"lease_timeout_s": 0.3, "claim_interval_s": 0.1, "max_deliveries": 1, "max_hand_backs": 0}
    async with scripted_worker(redis_url, tmp_path, **settings):
        await wait_until(lambda: server.xlen(KEYS.dead), within_s=30)
        letter = (await server.xrange(KEYS.dead))[0][1]
        assert letter[protocol.TENANT_FIELD] == b"billing" and int(letter[protocol.COST_FIELD]) > 5
        assert await llmq("dead", "replay", "dl-t", "--url", redis_url) == Exit.OK
        replayed = (await server.xrange(KEYS.requests))[-1][1]
        assert replayed[protocol.TENANT_FIELD] == b"billing"
        assert replayed[protocol.COST_FIELD] == letter[protocol.COST_FIELD]
        assert await llmq("attach", "dl-t", "--url", redis_url, "--timeout", "30") == Exit.OK
    with closing(Admin(redis_url)) as admin:
        usage = {one.tenant: one.requests for one in read_usage(admin, "default", 3600)}
    assert usage == {"billing": {"error:delivery_limit": 1, "length": 1}}, usage
    capsys.readouterr()


async def test_replay_and_drop_on_a_cluster_with_partitions(
    redis_cluster: RedisClusterSet, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each partition is its own slot: a replay's transaction stays on the letter's node."""
    url, ids = redis_cluster.seed_url, [f"c-{i}" for i in range(6)]
    conn = open_sync(url)
    try:
        for request_id in ids:
            part = store.Keys("default", partition=store.partition_of(request_id, 3))
            conn.xadd(part.dead, {"m": dead_letter(request(request_id))})
        assert len({store.partition_of(request_id, 3) for request_id in ids}) > 1
        on = ["--url", url, "--partitions", "3"]
        assert await llmq("dead", "replay", "c-4", *on) == Exit.OK
        assert await llmq("dead", "drop", "c-5", *on) == Exit.OK
        assert await llmq("dead", "replay", "--all", "--limit", "2", *on) == Exit.OK
        assert capsys.readouterr().out.count("replayed c-") == 3
        assert await llmq("dead", "list", "--json", *on) == Exit.OK
        left = {json.loads(line)["request_id"] for line in capsys.readouterr().out.splitlines()}
        assert len(left) == 2 and left < set(ids[:4])
        lanes = [store.Keys("default", partition=p).requests for p in range(3)]
        queued = [protocol.decode_request(fields[b"m"]).id for lane in lanes for _, fields in conn.xrange(lane)]
        assert sorted(queued) == sorted({*ids[:4]} - left | {"c-4"})
    finally:
        conn.close()
