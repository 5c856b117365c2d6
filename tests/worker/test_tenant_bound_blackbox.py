"""Black-box: the bound on tenants (`LLMQ_MAX_TENANTS`), from the documentation only.

The contract: docs/tenants.md ("A tenant on every request", bullet "A bound on tenants"; the Keys table's
`:tenants:max` and `:tenants:seen`), docs/workers.md (the `LLMQ_MAX_TENANTS` setting), docs/client.md ("Errors":
`TenantQuotaExceeded`, a `QueueFull` with `.tenant`; "Bulk work": `submit_many` waits while the queue is full;
"Several answers": `n` choices go in all or none, spread over partitions by id), docs/operations/redis.md (a request
lives in the partition of CRC-32 of its id modulo P; partition `p` is `{llmq:<queue>#p}`), docs/cli.md (exit code 7),
docs/gateway.md (tenants file, 429 `tenant_quota_exceeded`) and the CHANGELOG's bullet.

What it says: each queue partition serves at most `max_tenants` tenants that submitted within the last hour; a new
tenant past it is refused with `TenantQuotaExceeded` and nothing is queued; tenants already counted go on; a tenant
quiet for an hour stops counting; workers' heartbeats write the bound into every partition's `:tenants:max` with a
TTL, and without that key there is no bound; like the quotas, it applies to held requests only (a worker of this
release read the queue lately, `:held:readers`).

The surface used: the client (`AsyncClient`, `Client`, `submit(..., tenant=)`, `n`, `submit_many`), `client.admin.Admin`
with `client.usage.read_usage`, `llmq` as a subprocess, the gateway in-process, in-process workers on the scripted
engine (`start_worker`), `worker.config.Settings`, and the Redis keys the docs list. An hour passing is simulated by
rewriting a member's score in `:tenants:seen` ("tenant -> when it last submitted (epoch ms)").
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Client, InvalidRequest, QueueFull, TenantQuotaExceeded
from client.admin import Admin
from client.tenants import TenantLimits, Tenants
from client.usage import TenantUsage, read_usage
from testing.scripted_engine import expected_tokens
from tests.gateway.conftest import gateway  # noqa: F401 - the gateway fixture, shared with the gateway tests
from tests.polling import wait_until
from tests.worker.tenant_support import READERS, RESULT_TIMEOUT_S, TAG, check, llmq, stop, submit, text
from worker.config import Settings

HOUR_MS = 3_600_000
HELD = f"{TAG}:held:default"  # docs/tenants.md: `:held:<lane>`
LANE_STREAM = f"{TAG}:requests"  # docs/protocol.md: the `default` lane's stream


def tag(part: int = 0) -> str:
    """docs/operations/redis.md: `{llmq:<queue>}` for partition 0, `{llmq:<queue>#p}` for the others."""
    return TAG if part == 0 else f"{{llmq:default#{part}}}"


def bound_key(part: int = 0) -> str:
    return f"{tag(part)}:tenants:max"


def seen_key(part: int = 0) -> str:
    return f"{tag(part)}:tenants:seen"


def partition_of(request_id: str, partitions: int = 2) -> int:
    """docs/operations/redis.md: "A request lives in the partition of its id (CRC-32 of the id modulo P)"."""
    return zlib.crc32(request_id.encode()) % partitions


def ids_in(part: int, prefix: str, count: int, partitions: int = 2) -> list[str]:
    found: list[str] = []
    i = 0
    while len(found) < count:
        candidate = f"{prefix}-{i}"
        i += 1
        if partition_of(candidate, partitions) == part:
            found.append(candidate)
    return found


async def redis_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def seen(redis: Redis, part: int = 0) -> set[str]:
    return {member.decode() for member in await redis.zrange(seen_key(part), 0, -1)}


async def set_last_submit(redis: Redis, tenant: str, ms_ago: int, part: int = 0) -> None:
    """Pretends `tenant` last submitted `ms_ago` milliseconds ago (it must be counted now)."""
    assert await redis.zscore(seen_key(part), tenant) is not None, (tenant, await seen(redis, part))
    when = await redis_ms(redis) - ms_ago
    await redis.zadd(seen_key(part), {tenant: when}, xx=True)
    assert await redis.zscore(seen_key(part), tenant) == when


async def age_out(redis: Redis, tenant: str, part: int = 0) -> None:
    """An hour and a minute pass for `tenant` alone."""
    await set_last_submit(redis, tenant, HOUR_MS + 60_000, part)


async def bound_is(redis: Redis, value: int, parts: Iterable[int] = (0,)) -> None:
    async def written() -> bool:
        return all([await redis.get(bound_key(p)) == str(value).encode() for p in parts])

    await wait_until(written, 10)


async def prime_with_bound(start_worker: Callable[..., Any], redis: Redis, bound: int, **settings: Any) -> None:
    """A worker with `max_tenants=bound` reads the queue and beats, then stops: for about 30 s clients hold every
    request (the readers mark) under the bound its heartbeat wrote, and nothing moves until a worker starts."""
    primer = await start_worker(worker_id="primer", max_tenants=bound, **settings)
    await wait_until(lambda: redis.exists(READERS), 10)
    await bound_is(redis, bound)
    await stop(primer)
    assert await redis.exists(READERS), "the readers mark went away with the worker"
    assert await redis.get(bound_key()) == str(bound).encode(), "the bound went away with the worker"


async def refused(client: AsyncClient, tenant: str, **options: Any) -> TenantQuotaExceeded:
    options.setdefault("prompt", text(tenant, 0))
    options.setdefault("max_new_tokens", 3)
    with pytest.raises(TenantQuotaExceeded) as caught:
        await client.submit(tenant=tenant, **options)
    assert isinstance(caught.value, QueueFull)
    assert caught.value.tenant == tenant
    return caught.value


async def no_trace_of(redis: Redis, tenant: str, request_ids: Iterable[str], part: int = 0) -> None:
    """Nothing of a refused call in the documented keys: no idempotency marker or result stream for its ids, the
    tenant not counted, not in the quotas' state, not in fair order."""
    for request_id in request_ids:
        assert not await redis.exists(f"{tag(part)}:id:{request_id}"), request_id
        assert not await redis.exists(f"{tag(part)}:result:{request_id}"), request_id
    assert await redis.zscore(seen_key(part), tenant) is None
    counts = [field.decode() for field in await redis.hkeys(f"{tag(part)}:tenants:counts")]
    assert not [field for field in counts if field.startswith(f"{tenant}|")], counts
    for lane in ("interactive", "default", "batch"):
        assert await redis.zscore(f"{tag(part)}:fair:{lane}", tenant) is None


def usage_now(url: str, partitions: int = 1) -> dict[str, TenantUsage]:
    admin = Admin(url, partitions=partitions)
    try:
        return {usage.tenant: usage for usage in read_usage(admin, "default", since_s=7200)}
    finally:
        admin.close()


# --- 1. exact ---------------------------------------------------------------------------------------------------


async def test_bound_is_exact_refusal_leaves_no_trace_and_finishing_frees_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """Bound 3: three tenants are held, the fourth is refused (`TenantQuotaExceeded`, a `QueueFull`, `.tenant` its
    name; through `AsyncClient(tenant=)`, the sync `Client` and `llmq`, exit 7) and nothing of it is queued; each of
    the three goes on, again and again, in every lane; `default` (no tenant named) and `T0` (not `t0`) are new
    tenants like any other. Once all ran, the fourth is still refused: the bound counts tenants that
    submitted within the hour, not requests queued. The key the heartbeat wrote has a TTL."""
    await prime_with_bound(start_worker, redis, 3)
    assert await redis.pttl(bound_key()) > 0
    jobs = [await submit(client, f"t{i}", 0) for i in range(3)]
    assert await redis.xlen(HELD) == 3
    assert await seen(redis) == {"t0", "t1", "t2"}

    await refused(client, "t3", request_id="ghost")
    async with AsyncClient(redis_url, tenant="t4") as own:  # the client's own tenant
        with pytest.raises(TenantQuotaExceeded) as by_client:
            await own.submit(prompt="hello there", max_new_tokens=2, request_id="ghost-own")
        assert by_client.value.tenant == "t4"

    def sync_submit() -> TenantQuotaExceeded:
        with Client(redis_url) as sync, pytest.raises(TenantQuotaExceeded) as caught:
            sync.submit(prompt="hello", max_new_tokens=2, tenant="t5", request_id="ghost-sync")
        return caught.value

    assert (await asyncio.to_thread(sync_submit)).tenant == "t5"
    rc, out, err = await llmq(redis_url, "--tenant", "t6", "submit", "hello", "--no-stream", "--timeout", "5")
    assert rc == 7, (rc, out, err)
    assert "t6" in out + err, (out, err)

    assert await redis.xlen(HELD) == 3
    assert await seen(redis) == {"t0", "t1", "t2"}
    for name, ids in [("t3", ["ghost"]), ("t4", ["ghost-own"]), ("t5", ["ghost-sync"]), ("t6", [])]:
        await no_trace_of(redis, name, ids)

    async with AsyncClient(redis_url) as plain:  # no tenant named: `default`, a tenant like any other
        with pytest.raises(TenantQuotaExceeded) as by_default:
            await plain.submit(prompt="hello", max_new_tokens=2, request_id="ghost-default")
        assert by_default.value.tenant == "default"
    await refused(client, "T0", request_id="ghost-case")  # names are case-sensitive: T0 is not t0
    for name, ids in [("default", ["ghost-default"]), ("T0", ["ghost-case"])]:
        await no_trace_of(redis, name, ids)

    for round_, lane in [(1, "batch"), (2, "interactive")]:  # the first three go on, each time, in any lane
        jobs += [await submit(client, f"t{i}", round_, priority=lane) for i in range(3)]
        await refused(client, "t3", request_id="ghost", priority=lane)  # refusing again counts nothing either
        assert await redis.xlen(f"{TAG}:held:{lane}") == 3
    assert await redis.xlen(HELD) == 3

    await start_worker(worker_id="drain", max_tenants=3)
    results = await asyncio.gather(*[check(*job) for job in jobs])
    assert len(results) == 9
    await refused(client, "t3", request_id="ghost")  # nothing queued any more: still three tenants this hour
    await no_trace_of(redis, "t3", ["ghost"])
    assert await seen(redis) == {"t0", "t1", "t2"}


# --- 2. an hour passing --------------------------------------------------------------------------------------


async def test_a_tenant_quiet_for_an_hour_frees_its_place_and_a_refused_id_is_new_later(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Bound 2, a worker serving. Submitting refreshes a tenant's `:tenants:seen` score. A tenant seen 59 minutes ago
    still counts; one quiet for an hour does not: the new tenant takes its place, with the very request id that was
    refused before, as a new request (its own prompt's answer). The one aged out is then new, and refused."""
    await start_worker(worker_id="w", max_tenants=2)
    await bound_is(redis, 2)
    await wait_until(lambda: redis.exists(READERS), 10)
    for name in ("a", "b"):
        await check(*await submit(client, name, 0))
    await refused(client, "c", request_id="late", prompt="the first prompt of late")
    await no_trace_of(redis, "c", ["late"])

    before = await redis_ms(redis)
    await set_last_submit(redis, "a", 10 * 60_000)
    await check(*await submit(client, "a", 1))
    assert (await redis.zscore(seen_key(), "a") or 0) >= before, "a submit did not refresh the tenant's time"

    await set_last_submit(redis, "b", HOUR_MS - 60_000)  # 59 minutes: still within the hour
    await refused(client, "c", request_id="late")
    await check(*await submit(client, "b", 1))  # and b goes on

    await age_out(redis, "b")
    prompt = text("late", 7)
    job = await client.submit(prompt=prompt, max_new_tokens=5, tenant="c", request_id="late")
    assert job.id == "late"
    await check(job, prompt, 5)
    assert await seen(redis) == {"a", "c"}
    await refused(client, "b", request_id="b-back")
    await no_trace_of(redis, "b", ["b-back"])
    await check(*await submit(client, "a", 2))
    await check(*await submit(client, "c", 2))


# --- 3. n choices and submit_many ------------------------------------------------------------------------------


async def test_n_choices_count_one_tenant_and_a_new_tenants_call_is_refused_whole(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Bound 3: the bound counts tenants, not requests: a counted tenant's `n=4` call and a new tenant's `n=3` call
    taking the last place are held whole; the next new tenant's `n=2` call is refused whole, none of its choices
    queued (`<id>-0`, `<id>-1`, docs/client.md)."""
    await prime_with_bound(start_worker, redis, 3)
    jobs = [await submit(client, "a", 0), await submit(client, "b", 0)]
    many_a = await client.submit(prompt=text("a", 1), max_new_tokens=3, n=4, seed=1, tenant="a")
    assert await redis.xlen(HELD) == 6
    many_c = await client.submit(prompt=text("c", 0), max_new_tokens=3, n=3, seed=1, tenant="c")
    assert await redis.xlen(HELD) == 9
    await refused(client, "d", n=2, seed=1, request_id="dn")
    assert await redis.xlen(HELD) == 9
    await no_trace_of(redis, "d", ["dn", "dn-0", "dn-1"])
    assert await seen(redis) == {"a", "b", "c"}

    await start_worker(worker_id="drain", max_tenants=3)
    await asyncio.gather(*[check(*job) for job in jobs])
    for many, prompt, n in [(many_a, text("a", 1), 4), (many_c, text("c", 0), 3)]:
        result = await many.result(timeout=RESULT_TIMEOUT_S)
        assert len(result.choices) == n
        assert all(one.token_ids == expected_tokens(list(prompt.encode()), 3) for one in result.choices)


def script_calls(info: dict[str, Any]) -> int:
    """Lua script calls Redis counted (`INFO commandstats`): the submit script runs once per submit attempt."""
    return sum(
        int(stats["calls"])
        for name, stats in info.items()
        if name.startswith(("cmdstat_eval", "cmdstat_fcall")) and isinstance(stats, dict)
    )


async def test_submit_many_of_a_new_tenant_waits_without_queuing_until_a_place_frees(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/client.md: `submit_many` "waits (never fails) while the queue is full", and `TenantQuotaExceeded` is a
    `QueueFull`. Bound 2, full: a new tenant's `submit_many` of three requests retries (script calls seen, no worker
    running) and queues nothing meanwhile; once a counted tenant ages out, all three go in and are answered once."""
    await prime_with_bound(start_worker, redis, 2)
    jobs = [await submit(client, "a", 0), await submit(client, "b", 0)]
    held = await redis.xlen(HELD)
    requests = [{"prompt": text("d", i), "max_new_tokens": 3, "tenant": "d", "request_id": f"dm-{i}"} for i in range(3)]

    async def collect() -> list[Any]:
        return [outcome async for outcome in client.submit_many(requests, window=3, timeout=RESULT_TIMEOUT_S)]

    calls = script_calls(await redis.info("commandstats"))
    task = asyncio.create_task(collect())
    try:

        async def retried() -> bool:
            return script_calls(await redis.info("commandstats")) >= calls + 9  # three tries of each

        await wait_until(retried, 15)
        assert not task.done(), task
        assert await redis.xlen(HELD) == held
        await no_trace_of(redis, "d", [f"dm-{i}" for i in range(3)])

        await age_out(redis, "b")
        await start_worker(worker_id="drain", max_tenants=2)
        outcomes = await asyncio.wait_for(task, RESULT_TIMEOUT_S)
    finally:
        task.cancel()
    assert sorted(outcome.request_id for outcome in outcomes) == ["dm-0", "dm-1", "dm-2"]
    for outcome in outcomes:
        assert outcome.error is None, outcome
        prompt = requests[outcome.index]["prompt"]
        assert outcome.result.token_ids == expected_tokens(list(prompt.encode()), 3)
    await asyncio.gather(*[check(*job) for job in jobs])
    assert await seen(redis) == {"a", "d"}


# --- 4. a flood of made-up names ------------------------------------------------------------------------------


async def all_redis_bytes(redis: Redis) -> list[bytes]:
    """Every key name, and every member, field, value and stream entry in this Redis."""
    found: list[bytes] = []
    async for key in redis.scan_iter(count=1000):
        found.append(key)
        kind = (await redis.type(key)).decode()
        if kind == "string":
            found.append(await redis.get(key) or b"")
        elif kind == "hash":
            for field, value in (await redis.hgetall(key)).items():
                found += [field, value]
        elif kind == "zset":
            found += await redis.zrange(key, 0, -1)
        elif kind == "set":
            found += list(await redis.smembers(key))
        elif kind == "list":
            found += await redis.lrange(key, 0, -1)
        elif kind == "stream":
            for _, fields in await redis.xrange(key):
                for field, value in fields.items():
                    found += [field, value]
    return found


async def test_thousands_of_made_up_tenants_leave_redis_bounded_and_the_admitted_served_once(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """Bound 4, a worker serving four real tenants' requests while 3,000 made-up tenants (long names, ids of their
    own) submit concurrently: every made-up one is refused, `:tenants:seen` never holds more than 4, no made-up name
    or id is anywhere in Redis afterwards, and each real request is answered with its own tokens and counted
    exactly once in the usage."""
    await start_worker(worker_id="w", max_tenants=4, max_running=8)
    await bound_is(redis, 4)
    await wait_until(lambda: redis.exists(READERS), 10)
    real = [f"real-{i}" for i in range(4)]
    jobs = [await submit(client, name, 0) for name in real]  # all four counted before the flood

    most = 0

    async def sample() -> None:
        nonlocal most
        while True:
            most = max(most, await redis.zcard(seen_key()))
            await asyncio.sleep(0.005)

    async def fake(i: int) -> TenantQuotaExceeded | None:
        name = f"fake-{i:05d}-" + "z" * 100
        try:
            await client.submit(prompt="made up", max_new_tokens=2, tenant=name, request_id=f"fake-id-{i}")
        except TenantQuotaExceeded as error:
            assert error.tenant == name
            return error
        return None

    sampler = asyncio.create_task(sample())
    try:
        outcomes: list[TenantQuotaExceeded | None] = []
        for start in range(0, 3000, 250):
            wave = asyncio.gather(*[fake(i) for i in range(start, start + 250)])
            jobs += [await submit(client, name, start // 250 + 1) for name in real]
            outcomes += await wave
    finally:
        sampler.cancel()
    assert len(outcomes) == 3000
    assert all(outcome is not None for outcome in outcomes), sum(outcome is None for outcome in outcomes)
    assert most <= 4, most

    await asyncio.gather(*[check(*job) for job in jobs])
    assert await seen(redis) == set(real)

    everything = await all_redis_bytes(redis)
    assert any(b"real-0" in blob for blob in everything)  # the scan sees tenants' names where they are
    assert not [blob[:80] for blob in everything if b"fake-" in blob]

    per_tenant = 1 + 3000 // 250

    async def counted() -> bool:
        usage = await asyncio.to_thread(usage_now, redis_url)
        return all(name in usage and usage[name].total_requests >= per_tenant for name in real)

    await wait_until(counted, 10)
    usage = await asyncio.to_thread(usage_now, redis_url)
    assert {name: usage[name].total_requests for name in usage} == dict.fromkeys(real, per_tenant)


# --- 5. per partition ---------------------------------------------------------------------------------------------


async def test_the_bound_applies_per_partition_and_a_spread_n_call_resumes_by_its_id(
    start_worker: Callable[..., Any], redis: Redis, redis_url: str
) -> None:
    """`LLMQ_QUEUE_PARTITIONS=2`, bound 2, written into both partitions' `:tenants:max`. Requests land by the CRC-32
    of their ids. Partition 0 takes a and b and refuses c; partition 1 still takes c and a (a is new there) and
    refuses d. An `n=6` call of b (counted in partition 0, new in full partition 1) whose choices span both
    partitions is refused; named by its `request_id`, submitting it again once c ages out in partition 1 attaches
    to what went in and submits the rest: six answers. (CRC-32's lowest bit does not change with the last digit's
    two lowest bits, so `<id>-0` to `<id>-3` always share a partition of two: six choices are needed to span both.)"""
    await start_worker(worker_id="w", max_tenants=2, queue_partitions=2)
    await bound_is(redis, 2, parts=(0, 1))
    assert await redis.pttl(bound_key(1)) > 0

    async def both_read() -> bool:
        return bool(await redis.exists(READERS)) and bool(await redis.exists(f"{tag(1)}:held:readers"))

    await wait_until(both_read, 10)
    zero, one = ids_in(0, "p", 8), ids_in(1, "p", 8)
    async with AsyncClient(redis_url, partitions=2) as client:

        async def go(tenant: str, request_id: str) -> tuple[AsyncJob, str, int]:
            prompt = text(request_id, 0)
            job = await client.submit(prompt=prompt, max_new_tokens=3, tenant=tenant, request_id=request_id)
            return job, prompt, 3

        jobs = [await go("a", zero[0]), await go("b", zero[1])]
        await refused(client, "c", request_id=zero[2])
        jobs += [await go("c", one[0]), await go("a", one[1])]
        await refused(client, "d", request_id=one[2])
        await refused(client, "d", request_id=zero[3])
        jobs += [await go("b", zero[4]), await go("c", one[3]), await go("a", zero[5])]
        await no_trace_of(redis, "c", [zero[2]], part=0)
        await no_trace_of(redis, "d", [one[2]], part=1)
        await no_trace_of(redis, "d", [zero[3]], part=0)
        assert await seen(redis, 0) == {"a", "b"}
        assert await seen(redis, 1) == {"a", "c"}
        await asyncio.gather(*[check(*job) for job in jobs])

        spread = next(f"nb-{i}" for i in range(1000) if {partition_of(f"nb-{i}-{k}") for k in range(6)} == {0, 1})
        prompt = text("nb", 0)
        await refused(client, "b", prompt=prompt, n=6, seed=3, request_id=spread)
        assert await seen(redis, 1) == {"a", "c"}
        for k in range(6):
            if partition_of(f"{spread}-{k}") == 1:
                assert not await redis.exists(f"{tag(1)}:id:{spread}-{k}")
        await age_out(redis, "c", part=1)
        many = await client.submit(prompt=prompt, max_new_tokens=3, n=6, seed=3, tenant="b", request_id=spread)
        result = await many.result(timeout=RESULT_TIMEOUT_S)
        assert len(result.choices) == 6
        assert all(choice.token_ids == expected_tokens(list(prompt.encode()), 3) for choice in result.choices)
        assert await seen(redis, 1) == {"a", "b"}
        assert await seen(redis, 0) == {"a", "b"}


# --- 6. two workers, racing submits ---------------------------------------------------------------------------------


async def test_two_workers_one_bound_and_racing_new_tenants_admit_exactly_the_bound(
    start_worker: Callable[..., Any], redis: Redis, redis_url: str
) -> None:
    """Two workers with `max_tenants=5`; 40 new tenants submit at once through three clients: exactly 5 are held,
    35 refused, and the bound stays after one worker stops (the other beats it). Every admitted request is
    answered, and the admitted tenants go on. Then one place frees and one tenant's ten calls race ten rivals."""
    first = await start_worker(worker_id="w1", max_tenants=5)
    await start_worker(worker_id="w2", max_tenants=5)
    await bound_is(redis, 5)
    await wait_until(lambda: redis.exists(READERS), 10)
    clients = [AsyncClient(redis_url) for _ in range(3)]
    try:

        async def one(i: int) -> tuple[str, tuple[AsyncJob, str, int] | None]:
            name = f"race-{i}"
            try:
                return name, await submit(clients[i % 3], name, 0)
            except TenantQuotaExceeded as error:
                assert error.tenant == name
                return name, None

        raced = await asyncio.gather(*[one(i) for i in range(40)])
        admitted = [name for name, job in raced if job is not None]
        assert len(admitted) == 5, admitted
        assert await seen(redis) == set(admitted)
        await asyncio.gather(*[check(*job) for _, job in raced if job is not None])

        await stop(first)
        before = await redis.pttl(bound_key())

        async def rebeaten() -> bool:
            return await redis.pttl(bound_key()) > before

        await wait_until(rebeaten, 10)
        assert await redis.get(bound_key()) == b"5"
        await refused(clients[0], "race-late")
        await asyncio.gather(*[check(*await submit(clients[1], name, 1)) for name in admitted])

        # One place freed; ten calls of one new tenant race ten other new tenants for it: exactly one tenant
        # gets it, and if it is `solo`, all ten of its calls go in (from its first on, it is counted).
        await age_out(redis, admitted[0])

        async def second(name: str, i: int) -> tuple[str, tuple[AsyncJob, str, int] | None]:
            try:
                return name, await submit(clients[i % 3], name, 10 + i)
            except TenantQuotaExceeded as error:
                assert error.tenant == name
                return name, None

        calls = [second("solo", i) for i in range(10)] + [second(f"rival-{i}", i) for i in range(10)]
        raced = await asyncio.gather(*calls)
        winners = {name for name, job in raced if job is not None}
        assert len(winners) == 1, winners
        accepted = [job for _, job in raced if job is not None]
        assert len(accepted) == (10 if winners == {"solo"} else 1), winners
        assert await seen(redis) == set(admitted[1:]) | winners
        await asyncio.gather(*[check(*job) for job in accepted])
    finally:
        for each in clients:
            await each.aclose()


async def test_other_refusals_do_not_count_a_new_tenant(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """Bound 2. A new tenant refused for another reason (the lane full at the client's `max_queue_len`: `QueueFull`;
    an `n` call past its own queued quota even with nothing queued: `InvalidRequest`) submitted nothing, so it is not
    counted: else callers refused anyway could fill the bound and lock others out for an hour. The two places are
    still there for two tenants, and a third is then refused."""
    await prime_with_bound(start_worker, redis, 2)
    admin = Admin(redis_url)
    try:
        await asyncio.to_thread(Tenants(admin, "default").set_limits, "capped", TenantLimits(max_queued=1))
    finally:
        admin.close()
    jobs = [await submit(client, "a", 0)]
    async with AsyncClient(redis_url, max_queue_len=1) as small:  # the lane holds one: full for this client
        with pytest.raises(QueueFull) as full:
            await submit(small, "full", 0)
        assert not isinstance(full.value, TenantQuotaExceeded)
    with pytest.raises(InvalidRequest):
        await client.submit(prompt="too many", max_new_tokens=2, n=2, tenant="capped")
    assert await seen(redis) == {"a"}
    jobs.append(await submit(client, "capped", 0))
    assert await seen(redis) == {"a", "capped"}
    await refused(client, "full")
    await start_worker(worker_id="drain", max_tenants=2)
    await asyncio.gather(*[check(*job) for job in jobs])


async def test_the_bound_outlives_a_long_heartbeat_in_every_partition(
    start_worker: Callable[..., Any], redis: Redis
) -> None:
    """The heartbeat writes `:tenants:max` "with a TTL" into every partition; with a heartbeat of a minute, the key
    must outlast the minute, or the bound would lapse between beats while the worker reads (three partitions)."""
    await start_worker(worker_id="slow", max_tenants=9, heartbeat_s=60, queue_partitions=3)
    await bound_is(redis, 9, parts=(0, 1, 2))
    for part in range(3):
        assert await redis.pttl(bound_key(part)) > 60_000, part


# --- 7. the setting changes -------------------------------------------------------------------------------------------


async def test_the_key_follows_the_workers_setting_and_a_lowered_bound_keeps_the_counted(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """A worker of bound 2 refuses a third tenant; replaced by one of bound 3, the key says 3 and the third goes in;
    replaced by one of bound 1, the three counted tenants go on ("tenants already counted go on") and a new one is
    refused."""
    w2 = await start_worker(worker_id="w2", max_tenants=2)
    await bound_is(redis, 2)
    await wait_until(lambda: redis.exists(READERS), 10)
    await check(*await submit(client, "a", 0))
    await check(*await submit(client, "b", 0))
    await refused(client, "c")
    await stop(w2)

    w3 = await start_worker(worker_id="w3", max_tenants=3)
    await bound_is(redis, 3)
    await check(*await submit(client, "c", 0))
    await refused(client, "d")
    await stop(w3)

    await start_worker(worker_id="w1", max_tenants=1)
    await bound_is(redis, 1)
    for name in ("a", "b", "c"):
        await check(*await submit(client, name, 1))
    await refused(client, "d")
    assert await seen(redis) == {"a", "b", "c"}


# --- 8. without the key, without held requests --------------------------------------------------------------------


async def test_no_bound_without_the_key_nor_without_a_worker_reading(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Bound 1. With `:tenants:max` deleted and no worker beating (the readers mark still set, so requests are held),
    five new tenants are all held. With the key back (a worker beat it) but the readers mark deleted, requests go to
    the lane's stream and the bound does not apply either: three more new tenants go in. All are answered."""
    await prime_with_bound(start_worker, redis, 1)
    await redis.delete(bound_key())
    jobs = [await submit(client, f"free-{i}", 0) for i in range(5)]
    assert await redis.xlen(HELD) == 5
    assert not await redis.exists(bound_key())

    back = await start_worker(worker_id="back", max_tenants=1)
    await bound_is(redis, 1)
    await asyncio.gather(*[check(*job) for job in jobs])
    if not await seen(redis):  # whether tenants count while there is no bound is not said: make one count
        await check(*await submit(client, "first", 0))
    await refused(client, "held-new")  # the bound is back, with the readers mark
    await stop(back)
    await redis.delete(READERS)
    lane_before = await redis.xlen(LANE_STREAM)
    late = [await submit(client, f"lane-{i}", 0) for i in range(3)]
    assert await redis.xlen(LANE_STREAM) == lane_before + 3
    assert await redis.get(bound_key()) == b"1"
    await start_worker(worker_id="drain", max_tenants=1)
    await asyncio.gather(*[check(*job) for job in late])


# --- 9. the gateway --------------------------------------------------------------------------------------------------


async def test_gateway_answers_429_tenant_quota_exceeded_to_a_new_tenants_key_past_the_bound(
    gateway: Callable[..., Any],  # noqa: F811 - the fixture imported above
    start_worker: Callable[..., Any],
    redis: Redis,
    tmp_path: Path,
) -> None:
    """docs/tenants.md: "A new tenant past it is refused (`TenantQuotaExceeded`, `429` at the gateway; nothing
    queued)". Bound 2; keys of three tenants (the third with a weight, which the gateway writes at its start: that is
    not submitting). The first two are answered; the third's key gets 429 `tenant_quota_exceeded`, whole answers,
    streams and `n` alike, and is not counted; the first two go on."""
    content = {
        "g1": {"keys": ["sk-g1"]},
        "g2": {"keys": ["sk-g2"]},
        "g3": {"keys": ["sk-g3"], "weight": 2},
    }
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(content))
    await start_worker(worker_id="gw", max_tenants=2)
    await bound_is(redis, 2)
    served = await gateway(tenants_file=path)
    await wait_until(lambda: redis.exists(READERS), 10)
    async with served.http(timeout=60) as http:
        models: list[str] = []

        async def listed() -> bool:
            answer = await http.get("/v1/models", headers={"Authorization": "Bearer sk-g1"})
            models[:] = [m["id"] for m in answer.json()["data"]]
            return bool(models)

        await wait_until(listed, 10)

        def post(key: str, **extra: Any) -> Any:
            body = {"model": models[0], "prompt": "abcdefgh", "max_tokens": 3, **extra}
            return http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})

        for key in ("sk-g1", "sk-g2"):
            answer = await post(key)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 3
        for extra in ({}, {"n": 2}, {"stream": True}):
            answer = await post("sk-g3", **extra)
            assert answer.status_code == 429, (extra, answer.text)
            assert answer.json()["error"]["code"] == "tenant_quota_exceeded", answer.text
        assert await seen(redis) == {"g1", "g2"}
        assert await redis.hget(f"{TAG}:tenants:weights", "g3") is not None  # written, yet g3 not counted
        for key in ("sk-g2", "sk-g1"):
            answer = await post(key, n=2)
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["choices"]) == 2


# --- 10. the setting -----------------------------------------------------------------------------------------------


def test_max_tenants_defaults_to_ten_thousand_reads_the_environment_and_refuses_below_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/workers.md: `LLMQ_MAX_TENANTS`, default `10000`; a bound below 1 would refuse every tenant or none."""
    assert Settings(_env_file=None).max_tenants == 10_000
    assert Settings(_env_file=None, max_tenants=1).max_tenants == 1
    monkeypatch.setenv("LLMQ_MAX_TENANTS", "7")
    assert Settings(_env_file=None).max_tenants == 7
    for bad in ("0", "-1", "abc", "2.5"):
        monkeypatch.setenv("LLMQ_MAX_TENANTS", bad)
        with pytest.raises(ValidationError, match="max_tenants"):
            Settings(_env_file=None)
    monkeypatch.delenv("LLMQ_MAX_TENANTS")
    for value in (0, -1, -(10**9)):
        with pytest.raises(ValidationError, match="max_tenants"):
            Settings(_env_file=None, max_tenants=value)
