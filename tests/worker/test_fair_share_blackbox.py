"""Black-box: tenants and fair share, from the documentation only.

The contract: docs/tenants.md (a tenant on every request, fair share by virtual time, weights, compatibility and
limits, the keys table), docs/client.md (`submit`, `deadline`, `cancel`, `status`, `max_queue_len`) and the
CHANGELOG's "Tenants and fair share" bullet (the entry fields `o`, the tenant, and `c`, the cost). The surface used:
the client (`AsyncClient(tenant=)`, `submit(..., tenant=)`, `status()`), `client.tenants.Tenants`, the `llmq` command
line (`python -m client.cli`), the Redis keys docs/tenants.md lists, and in-process workers on a real redis-server
through the `start_worker` fixture (the scripted engine's `submitted` list is the order in which a worker started
its requests).

Most tests first let a worker read the queue and stop it ("primed"): clients then hold every request, since a
worker of this release read in the last 30 s, and nothing moves until a worker starts again ("If every worker of
this release goes away, requests already held wait until one returns"). That puts every tenant's backlog in place
before the first move, so the fair order is the only thing deciding what runs. A worker with `max_running=1` starts
its requests one at a time, in the order they were moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Cancelled, Client, InvalidRequest, QueueFull, RequestExpired
from client.admin import Admin
from client.protocol import ENTRY_FIELD, GenerateRequest, encode, ms_now
from client.tenants import Tenants
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until
from tests.worker.tenant_support import (
    LANE_NAMES,
    READERS,
    REPO,
    RESULT_TIMEOUT_S,
    TAG,
    check,
    llmq,
    prime,
    stop,
    submit,
)

WEIGHTS = f"{TAG}:tenants:weights"
TENANT_FIELD = b"o"  # CHANGELOG: "`o` (the tenant, `default` unless the client or the call names one)"


def lane_stream(lane: str, tag: str = TAG) -> str:
    """docs/client.md: `{llmq:<queue>}:requests` for `default`, `...:requests:interactive`, `...:requests:batch`."""
    return f"{tag}:requests" if lane == "default" else f"{tag}:requests:{lane}"


def held(lane: str, tag: str = TAG) -> str:
    return f"{tag}:held:{lane}"


def held_order(lane: str, tag: str = TAG) -> str:
    return f"{tag}:held:{lane}:order"


def fair(lane: str, tag: str = TAG) -> str:
    return f"{tag}:fair:{lane}"


# --- helpers ---------------------------------------------------------------------------------------------------


async def kill(running: Any) -> None:
    """Cancels a worker's task until it is gone (a cancel landing inside a redis-py call may be swallowed)."""
    while not running.task.done():
        running.task.cancel()
        await asyncio.wait([running.task], timeout=1)


class Completions:
    """Records the order in which the client sees results arrive, as (tenant, request id, result)."""

    def __init__(self) -> None:
        self.order: list[tuple[str, str, Any]] = []
        self.tasks: list[asyncio.Task[None]] = []

    def follow(self, tenant: str, job: AsyncJob, prompt: str, tokens: int) -> None:
        async def one() -> None:
            result = await check(job, prompt, tokens)
            self.order.append((tenant, job.id, result))

        self.tasks.append(asyncio.create_task(one()))

    def done(self, tenant: str) -> int:
        return sum(1 for t, _, _ in self.order if t == tenant)

    async def wait(self) -> None:
        await asyncio.gather(*self.tasks)


def started(workers: Sequence[Any]) -> list[str]:
    ids: list[str] = []
    for running in workers:
        ids += running.worker.engine.submitted
    return ids


async def held_total(redis: Redis, tag: str = TAG) -> int:
    return sum([await redis.xlen(held(lane, tag)) for lane in LANE_NAMES])


async def pending_total(redis: Redis, tag: str = TAG) -> int:
    total = 0
    for lane in LANE_NAMES:
        with contextlib.suppress(Exception):  # a lane nobody created yet
            total += (await redis.xpending(lane_stream(lane, tag), "workers"))["pending"]
    return total


async def snapshot(redis: Redis) -> dict[bytes, tuple[bytes, int]]:
    """Every key with its type and size (streams, sorted sets, hashes, strings)."""
    sizes: dict[bytes, tuple[bytes, int]] = {}
    for key in await redis.keys("*"):
        kind = await redis.type(key)
        size = {
            b"stream": redis.xlen,
            b"zset": redis.zcard,
            b"hash": redis.hlen,
            b"set": redis.scard,
            b"list": redis.llen,
            b"string": redis.strlen,
        }.get(kind)
        sizes[key] = (kind, -1 if size is None else await size(key))
    return sizes


# --- 1. a flood does not block others -----------------------------------------------------------------------------


async def test_a_flood_does_not_block_a_tenant_that_comes_later(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Two workers of 4 slots serve; `flood` submits 120 requests, then `small` submits 4. Each of small's requests
    waits for about one of the flood's (docs/tenants.md), so all 4 finish while most of the flood still waits: before
    the flood's 3/4 mark, and with at most 24 of the flood's completions after small submitted (the 8 in flight when
    it did, 4 moved in turn with small's, and one more fleet's worth of slack). Queued first come first served, small
    would wait for the whole flood."""
    workers = [await start_worker(worker_id=f"flood-{i}", max_running=4, step_s=0.01) for i in range(2)]
    await wait_until(lambda: redis.exists(READERS), 10)
    flood, tokens = 120, 12
    seen = Completions()
    for i in range(flood):
        seen.follow("flood", *await submit(client, "flood", i, tokens))
    await wait_until(lambda: seen.done("flood") >= 1, 20)  # the fleet is serving the flood
    at_submit = seen.done("flood")
    assert at_submit < flood // 2, f"the flood was mostly done before small came ({at_submit}): nothing to test"
    assert await redis.xlen(held("default")) > flood // 4  # the flood waits held, as documented
    for i in range(4):
        seen.follow("small", *await submit(client, "small", i, tokens))
    await seen.wait()

    tenants = [tenant for tenant, _, _ in seen.order]
    last_small = max(i for i, tenant in enumerate(tenants) if tenant == "small")
    flood_before = tenants[:last_small].count("flood")
    assert flood_before < flood * 3 // 4, f"small finished after {flood_before} of the flood's {flood}"
    assert flood_before - at_submit <= 24, (at_submit, flood_before, tenants)
    assert sorted(started(workers)) == sorted(request_id for _, request_id, _ in seen.order)  # each once
    assert await held_total(redis) == 0
    assert await pending_total(redis) == 0


# --- 2. weights -----------------------------------------------------------------------------------------------------


async def test_weights_share_tokens_three_to_one(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """`llmq tenants set heavy --weight 3`; heavy and light each hold 120 requests of the same cost (40-byte
    prompt, 8 new tokens). Over the first 120 completions both still have work waiting (heavy runs out only after
    160 moves at 3:1), so heavy's share of the tokens there should be 3/4. The read script moves requests in exact
    virtual-time order (off by at most one request), and completion order differs from move order only among the 8
    requests in flight at once, so the share may stray by about 8/120: the tolerance is 0.08, which still tells
    3/4 from weights ignored (1/2) and from first come first served (all heavy's)."""
    rc, out, err = await llmq(redis_url, "tenants", "set", "heavy", "--weight", "3")
    assert rc == 0, (out, err)
    assert float(await redis.hget(WEIGHTS, "heavy")) == 3.0  # the documented hash: tenant -> weight
    await prime(start_worker, redis)
    each, tokens = 120, 8
    jobs = []
    for tenant in ("heavy", "light"):  # heavy's all first: queued in order, heavy would take the whole window
        jobs += [(tenant, *await submit(client, tenant, i, tokens)) for i in range(each)]
    assert await redis.xlen(held("default")) == 2 * each
    seen = Completions()
    for tenant, job, prompt, n in jobs:
        seen.follow(tenant, job, prompt, n)
    for i in range(2):
        await start_worker(worker_id=f"weights-{i}", max_running=4, step_s=0.005)
    await seen.wait()

    window = seen.order[:each]
    tokens_by = Counter[str]()
    for tenant, _, result in window:
        tokens_by[tenant] += result.usage.prompt_tokens + result.usage.completion_tokens
    share = tokens_by["heavy"] / sum(tokens_by.values())
    assert abs(share - 0.75) <= 0.08, (share, tokens_by, [t for t, _, _ in window])


async def test_a_tenant_of_small_requests_gets_more_of_them(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Equal weights, shares of tokens: `big` requests cost 40 tokens (a 40-byte prompt is 10, plus 30 new), `small`
    ones 20 (10 + 10). One worker starting one request at a time: of the first 30 started, small's should be 20
    (twice as many, the same tokens); 18 to 22 allows the one-request granularity at either end."""
    await prime(start_worker, redis)
    prompts = {}
    for i in range(20):
        job, _, _ = await submit(client, "big", i, tokens=30)
        prompts[job.id] = "big"
    for i in range(40):
        job, _, _ = await submit(client, "small", i, tokens=10)
        prompts[job.id] = "small"
    worker = await start_worker(worker_id="costs", max_running=1)
    await wait_until(lambda: len(worker.worker.engine.submitted) >= 30, 30)
    first = Counter(prompts[i] for i in worker.worker.engine.submitted[:30])
    assert 18 <= first["small"] <= 22, first


async def test_a_weight_is_read_at_the_next_move_and_unset_restores_one(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """Weights set and unset through `client.tenants.Tenants` (what `llmq tenants` uses): with `a` at weight 4,
    `a` gets about 4 of every 5 starts; unset, it is back to 1 and the two alternate."""
    admin = Admin(redis_url)
    try:
        tenants = Tenants(admin, "default")
        await asyncio.to_thread(tenants.set_weight, "a", 4)
        await prime(start_worker, redis)
        ids: dict[str, str] = {}
        for tenant in ("a", "b"):
            for i in range(40):
                job, _, _ = await submit(client, tenant, i, tokens=2)
                ids[job.id] = tenant
        worker = await start_worker(worker_id="weights-live", max_running=1)
        await wait_until(lambda: len(worker.worker.engine.submitted) >= 25, 30)
        first = Counter(ids[i] for i in worker.worker.engine.submitted[:25])
        assert 18 <= first["a"] <= 22, first  # 4/5 of 25 = 20, +-2 for the granularity at both ends
        assert await asyncio.to_thread(tenants.unset_weight, "a") is True
        assert await redis.hget(WEIGHTS, "a") is None
        assert await asyncio.to_thread(tenants.unset_weight, "a") is False  # "False when it had none set"
        mark = len(worker.worker.engine.submitted) + 2  # a move or two may have been decided before the unset
        await wait_until(lambda: len(worker.worker.engine.submitted) >= mark + 20, 30)
        after = Counter(ids[i] for i in worker.worker.engine.submitted[mark : mark + 20])
        # at weight 4, b would get 4 of these 20; at 1 (the two at about the same virtual time) they alternate: 10
        assert after["b"] >= 8, after
    finally:
        admin.close()


# --- 3. order within a tenant and across lanes --------------------------------------------------------------------


async def test_each_tenant_runs_in_the_order_it_submitted(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Three tenants submit 60 requests in a shuffled interleaving, of different costs; one worker starts them one
    at a time: each tenant's own requests start exactly in its submission order."""
    await prime(start_worker, redis)
    rng = random.Random(31)
    order = [rng.choice(["t0", "t1", "t2"]) for _ in range(60)]
    submitted: dict[str, list[str]] = {"t0": [], "t1": [], "t2": []}
    checks = []
    for i, tenant in enumerate(order):
        job, prompt, tokens = await submit(client, tenant, i, tokens=rng.choice([1, 3, 6]), width=rng.choice([8, 40]))
        submitted[tenant].append(job.id)
        checks.append(check(job, prompt, tokens))
    worker = await start_worker(worker_id="fifo", max_running=1)
    await asyncio.gather(*checks)
    ran = worker.worker.engine.submitted
    assert sorted(ran) == sorted(i for ids in submitted.values() for i in ids)
    for tenant, ids in submitted.items():
        assert [i for i in ran if i in set(ids)] == ids, tenant


async def test_each_lane_keeps_its_own_fair_order_and_the_higher_lane_goes_first(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Held in two lanes: `interactive` is served before `default` (lanes still order traffic), and within
    each lane the tenants alternate and keep their order."""
    await prime(start_worker, redis)
    lane_of: dict[str, str] = {}
    tenant_of: dict[str, str] = {}
    for lane in ("default", "interactive"):
        for tenant in ("p", "q"):
            for i in range(6):
                job, _, _ = await submit(client, tenant, i + (100 if lane == "interactive" else 0), priority=lane)
                lane_of[job.id], tenant_of[job.id] = lane, tenant
    assert await redis.xlen(held("interactive")) == 12
    assert await redis.xlen(held("default")) == 12
    worker = await start_worker(worker_id="lanes", max_running=1, lane_share=0)
    await wait_until(lambda: len(worker.worker.engine.submitted) == 24, 30)
    ran = worker.worker.engine.submitted
    assert [lane_of[i] for i in ran] == ["interactive"] * 12 + ["default"] * 12, [lane_of[i] for i in ran]
    for part in (ran[:12], ran[12:]):
        tenants = [tenant_of[i] for i in part]
        assert max(abs(tenants[:k].count("p") - tenants[:k].count("q")) for k in range(13)) <= 2, tenants


async def test_idling_does_not_bank_credit(start_worker: Callable[..., Any], client: AsyncClient, redis: Redis) -> None:
    """`early` runs 10 requests, then `busy` runs 40 alone; both go idle. Then both hold 20: were early's idle time
    credit (it stopped at a tenth of busy's virtual time), all of its 20 would start before any of busy's. Both
    start again at the lane's clock, so they alternate: early gets about 10 of the first 20 starts."""
    first = await start_worker(worker_id="bank-1", max_running=4)
    await wait_until(lambda: redis.exists(READERS), 10)
    for tenant, count in (("early", 10), ("busy", 40)):
        await asyncio.gather(*[check(*await submit(client, tenant, i)) for i in range(count)])
    await stop(first)
    tenant_of: dict[str, str] = {}
    for tenant in ("busy", "early"):  # busy's first: in order, it would go first
        for i in range(100, 120):
            job, _, _ = await submit(client, tenant, i)
            tenant_of[job.id] = tenant
    assert await redis.xlen(held("default")) == 40
    worker = await start_worker(worker_id="bank-2", max_running=1)
    await wait_until(lambda: len(worker.worker.engine.submitted) >= 20, 30)
    starts = Counter(tenant_of[i] for i in worker.worker.engine.submitted[:20])
    assert 8 <= starts["early"] <= 12, starts


# --- 4. hostile input -----------------------------------------------------------------------------------------------

BAD_TENANTS: list[Any] = [
    "",
    "a" * 129,
    "has space",
    "tab\there",
    "new\nline",
    "nul\x00byte",
    "ünïcode",
    "emoji💥",
    "slash/name",
    "star*",
    "{llmq:default}",
    "back\\slash",
    "comma,name",
    "quote'",
    "%s%d",
    "a\r\n*1\r\n$8\r\nFLUSHALL\r\n",
    5,
    b"bytes",
]
GOOD_TENANTS = ["a", "a" * 128, "A.b_c:d-9", "0", ":", "-", ".", "..", "default", "x:y:z"]


@pytest.mark.parametrize("readers", [False, True], ids=["no-reader", "held"])
async def test_an_invalid_tenant_is_refused_and_writes_nothing(
    start_worker: Callable[..., Any], redis: Redis, redis_url: str, readers: bool
) -> None:
    """docs/tenants.md: "A tenant is a name of 1-128 characters of `[A-Za-z0-9._:-]`; anything else raises
    `InvalidRequest` (or `ValueError` for the client's own)". Refused before anything reaches Redis, whether or
    not clients hold requests now."""
    if readers:
        await prime(start_worker, redis)
    before = await snapshot(redis)
    for bad in BAD_TENANTS:
        with pytest.raises(ValueError):
            AsyncClient(redis_url, tenant=bad)
        with pytest.raises(ValueError):
            Client(redis_url, tenant=bad)
    async with AsyncClient(redis_url, tenant="fine") as client:
        for bad in BAD_TENANTS:
            with pytest.raises(InvalidRequest):
                await client.submit(prompt="hello", max_new_tokens=2, tenant=bad)
            with pytest.raises(InvalidRequest):
                await client.submit(prompt="hello", max_new_tokens=2, tenant=bad, n=2)
    assert await snapshot(redis) == before


async def test_the_boundary_names_are_accepted_and_carried(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """1 and 128 characters, and every allowed punctuation; each held entry carries its tenant in field `o`, and
    names that are prefixes of one another (`a`, `a`*128; `.`, `..`) are counted apart by `llmq tenants list`."""
    await prime(start_worker, redis)
    jobs = [(tenant, *await submit(client, tenant, i, tokens=2)) for i, tenant in enumerate(GOOD_TENANTS)]
    jobs += [("..", *await submit(client, "..", 99, tokens=2))]
    entries = await redis.xrange(held("default"))
    assert sorted(fields[TENANT_FIELD].decode() for _, fields in entries) == sorted(t for t, *_ in jobs)
    listing = {info.tenant: info for info in await asyncio.to_thread(tenants_of, redis_url)}
    assert {name: info.held["default"] for name, info in listing.items()} == dict(Counter(t for t, *_ in jobs))
    await start_worker(worker_id="names")
    await asyncio.gather(*[check(job, prompt, tokens) for _, job, prompt, tokens in jobs])
    assert await held_total(redis) == 0


def tenants_of(url: str, partitions: int = 1) -> list[Any]:
    admin = Admin(url, partitions=partitions)
    try:
        return Tenants(admin, "default").listing()
    finally:
        admin.close()


@pytest.mark.parametrize(
    "weight", ["0", "-1", "1000000.5", "1e7", "nan", "inf", "-inf", "abc", ""], ids=lambda w: w or "empty"
)
async def test_a_weight_outside_the_range_is_refused(redis: Redis, redis_url: str, weight: str) -> None:
    """docs/tenants.md: "A weight is a number in (0, 1,000,000]"."""
    rc, out, err = await llmq(redis_url, "tenants", "set", "w", "--weight", weight)
    assert rc != 0, (out, err)
    assert await redis.exists(WEIGHTS) == 0


async def test_the_weight_bounds_and_bad_names_in_the_weight_commands(redis: Redis, redis_url: str) -> None:
    for tenant, weight in (("top", "1000000"), ("tiny", "0.001")):
        rc, out, err = await llmq(redis_url, "tenants", "set", tenant, "--weight", weight)
        assert rc == 0, (out, err)
        assert float(await redis.hget(WEIGHTS, tenant)) == float(weight)
    for bad in ("bad name", "a" * 129, "ü"):
        for args in (("set", bad, "--weight", "2"), ("unset", bad)):
            rc, out, err = await llmq(redis_url, "tenants", *args)
            assert rc != 0, (args, out, err)
    assert sorted(await redis.hkeys(WEIGHTS)) == [b"tiny", b"top"]
    rc, out, err = await llmq(redis_url, "tenants", "unset", "top")
    assert rc == 0, (out, err)
    assert await redis.hkeys(WEIGHTS) == [b"tiny"]


async def test_thousands_of_tenants_lose_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """1,500 distinct tenants of one request each, and one tenant of 100, through two serving workers: every
    request is answered, each started exactly once, and nothing stays held or indexed."""
    workers = [await start_worker(worker_id=f"many-{i}", step_s=0.001) for i in range(2)]
    await wait_until(lambda: redis.exists(READERS), 10)
    jobs = []
    for i in range(1500):
        jobs.append(await submit(client, f"tenant-{i:05d}", i, tokens=1))
        if i % 15 == 0:
            jobs.append(await submit(client, "bulk", i, tokens=1))
    await asyncio.gather(*[check(*job) for job in jobs])
    ran = started(workers)
    assert Counter(ran) == Counter(job.id for job, _, _ in jobs)
    assert await held_total(redis) == 0
    for lane in LANE_NAMES:
        assert await redis.zcard(held_order(lane)) == 0
        assert await redis.zcard(fair(lane)) == 0  # "each tenant with requests held"
    assert await pending_total(redis) == 0


async def test_a_cancelled_held_request_is_answered_cancelled(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/tenants.md: "a held request that was cancelled or expired is answered as such by the worker that reads
    it once moved". Cancelled while held, behind another tenant's backlog; the others run."""
    await prime(start_worker, redis)
    others = [await submit(client, "other", i, tokens=3) for i in range(10)]
    victim, _, _ = await submit(client, "victim", 0, tokens=3)
    after, prompt, tokens = await submit(client, "victim", 1, tokens=3)
    assert await redis.xlen(held("default")) == 12
    await victim.cancel()
    await start_worker(worker_id="cancels")
    with pytest.raises(Cancelled):
        await victim.result(timeout=RESULT_TIMEOUT_S)
    await check(after, prompt, tokens)
    await asyncio.gather(*[check(*job) for job in others])
    assert await held_total(redis) == 0
    assert await pending_total(redis) == 0


async def test_a_held_request_past_its_deadline_is_answered_expired(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Held until after its deadline: answered `expired` and never generated (docs/client.md: "a request still
    queued at its deadline is answered `expired` and never generated"); one with time left runs."""
    await prime(start_worker, redis)
    late, _, _ = await submit(client, "late", 0, tokens=3, deadline=0.3)
    timely, prompt, tokens = await submit(client, "late", 1, tokens=3, deadline=60)
    assert await redis.xlen(held("default")) == 2
    await asyncio.sleep(0.6)  # past the first deadline, on purpose
    worker = await start_worker(worker_id="deadlines")
    with pytest.raises(RequestExpired):
        await late.result(timeout=RESULT_TIMEOUT_S)
    await check(timely, prompt, tokens)
    assert late.id not in worker.worker.engine.submitted
    assert await held_total(redis) == 0


async def test_garbage_weights_do_not_stop_the_fleet(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """`:tenants:weights` is a hash any process on the Redis may write: values no command would write (not a
    number, zero, negative, huge, NaN) must not stop the workers or lose a request."""
    garbage = {"g0": "banana", "g1": "0", "g2": "-5", "g3": "1e308", "g4": "nan", "g5": "", "g6": "inf"}
    await redis.hset(WEIGHTS, mapping=garbage)
    await prime(start_worker, redis)
    jobs = [await submit(client, tenant, i, tokens=2) for i in range(5) for tenant in [*garbage, "plain"]]
    workers = [await start_worker(worker_id=f"garbage-{i}") for i in range(2)]
    await asyncio.gather(*[check(*job) for job in jobs])
    assert not any(w.task.done() for w in workers)
    assert await held_total(redis) == 0
    assert await pending_total(redis) == 0


# --- 5. status and `llmq tenants list` -------------------------------------------------------------------------------


async def test_status_counts_held_requests(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: "Held requests count in `llmq status`'s depth and lag (and its lanes' `held`), in the
    lane's `max_queue_len`"."""
    await prime(start_worker, redis)
    for lane, tenant, count in (("default", "acme", 5), ("default", "zeta", 3), ("batch", "acme", 2)):
        for i in range(count):
            await submit(client, tenant, i + 100 * count, priority=lane)
    await submit(client, "acme", 999, priority="interactive")
    status = await client.status()
    lanes = {lane.lane: lane for lane in status.lanes}
    assert {name: lanes[name].held for name in LANE_NAMES} == {"interactive": 1, "default": 8, "batch": 2}
    assert {name: lanes[name].depth for name in LANE_NAMES} == {"interactive": 1, "default": 8, "batch": 2}
    assert status.depth == 11
    assert status.lag == 11  # the group exists (a worker read): undelivered, held ones included
    assert lanes["default"].lag == 8

    # the lane's max_queue_len counts them: 8 held in `default`, room for one more under 9
    async with AsyncClient(redis_url, max_queue_len=9, tenant="zeta") as limited:
        await limited.submit(prompt="one more", max_new_tokens=1)
        with pytest.raises(QueueFull):
            await limited.submit(prompt="one too many", max_new_tokens=1)
        await limited.submit(prompt="another lane", max_new_tokens=1, priority="batch")  # each lane its own
    assert await redis.xlen(held("default")) == 9

    rc, out, err = await llmq(redis_url, "status", "--json")
    assert rc == 0, (out, err)
    cli_lanes = {lane["lane"]: lane for lane in json.loads(out)["lanes"]}
    assert {name: cli_lanes[name]["held"] for name in LANE_NAMES} == {"interactive": 1, "default": 9, "batch": 3}

    await start_worker(worker_id="status")
    await wait_until(_drained_of(client), 30)
    status = await client.status()
    assert all(lane.held == 0 and lane.depth == 0 for lane in status.lanes), status.lanes
    assert status.depth == 0


async def _drained(client: AsyncClient) -> bool:
    status = await client.status()
    return status.depth == 0


async def test_tenants_list_shows_weights_and_held_requests(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """`llmq tenants list [--json]`: each tenant's weight and requests held, lane by lane."""
    rc, out, err = await llmq(redis_url, "tenants", "list", "--json")
    assert rc == 0, (out, err)
    assert json.loads(out)["tenants"] == []
    rc, out, err = await llmq(redis_url, "tenants", "set", "billing", "--weight", "3")
    assert rc == 0, (out, err)
    await prime(start_worker, redis)
    for i in range(4):
        await submit(client, "billing", i, priority="batch")
    for i in range(2):
        await submit(client, "search", i)
    await submit(client, "bill", 0, priority="interactive")  # a prefix of another tenant's name

    rc, out, err = await llmq(redis_url, "tenants", "list", "--json")
    assert rc == 0, (out, err)
    listed = {t["tenant"]: t for t in json.loads(out)["tenants"]}
    assert set(listed) == {"bill", "billing", "search"}
    assert {name: t["weight"] for name, t in listed.items()} == {"bill": 1, "billing": 3, "search": 1}
    assert listed["billing"]["held"] == {"interactive": 0, "default": 0, "batch": 4}
    assert listed["search"]["held"] == {"interactive": 0, "default": 2, "batch": 0}
    assert listed["bill"]["held"] == {"interactive": 1, "default": 0, "batch": 0}

    rc, out, err = await llmq(redis_url, "tenants", "list")
    assert rc == 0, (out, err)
    lines = out.splitlines()
    assert lines[0] == "queue default: 3 tenants", out
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert rows["billing"][:4] == ["3", "0", "0", "4"], out  # then running, and quotas
    assert rows["search"][:4] == ["1", "0", "2", "0"], out

    await start_worker(worker_id="listing")
    await wait_until(_drained_of(client), 30)
    rc, out, err = await llmq(redis_url, "tenants", "list", "--json")
    assert rc == 0, (out, err)
    for tenant in json.loads(out)["tenants"]:
        assert set(tenant["held"].values()) == {0}, tenant


def _drained_of(client: AsyncClient) -> Callable[[], Any]:
    return lambda: _drained(client)


async def test_weights_and_held_counts_span_every_partition(
    start_worker: Callable[..., Any], redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: weights are set "in Redis, for every partition of the queue", and "with
    `LLMQ_QUEUE_PARTITIONS` above 1 each partition keeps its own fair order". Two partitions."""
    rc, out, err = await llmq(redis_url, "--partitions", "2", "tenants", "set", "wide", "--weight", "2")
    assert rc == 0, (out, err)
    primer = await start_worker(worker_id="parts-primer", queue_partitions=2)

    async def both_read() -> bool:
        return len(await redis.keys("*:held:readers")) == 2

    await wait_until(both_read, 10)
    keys = [k.decode() for k in await redis.keys("*held:readers")]
    await stop(primer)
    tags = sorted(k.removesuffix(":held:readers") for k in keys)
    assert len(tags) == 2, keys
    for tag in tags:
        assert float(await redis.hget(f"{tag}:tenants:weights", "wide")) == 2.0
    async with AsyncClient(redis_url, partitions=2, tenant="wide") as client:
        jobs = [await submit(client, "wide", i, tokens=2) for i in range(20)]
        assert sum([await held_total(redis, tag) for tag in tags]) == 20
        assert all([await held_total(redis, tag) for tag in tags])  # spread over both
        [info] = await asyncio.to_thread(tenants_of, redis_url, 2)
        assert (info.tenant, info.weight, info.held["default"]) == ("wide", 2.0, 20)
        await start_worker(worker_id="parts", queue_partitions=2)
        await asyncio.gather(*[check(*job) for job in jobs])
    for tag in tags:
        assert await held_total(redis, tag) == 0


# --- 6. compatibility -------------------------------------------------------------------------------------------------


async def test_before_any_worker_reads_requests_are_not_held(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/tenants.md: "Clients hold requests only while a worker of this release has read the queue in the last
    30 s or so": on a Redis no worker has read, a request goes to its lane's stream, and a worker started later
    still gets it."""
    jobs = [await submit(client, "early", i, tokens=3) for i in range(3)]
    jobs.append(await submit(client, "early", 9, tokens=3, priority="batch"))
    assert await redis.exists(READERS) == 0
    assert await redis.xlen(lane_stream("default")) == 3
    assert await redis.xlen(lane_stream("batch")) == 1
    assert await held_total(redis) == 0
    [(_, fields)] = await redis.xrange(lane_stream("batch"))
    assert fields[TENANT_FIELD] == b"early"  # the tenant travels all the same
    await start_worker(worker_id="late")
    await asyncio.gather(*[check(*job) for job in jobs])


async def test_held_requests_wait_for_a_worker_to_return(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/tenants.md: "If every worker of this release goes away, requests already held wait until one
    returns"."""
    await prime(start_worker, redis)
    job, prompt, tokens = await submit(client, "patient", 0)
    assert await redis.xlen(held("default")) == 1
    assert await redis.xlen(lane_stream("default")) == 0
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(job.result(timeout=RESULT_TIMEOUT_S)), 0.5)
    await start_worker(worker_id="returns")
    await check(job, prompt, tokens)


async def test_an_entry_without_a_tenant_is_read_before_held_ones(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/tenants.md: "Requests submitted by clients of the last release carry no tenant and go to the lane's
    stream directly: they are read before held ones". Such an entry is written as the last release's client wrote
    it (docs/protocol.md: one field `m`)."""
    await prime(start_worker, redis)
    jobs = [await submit(client, "new", i, tokens=2) for i in range(5)]
    body = GenerateRequest(
        id="old-client-1", submitted=ms_now(), prompt="from an old client", params={"max_new_tokens": 2}
    )
    await redis.xadd(lane_stream("default"), {ENTRY_FIELD: encode(body)})
    worker = await start_worker(worker_id="compat", max_running=1)
    result = await AsyncJob.attach(client, "old-client-1").result(timeout=RESULT_TIMEOUT_S)
    assert result.token_ids == expected_tokens(list(b"from an old client"), 2)
    await asyncio.gather(*[check(*job) for job in jobs])
    assert worker.worker.engine.submitted[0] == "old-client-1"


# --- 7. a worker lost mid-flood -------------------------------------------------------------------------------------


async def test_a_worker_killed_mid_flood_loses_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Two tenants flood two workers; one worker's task is cancelled while it runs requests. The survivor moves
    the rest and claims the dead one's: every answer whole and exactly once, nothing left held or pending."""
    quick = {"lease_timeout_s": 1.0, "lease_renew_s": 0.2, "claim_interval_s": 0.2, "step_s": 0.01, "max_running": 4}
    victim = await start_worker(worker_id="victim", **quick)
    survivor = await start_worker(worker_id="survivor", **quick)
    await wait_until(lambda: redis.exists(READERS), 10)
    jobs = []
    for i in range(40):
        jobs.append(await submit(client, "fa", i, tokens=10))
        if i % 2 == 0:
            jobs.append(await submit(client, "fb", i, tokens=10))
    await wait_until(lambda: victim.worker.engine.stats().running > 0, 10)
    assert await held_total(redis) > 0  # killed mid-flood: requests still held
    await kill(victim)
    jobs += [await submit(client, "fb", 100 + i, tokens=10) for i in range(10)]
    start = time.monotonic()
    await asyncio.gather(*[check(*job) for job in jobs])
    assert time.monotonic() - start < RESULT_TIMEOUT_S
    assert not survivor.task.done()
    victims = set(victim.worker.engine.submitted)
    survivors = Counter(survivor.worker.engine.submitted)
    for job, _, _ in jobs:
        if job.id not in victims:
            assert survivors[job.id] == 1, job.id  # started once, on the survivor
    assert set(survivors) | victims == {job.id for job, _, _ in jobs}
    assert await held_total(redis) == 0
    assert await pending_total(redis) == 0
    assert await redis.xlen(f"{TAG}:dead") == 0


# --- more of the documented surface ---------------------------------------------------------------------------------


async def test_an_interactive_request_held_behind_a_full_worker_still_preempts(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/tenants.md ("Order and lanes stay"): workers still "preempt lower lanes for `interactive` requests". A
    worker of 2 slots runs two long `default` requests (about 3 s each); an interactive one submitted then is held
    like any request, and must still start at once and finish long before them."""
    worker = await start_worker(worker_id="preempt", max_running=2, step_s=0.01)
    await wait_until(lambda: redis.exists(READERS), 10)
    long_jobs = [await submit(client, "bulk", i, tokens=300) for i in range(2)]
    await wait_until(lambda: worker.worker.engine.stats().running == 2, 10)
    urgent, prompt, tokens = await submit(client, "chat", 0, tokens=2, priority="interactive")
    start = time.monotonic()
    await check(urgent, prompt, tokens)
    waited = time.monotonic() - start
    assert not any(job.finish_reason for job, _, _ in long_jobs)  # both still running when it finished
    assert waited < 1.5, waited
    await asyncio.gather(*[check(*job) for job in long_jobs])


async def test_the_cost_field_counts_a_token_per_four_bytes_plus_max_new_tokens(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/tenants.md: "Each request's cost is its prompt plus `max_new_tokens` in tokens (a text prompt counts
    one token per 4 UTF-8 bytes)"; the CHANGELOG: the entry field `c` is "the estimated cost in tokens". Token ids
    count one each."""
    await prime(start_worker, redis)
    await client.submit(prompt="x" * 40, max_new_tokens=30, tenant="cost")  # 10 + 30
    await client.submit(prompt="é" * 20, max_new_tokens=5, tenant="cost")  # 40 bytes: 10 + 5
    await client.submit(input_ids=[7] * 12, max_new_tokens=4, tenant="cost")  # 12 + 4
    costs = [float(fields[b"c"]) for _, fields in await redis.xrange(held("default"))]
    assert costs == [40, 15, 16], costs


@pytest.mark.parametrize("how", ["option", "environment"])
async def test_the_command_line_names_the_tenant(
    start_worker: Callable[..., Any], redis: Redis, redis_url: str, how: str
) -> None:
    """docs/tenants.md: "`llmq --tenant billing submit ...` ... (or `LLMQ_TENANT`)"; a bad name exits non-zero
    and writes nothing."""
    await prime(start_worker, redis)
    env = {**os.environ, "LLMQ_TENANT": "billing"} if how == "environment" else None
    options = ["--tenant", "billing"] if how == "option" else []
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "client.cli",
        "--url",
        redis_url,
        *options,
        "submit",
        "hello there",
        "--max-new-tokens",
        "2",
        "--no-stream",
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_until(lambda: redis.xlen(held("default")), 30)
        [(_, fields)] = await redis.xrange(held("default"))
        assert fields[TENANT_FIELD] == b"billing"
        await start_worker(worker_id="cli-tenant")
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, (out, err)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    rc, out, err = await llmq(redis_url, "--tenant", "bad name", "submit", "hi", "--max-new-tokens", "1")
    assert rc != 0, (out, err)
    assert await redis.xlen(held("default")) + await redis.xlen(lane_stream("default")) <= 1


async def test_the_backlog_gauge_counts_held_requests(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/tenants.md: held requests count "in the workers' backlog gauges" (`llmq:backlog_requests{lane}`,
    "Requests waiting or running in the lane")."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    worker = await start_worker(worker_id="gauge", max_running=1, step_s=0.01)
    await wait_until(lambda: redis.exists(READERS), 10)
    first = await submit(client, "g", 0, tokens=440)  # 4.4 s (the model context is 512): the only slot stays busy
    await wait_until(lambda: worker.worker.engine.stats().running == 1, 10)
    jobs = [await submit(client, "g", i, tokens=1) for i in range(1, 11)]
    assert await redis.xlen(held("default")) == 10

    def backlog() -> float | None:
        for family in text_string_to_metric_families(generate_latest(worker.worker.metrics.registry).decode()):
            for sample in family.samples:
                if sample.name == "llmq:backlog_requests" and sample.labels.get("lane") == "default":
                    return sample.value
        return None

    await wait_until(lambda: backlog() == 11, 4)  # heartbeats every 0.2 s; the long request runs for 4.4
    await first[0].cancel()
    with pytest.raises(Cancelled):
        await first[0].result(timeout=RESULT_TIMEOUT_S)
    await asyncio.gather(*[check(*job) for job in jobs])


@pytest.mark.parametrize(("read_block_ms", "lasts_ms"), [(500, 50_000), (50, 30_000)])
async def test_the_readers_mark_lasts_100_read_blocks_or_30_seconds(
    start_worker: Callable[..., Any], redis: Redis, read_block_ms: int, lasts_ms: int
) -> None:
    """docs/tenants.md: a worker "marks `{<prefix>:<queue>}:held:readers` at every read, for 100 read blocks or
    30 s, whichever is longer (50 s at the default `LLMQ_READ_BLOCK_MS` of 500)". (This test first found the
    sentence wrong: it said "30 s or so (ten read blocks)".)"""
    await start_worker(worker_id="ttl", read_block_ms=read_block_ms)
    await wait_until(lambda: redis.exists(READERS), 10)
    ttl_ms = await redis.pttl(READERS)
    assert lasts_ms - 2_000 <= ttl_ms <= lasts_ms, ttl_ms
