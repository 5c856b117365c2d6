"""Tenants' quotas in the submit, read and publish scripts, against a real redis-server: queued requests and tokens
(`TenantQuotaExceeded` for that tenant only), running requests (freed by the final event, or lapsed), and a rate of
tokens per minute (reserved ahead of fair share, overflow behind it); finished requests refund the tokens estimated
above what they used."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import pytest
import redis.asyncio as aioredis

from client import AsyncClient, InvalidRequest, QueueFull, TenantQuotaExceeded
from client.cli.app import main
from client.protocol import COST_FIELD, ENTRY_FIELD, TENANT_FIELD, RequestLimits, decode_request
from client.scripts import PublishItem, Routing, Scripts, pack_usage
from client.store import Keys
from client.tenants import TenantLimits
from tests.polling import wait_until
from worker.intake import Intake
from worker.publisher import Target

QUEUE = "quota"
KEYS = Keys(QUEUE)
PLAIN = Routing()
COST = 16  # what `submit` below costs: 6 prompt tokens and 10 new ones


@pytest.fixture
async def conn(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    async with aioredis.Redis.from_url(redis_url) as client:
        await Intake(client, KEYS, "w", RequestLimits(), dead_maxlen=100, routing=PLAIN).ensure_group()
        yield client


@pytest.fixture
async def lib(conn: aioredis.Redis) -> Scripts:
    """The scripts, after one read: a worker that moves held requests reads the queue, so tenants' are held."""
    scripts = Scripts.register(conn)
    await scripts.read.run(KEYS, "w", 1, [("default", 1)], ["default"], PLAIN)
    return scripts


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(redis_url, queue=QUEUE, max_queue_len=0) as client:
        yield client


async def limit(conn: aioredis.Redis, tenant: str, **quotas: int) -> None:
    await conn.hset(KEYS.tenant_limits, tenant, TenantLimits(**quotas).pack())


async def submit(client: AsyncClient, tenant: str, count: int, start: int = 0, new_tokens: int = 10) -> None:
    for i in range(start, start + count):
        await client.submit(input_ids=[5] * 6, max_new_tokens=new_tokens, tenant=tenant, request_id=f"{tenant}-{i}")


class Taken(NamedTuple):
    tenant: str
    entry_id: bytes
    request_id: str
    cost: int


async def take(lib: Scripts, free: int) -> list[Taken]:
    """The entries one read takes."""
    reply = await lib.read.run(KEYS, "w", free, [("default", free)], ["default"], PLAIN)
    taken = []
    for entry in reply.entries:
        fields = entry.fields
        request_id = decode_request(fields[ENTRY_FIELD]).id
        taken.append(Taken(fields[TENANT_FIELD].decode(), entry.entry_id, request_id, int(fields[COST_FIELD])))
    return taken


def tenants(taken: list[Taken]) -> list[str]:
    return [one.tenant for one in taken]


async def finish(lib: Scripts, conn: aioredis.Redis, taken: Taken, generated: int = 10) -> None:
    """The final event of a request taken, as a worker publishes it: acknowledged, its usage counted."""
    target = Target(taken.request_id, 60, None, taken.entry_id, tenant=taken.tenant, cost=taken.cost)
    usage = pack_usage(3600, taken.tenant, "stop", taken.cost, 6, generated, 0, 0)
    await lib.publish.run(conn, KEYS, [PublishItem(target, b"done", 0, 1, ack=taken.entry_id, usage=usage)], 10)


async def running(conn: aioredis.Redis, tenant: str) -> int:
    return int(await conn.hget(KEYS.tenant_counts, f"{tenant}|running") or 0)


async def test_the_queued_quotas_refuse_that_tenant_only(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    await limit(conn, "a", max_queued=3)
    await limit(conn, "t", max_queued_tokens=2 * COST)
    await submit(client, "a", 3)
    with pytest.raises(TenantQuotaExceeded, match="'a'") as refused:
        await submit(client, "a", 1, start=3)
    assert refused.value.tenant == "a" and isinstance(refused.value, QueueFull)
    await submit(client, "t", 2)
    with pytest.raises(TenantQuotaExceeded):
        await submit(client, "t", 1, start=2)
    await submit(client, "b", 10)  # no quota: anything
    assert await conn.exists(KEYS.submitted("a-3")) == 0  # refused: a retry with its id is a new submit
    assert tenants(await take(lib, 1)) == ["a"]  # a worker moves one of a's: room for one more
    await submit(client, "a", 1, start=3)
    with pytest.raises(TenantQuotaExceeded):
        await submit(client, "a", 1, start=4)
    counts = await conn.hgetall(KEYS.tenant_counts)
    assert counts[b"a|queued"] == b"3" and counts[b"a|queued_tokens"] == str(3 * COST).encode()


async def test_a_new_tenant_past_the_bound_on_tenants_is_refused_until_one_goes_quiet(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    await conn.set(KEYS.tenants_max, 2)  # as the workers' heartbeats write LLMQ_MAX_TENANTS
    await submit(client, "a", 1)
    await submit(client, "b", 1)
    with pytest.raises(TenantQuotaExceeded, match="'c' is new") as refused:
        await submit(client, "c", 1)
    assert refused.value.tenant == "c"
    await submit(client, "a", 1, start=1)  # tenants seen still submit
    assert await conn.exists(KEYS.submitted("c-0")) == 0 and not await conn.hexists(KEYS.tenant_counts, "c|queued")
    assert sorted(await conn.zrange(KEYS.tenants_seen, 0, -1)) == [b"a", b"b"]
    await conn.zadd(KEYS.tenants_seen, {"b": int(time.time() * 1000) - 3_600_001})  # b quiet for over an hour
    await submit(client, "c", 1)
    assert sorted(await conn.zrange(KEYS.tenants_seen, 0, -1)) == [b"a", b"c"]
    await conn.delete(KEYS.tenants_max)  # no worker beats: no bound
    await submit(client, "d", 1)
    assert sorted(tenants(await take(lib, 8))) == ["a", "a", "b", "c", "d"]  # nothing refused was queued


async def test_the_workers_write_the_bound_on_tenants_in_every_partition(
    start_worker: Callable[..., Any], redis_url: str
) -> None:
    await start_worker(queue=QUEUE, max_tenants=3, queue_partitions=2, heartbeat_s=0.1)
    async with aioredis.Redis.from_url(redis_url) as conn:
        for keys in KEYS.partitioned(2):
            await wait_until(lambda keys=keys: conn.exists(keys.tenants_max), 10)
            assert await conn.get(keys.tenants_max) == b"3" and 0 < await conn.ttl(keys.tenants_max) <= 30


async def test_a_call_of_n_choices_is_refused_whole(conn: aioredis.Redis, lib: Scripts, client: AsyncClient) -> None:
    await limit(conn, "a", max_queued=3)
    await submit(client, "a", 2)
    with pytest.raises(TenantQuotaExceeded, match="2 more requests"):
        await client.submit(input_ids=[5], max_new_tokens=4, n=2, seed=1, tenant="a")
    assert await conn.xlen(KEYS.held("default")) == 2


async def test_a_call_no_retry_can_fit_is_an_invalid_request_not_a_full_queue(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    """Past the quota with nothing queued: `submit_many` and the gateway would retry a `QueueFull` forever."""
    await limit(conn, "a", max_queued=2, max_queued_tokens=100)
    with pytest.raises(InvalidRequest, match="even with nothing else queued") as refused:
        await client.submit(input_ids=[5], max_new_tokens=4, n=3, seed=1, tenant="a")
    assert not isinstance(refused.value, QueueFull)
    with pytest.raises(InvalidRequest, match="'a'"):
        await client.submit(input_ids=[5] * 6, max_new_tokens=95, tenant="a")  # 101 tokens alone
    assert await conn.xlen(KEYS.held("default")) == 0 and await conn.hlen(KEYS.tenant_counts) == 0


async def test_running_counts_of_two_lanes_are_apart_though_their_ids_agree(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    """Each lane's stream makes its own ids: two moved in one call can both be "<ms>-0"."""
    for lane in ("interactive", "batch"):
        await client.submit(input_ids=[5] * 6, max_new_tokens=10, tenant="a", priority=lane, request_id=f"a-{lane}")
    reply = await lib.read.run(KEYS, "w", 2, [("interactive", 1), ("batch", 1)], ["interactive", "batch"], PLAIN)
    assert len(reply.entries) == 2 and await running(conn, "a") == 2
    assert await conn.zcard(KEYS.tenant_running) == 2
    for entry in reply.entries:
        request_id = decode_request(entry.fields[ENTRY_FIELD]).id
        target = Target(request_id, 60, None, entry.entry_id, lane=entry.lane, tenant="a", cost=COST)
        usage = pack_usage(3600, "a", "stop", COST, 6, 10, 0, 0)
        item = PublishItem(target, b"done", 0, 1, ack=entry.entry_id, usage=usage)
        await lib.publish.run(conn, KEYS, [item], 10)
    assert await running(conn, "a") == 0 and await conn.zcard(KEYS.tenant_running) == 0


async def test_a_reserved_move_does_not_push_the_clock_past_those_waiting(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    """A tenant served ahead of its turn for its rate leaves the lane's clock where fair order has it: a tenant
    that joins later is not queued behind the reserved tenant's lead."""
    await limit(conn, "r", tokens_per_minute=10 * COST)
    await submit(client, "r", 10)
    await submit(client, "a", 10)
    assert tenants(await take(lib, 10)) == ["r"] * 10  # within its rate: all ten first
    await submit(client, "late", 3)
    assert sorted(tenants(await take(lib, 2))) == ["a", "late"]  # late starts at a's clock, not at r's lead


async def test_a_tenant_banks_no_refund_while_away(conn: aioredis.Redis, lib: Scripts, client: AsyncClient) -> None:
    await submit(client, "x", 1, new_tokens=58)
    [taken] = await take(lib, 1)
    await finish(lib, conn, taken, generated=2)  # 56 tokens owed back, but x has nothing waiting now
    assert await conn.hget(KEYS.tenant_counts, "x|refund") == b"56"
    await submit(client, "x", 1, start=1)
    assert await conn.hget(KEYS.tenant_counts, "x|refund") is None  # rejoins at the clock, with no credit


async def test_the_running_quota_holds_a_tenant_back_until_its_requests_finish(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    await limit(conn, "a", max_running=2)
    await submit(client, "a", 6)
    await submit(client, "b", 6)
    taken = await take(lib, 6)
    assert Counter(tenants(taken)) == {"a": 2, "b": 4}  # b fills what a may not
    assert await running(conn, "a") == 2
    assert tenants(await take(lib, 3)) == ["b", "b"]  # b's last two; a still waits
    assert await running(conn, "a") == 2
    first_a = next(one for one in taken if one.tenant == "a")
    await finish(lib, conn, first_a)
    assert await running(conn, "a") == 1
    await finish(lib, conn, first_a)  # its final event again (a retried flush): counted once
    assert await running(conn, "a") == 1
    assert tenants(await take(lib, 3)) == ["a"]  # one place freed: one more of a's


async def test_a_running_count_lapses_when_its_final_event_never_comes(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    await limit(conn, "a", max_running=1)
    await submit(client, "a", 2)
    [lost] = await take(lib, 2)
    assert await take(lib, 1) == []  # at its quota
    member = b"a\0" + KEYS.lane("default").encode() + b"\0" + lost.entry_id
    assert await conn.zscore(KEYS.tenant_running, member) > time.time() * 1000 + 3_000_000  # an hour ahead
    await conn.zadd(KEYS.tenant_running, {member: 1})  # as if that hour had passed
    assert tenants(await take(lib, 1)) == ["a"]
    assert await running(conn, "a") == 1  # the lapsed one gone, the new one counted


async def test_a_rate_is_reserved_ahead_of_fair_share_and_overflows_behind_it(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    await limit(conn, "r", tokens_per_minute=2 * COST)  # two requests a minute reserved
    await submit(client, "s", 8)  # first in line, no rate
    await submit(client, "r", 8)
    order = tenants(await take(lib, 1) + await take(lib, 1) + await take(lib, 8))
    assert order[:2] == ["r", "r"]  # within its rate: ahead of s, though s queued first
    assert order[2:] == ["s"] * 8  # past it: only once no one else waits
    assert tenants(await take(lib, 8)) == ["r"] * 6  # the fleet idle otherwise: overflow runs


async def test_tokens_estimated_above_what_was_used_are_refunded_to_fair_share(
    conn: aioredis.Redis, lib: Scripts, client: AsyncClient
) -> None:
    """Both estimate 6 + 58 tokens; x's requests stop after 2, y's use all 58: x's virtual time grows by what x
    used, so x gets the larger share of what runs next."""
    await submit(client, "x", 40, new_tokens=58)
    await submit(client, "y", 40, new_tokens=58)
    shares: Counter[str] = Counter()
    for _ in range(30):
        [taken] = await take(lib, 1)
        shares[taken.tenant] += 1
        await finish(lib, conn, taken, generated=2 if taken.tenant == "x" else 58)
    assert shares["x"] >= 3 * shares["y"], shares
    assert await running(conn, "x") == 0 and await running(conn, "y") == 0


def llmq(url: str, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(["--url", url, "--queue", QUEUE, *args])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_llmq_tenants_sets_lists_and_unsets_quotas(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = llmq(redis_url, capsys, "tenants", "set", "a", "--max-queued", "5", "--tokens-per-minute", "9000")
    assert rc == 0 and "quotas: max queued 5, tokens per minute 9000" in out, out
    rc, out = llmq(redis_url, capsys, "tenants", "set", "a", "--max-queued", "0", "--max-running", "2", "--weight", "2")
    assert rc == 0 and "weight 2, quotas: max running 2, tokens per minute 9000" in out, out  # the rest kept
    rc, out = llmq(redis_url, capsys, "tenants", "list", "--json")
    [listed] = json.loads(out)["tenants"]
    assert listed["limits"] == {
        "max_queued": None,
        "max_queued_tokens": None,
        "max_running": 2,
        "tokens_per_minute": 9000,
    }
    assert (listed["weight"], listed["running"]) == (2, 0)
    assert llmq(redis_url, capsys, "tenants", "set", "a")[0] == 2  # nothing to set: a usage error
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        llmq(redis_url, capsys, "tenants", "set", "a", "--max-running", "-1")
    rc, out = llmq(redis_url, capsys, "tenants", "unset", "a")
    assert rc == 0 and "no quotas" in out
    assert json.loads(llmq(redis_url, capsys, "tenants", "list", "--json")[1])["tenants"] == []


async def test_llmq_status_shows_each_tenants_backlog_and_share(
    redis_url: str, lib: Scripts, client: AsyncClient, capsys: pytest.CaptureFixture[str]
) -> None:
    await submit(client, "a", 5)
    await submit(client, "b", 5)
    await take(lib, 4)  # two each, at equal weights and costs
    await take(lib, 1)
    await asyncio.to_thread(main, ["--url", redis_url, "--queue", QUEUE, "status"])
    out = capsys.readouterr().out
    assert "tenants: 2 with requests held or running" in out, out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line.startswith("  a ") or line.startswith("  b ")
    }
    assert rows["a"] == ["held", "2", "running", "3", "share", "60%"], out
    assert rows["b"] == ["held", "3", "running", "2", "share", "40%"], out
    await asyncio.to_thread(main, ["--url", redis_url, "--queue", QUEUE, "status", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert {t["tenant"]: t["running"] for t in shown["tenants"]} == {"a": 3, "b": 2}
