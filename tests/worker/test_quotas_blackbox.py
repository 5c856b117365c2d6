"""Black-box: tenants' quotas, from the documentation only.

The contract: docs/tenants.md ("Quotas", "Fair share", "Usage", "Compatibility and limits"), docs/gateway.md (the
tenants file's `limits` and `retry_after_s`), docs/cli.md (`llmq tenants set/list/unset`, `llmq status`, exit codes)
and docs/client.md ("Errors": `TenantQuotaExceeded`, a `QueueFull` with `.tenant`). The surface used: the client
(`AsyncClient`, `client.tenants.Tenants` / `TenantLimits`, `client.admin.Admin`, `client.usage.read_usage`), the
`llmq` command line as a subprocess, the gateway over HTTP and as a process, in-process workers on the scripted
engine (the `start_worker` fixture) and worker processes (for `kill -9`), on a real redis-server. The only Redis
keys read directly are the ones the docs list: `{llmq:default}:held:readers` and the result streams
`{llmq:default}:result:<id>` (docs/protocol.md), whose entry ids are Redis's clock.

Many tests first let a worker read the queue and stop it ("primed"): clients then hold every request (a worker of
this release read lately) and nothing moves until a worker starts again, so the queued quotas are checked against
a backlog that stays put.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Cancelled, InvalidRequest, QueueFull, TenantQuotaExceeded
from client.admin import Admin
from client.tenants import TenantInfo, TenantLimits, Tenants
from client.usage import read_usage
from testing.scripted_engine import expected_tokens
from tests.gateway.conftest import gateway  # noqa: F401 - the gateway fixture, shared with the gateway tests
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
    text,
)

MAX_LIMIT = 2**53


# --- helpers ---------------------------------------------------------------------------------------------------


def _with_tenants(url: str, partitions: int, work: Callable[[Tenants], Any]) -> Any:
    admin = Admin(url, partitions=partitions)
    try:
        return work(Tenants(admin, "default"))
    finally:
        admin.close()


async def set_limits(url: str, tenant: str, limits: TenantLimits, partitions: int = 1) -> None:
    await asyncio.to_thread(_with_tenants, url, partitions, lambda t: t.set_limits(tenant, limits))


async def tenants_now(url: str, partitions: int = 1) -> dict[str, TenantInfo]:
    listed = await asyncio.to_thread(_with_tenants, url, partitions, lambda t: t.listing())
    return {info.tenant: info for info in listed}


async def listed_json(url: str) -> dict[str, Any]:
    rc, out, err = await llmq(url, "tenants", "list", "--json")
    assert rc == 0, (out, err)
    return {tenant["tenant"]: tenant for tenant in json.loads(out)["tenants"]}


async def span_ms(redis: Redis, request_id: str) -> tuple[int, int]:
    """When a request's first event and its final event were written, by Redis's clock (the entry ids): inside
    the time it counted as running (from its move to its final event)."""
    entries = await redis.xrange(f"{TAG}:result:{request_id}")
    assert entries, request_id
    first, last = entries[0][0].decode(), entries[-1][0].decode()
    return int(first.split("-")[0]), int(last.split("-")[0])


def most_at_once(spans: list[tuple[int, int]]) -> int:
    """The most spans open at one instant; one ending in the millisecond another starts does not overlap it (the
    clock cannot order them), so this never overcounts."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    open_now = most = 0
    for _, step in edges:
        open_now += step
        most = max(most, open_now)
    return most


class Sampler:
    """Polls `Tenants.listing()` (what `llmq tenants list` shows) in the background: the most `running` seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.most: dict[str, int] = {}
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            for name, info in (await tenants_now(self.url)).items():
                self.most[name] = max(self.most.get(name, 0), info.running)
            self.samples += 1
            await asyncio.sleep(0.01)

    def __enter__(self) -> Sampler:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()


# --- 1. max queued requests -------------------------------------------------------------------------------------


async def test_max_queued_counts_every_lane_refuses_n_whole_and_frees_on_drain(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: "Queued counts the tenant's requests held for fair share, in every lane of the partition";
    "a call that would pass either adds nothing (a call of `n` choices is refused whole) and raises
    `client.TenantQuotaExceeded` (a `QueueFull`, with `.tenant`); other tenants' submits go on". A quota of 3 held
    over three lanes; once a worker has run them, the tenant submits again, and ids refused before are new."""
    await set_limits(redis_url, "qa", TenantLimits(max_queued=3))
    await prime(start_worker, redis)
    jobs = [await submit(client, "qa", 0, priority="interactive"), await submit(client, "qa", 1, priority="batch")]
    with pytest.raises(TenantQuotaExceeded) as refused:  # one place left, two choices: refused whole
        await client.submit(prompt=text("qa", 2), max_new_tokens=4, n=2, seed=1, tenant="qa")
    assert isinstance(refused.value, QueueFull)
    assert refused.value.tenant == "qa"
    assert sum((await tenants_now(redis_url))["qa"].held.values()) == 2  # nothing of the refused call added
    jobs.append(await submit(client, "qa", 3))  # the third: at the quota, not past it
    retried = {}
    for lane in LANE_NAMES:  # full in every lane: the count is the tenant's, not a lane's
        prompt = text("qa-again", LANE_NAMES.index(lane))
        with pytest.raises(TenantQuotaExceeded) as again:
            await client.submit(prompt=prompt, max_new_tokens=3, tenant="qa", priority=lane, request_id=f"re-{lane}")
        assert again.value.tenant == "qa"
        retried[lane] = prompt
    async with AsyncClient(redis_url, tenant="qa") as own:  # the client's own tenant, no `tenant=` on the call
        with pytest.raises(TenantQuotaExceeded) as by_client:
            await own.submit(prompt="hello there!", max_new_tokens=2)
        assert by_client.value.tenant == "qa"
    others = [await submit(client, "qb", i, priority=LANE_NAMES[i % 3]) for i in range(6)]  # no quota: goes on

    listed = await tenants_now(redis_url)
    assert listed["qa"].held == {"interactive": 1, "default": 1, "batch": 1}
    assert sum(listed["qb"].held.values()) == 6
    assert listed["qa"].limits == TenantLimits(max_queued=3)

    await start_worker(worker_id="drain", max_running=4, step_s=0.005)
    await asyncio.gather(*[check(*job) for job in jobs + others])
    # Drained: the refused ids were never queued, so submitting them now is a new request that runs.
    reruns = [
        (await client.submit(prompt=p, max_new_tokens=3, tenant="qa", priority=lane, request_id=f"re-{lane}"), p, 3)
        for lane, p in retried.items()
    ]
    await asyncio.gather(*[check(*job) for job in reruns])
    choices = await client.submit(prompt=text("qa", 9), max_new_tokens=3, n=3, seed=5, tenant="qa")  # 3: fits
    result = await choices.result(timeout=RESULT_TIMEOUT_S)
    assert len(result.choices) == 3
    assert all(one.token_ids == expected_tokens(list(text("qa", 9).encode()), 3) for one in result.choices)


# --- 2. max queued tokens -----------------------------------------------------------------------------------------


async def test_max_queued_tokens_counts_prompt_bytes_over_four_plus_max_new_tokens(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: max queued tokens counts "each request's cost (prompt + `max_new_tokens`)", and "a text
    prompt counts one token per 4 UTF-8 bytes"; each of `n` choices is a request of its own (docs/client.md).
    Quota 50: two choices of 30 are refused whole, as a call no retry can fit (`InvalidRequest`, not retried like
    a `QueueFull`); 40 + 10 fill it exactly; 2 more are refused. Counting characters instead of bytes (the 20 'é'
    are 40 bytes) would let the last one in."""
    await set_limits(redis_url, "tok", TenantLimits(max_queued_tokens=50))
    await prime(start_worker, redis)
    with pytest.raises(InvalidRequest, match="'tok'") as refused:
        await client.submit(input_ids=[7] * 5, max_new_tokens=25, n=2, seed=3, tenant="tok")  # 2 x 30 > 50
    assert not isinstance(refused.value, QueueFull)
    assert sum((await tenants_now(redis_url))["tok"].held.values()) == 0
    wide = "é" * 20  # 20 characters, 40 UTF-8 bytes: 10 tokens
    jobs = [(await client.submit(prompt=wide, max_new_tokens=30, tenant="tok"), wide, 30)]  # 40
    jobs.append((await client.submit(prompt="abcd", max_new_tokens=9, tenant="tok"), "abcd", 9))  # +10 = 50
    with pytest.raises(TenantQuotaExceeded):
        await client.submit(input_ids=[7], max_new_tokens=1, tenant="tok")  # +2 = 52
    with pytest.raises(TenantQuotaExceeded):
        await client.submit(input_ids=[7], max_new_tokens=1, tenant="tok", priority="batch")
    big = [await submit(client, "rich", i, tokens=100, width=200) for i in range(3)]  # 150 each, no quota
    assert sum((await tenants_now(redis_url))["tok"].held.values()) == 2

    await start_worker(worker_id="tokens", max_running=4, step_s=0.002)
    await asyncio.gather(*[check(*job) for job in jobs + big])
    ids = [9] * 20
    again = await client.submit(input_ids=ids, max_new_tokens=30, tenant="tok")  # 50 again: the tokens were freed
    await check(again, ids, 30)


# --- 3. max running requests ----------------------------------------------------------------------------------------


async def test_max_running_caps_a_tenant_across_workers_while_others_fill_the_rest(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: "Running counts the tenant's requests moved to run and not finished. At the quota, the
    read script moves other tenants' requests instead; the tenant's next one moves when a running one's final
    event is written." Two workers of 4 slots; `capped` (max running 2) submits 8 requests first, `free` 12 after.
    Each request's first and final events (Redis's clock) lie inside its running time: capped's never overlap more
    than 2 deep, free's do (the fleet had the room); the listing never shows capped above 2; all finish."""
    await set_limits(redis_url, "capped", TenantLimits(max_running=2))
    for i in range(2):
        await start_worker(worker_id=f"cap-{i}", max_running=4, step_s=0.02)
    await wait_until(lambda: redis.exists(READERS), 10)
    with Sampler(redis_url) as sampler:
        capped = [await submit(client, "capped", i, tokens=15) for i in range(8)]
        free = [await submit(client, "free", i, tokens=15) for i in range(12)]
        await asyncio.gather(*[check(*job) for job in capped + free])
    assert sampler.samples > 10
    assert sampler.most.get("capped", 0) <= 2, sampler.most
    capped_spans = [await span_ms(redis, job.id) for job, _, _ in capped]
    free_spans = [await span_ms(redis, job.id) for job, _, _ in free]
    assert most_at_once(capped_spans) <= 2, capped_spans
    assert most_at_once(capped_spans) == 2, capped_spans  # it did use its two
    assert most_at_once(free_spans) >= 3, free_spans  # the rest of the fleet went to free
    listed = await tenants_now(redis_url)
    assert listed["capped"].running == 0 and listed.get("free", TenantInfo("free", 1)).running == 0


async def test_the_choices_of_one_call_run_one_at_a_time_under_max_running_one(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/client.md: `n` choices are "each a request of its own in the queue"; docs/tenants.md: at its running
    quota "the tenant's next one moves when a running one's final event is written". A call of 4 choices by a
    tenant with max running 1, on a worker of 4 free slots: they never overlap, and the call still answers whole."""
    await set_limits(redis_url, "solo", TenantLimits(max_running=1))
    await start_worker(worker_id="choices", max_running=4, step_s=0.01)
    await wait_until(lambda: redis.exists(READERS), 10)
    prompt = text("solo", 0)
    choices = await client.submit(prompt=prompt, max_new_tokens=10, n=4, seed=7, tenant="solo")
    result = await choices.result(timeout=RESULT_TIMEOUT_S)
    assert [one.token_ids for one in result.choices] == [expected_tokens(list(prompt.encode()), 10)] * 4
    spans = [await span_ms(redis, f"{choices.id}-{i}") for i in range(4)]
    assert most_at_once(spans) == 1, spans
    assert (await tenants_now(redis_url))["solo"].running == 0


async def test_with_no_worker_reading_quotas_do_not_apply(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: "Quotas apply to held requests, so only while workers of this release read the queue ...:
    with no worker reading for the readers' mark's lifetime, requests go to the lanes' streams and only
    `max_queue_len` bounds them." No worker has read this Redis: a tenant with max queued 1 (and 5 queued
    tokens) submits 3 requests, and a worker started later answers them all."""
    await set_limits(redis_url, "early", TenantLimits(max_queued=1, max_queued_tokens=5))
    assert not await redis.exists(READERS)
    jobs = [await submit(client, "early", i, tokens=3) for i in range(3)]
    assert sum((await tenants_now(redis_url))["early"].held.values()) == 0  # not held: in the lane's stream
    await start_worker(worker_id="late", max_running=2)
    await asyncio.gather(*[check(*job) for job in jobs])


# --- 4. tokens per minute -------------------------------------------------------------------------------------------


async def test_a_rate_is_served_first_whatever_the_weights_then_overflows(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: "While the bucket holds at least one token, the tenant's requests are *reserved*: they move
    before those of tenants without a rate, whatever their virtual times. Once it is empty the tenant is in
    *overflow*: its requests move only when no tenant within its rate or without one has a request waiting".
    `heavy` has weight 100 and submits first; `rated` (6 tokens a minute, requests of 3) submits after. One worker
    starting one request at a time: rated's first two, then all of heavy's, then rated's rest (a token refills in
    10 s, far longer than heavy's requests take), all of them answered."""
    admin_weight = await llmq(redis_url, "tenants", "set", "heavy", "--weight", "100")
    assert admin_weight[0] == 0, admin_weight
    rc, out, err = await llmq(redis_url, "tenants", "set", "rated", "--tokens-per-minute", "6")
    assert rc == 0, (out, err)
    await prime(start_worker, redis)
    jobs: dict[str, str] = {}
    pending = []
    for tenant in ("heavy", "rated"):
        for i in range(6):
            ids = [11 + i, 200 + len(jobs)]  # 2 prompt tokens + 1 new: a cost of 3; distinct starts
            job = await client.submit(input_ids=ids, max_new_tokens=1, tenant=tenant)
            jobs[job.id] = tenant
            pending.append((job, ids, 1))
    worker = await start_worker(worker_id="rate", max_running=1, step_s=0.005)
    await asyncio.gather(*[check(*job) for job in pending])
    order = [jobs[request_id] for request_id in worker.worker.engine.submitted]
    assert order == ["rated"] * 2 + ["heavy"] * 6 + ["rated"] * 4, order


async def test_a_rate_gets_back_what_a_cancelled_request_did_not_use(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: "moving a request takes its cost from the bucket (and a finished request gives back what it
    did not use)". `rated` has 20 tokens a minute (one back every 3 s) and 4 requests of 10 (2 prompt tokens + 8
    new), each cancelled at its first token; `plain` (no rate) submitted 4 first. Without the refund, the bucket is
    empty after rated's second request and plain's 4 run before rated's last 2; with it, each cancelled request
    gives back what it did not generate and rated's 4 all run first. One worker starting one request at a time."""
    await set_limits(redis_url, "rated", TenantLimits(tokens_per_minute=20))
    await prime(start_worker, redis)
    plain = [await client.submit(input_ids=[30 + i, 5], max_new_tokens=1, tenant="plain") for i in range(4)]
    rated = [await client.submit(input_ids=[60 + i, 5], max_new_tokens=8, tenant="rated") for i in range(4)]
    names = {job.id: "plain" for job in plain} | {job.id: "rated" for job in rated}

    async def cancel_at_first_token(job: AsyncJob) -> None:
        async for _ in job.stream():
            await job.cancel()
            break
        with pytest.raises(Cancelled):
            await job.result(timeout=RESULT_TIMEOUT_S)

    followers = [asyncio.create_task(cancel_at_first_token(job)) for job in rated]
    worker = await start_worker(worker_id="refund", max_running=1, step_s=0.1)  # 8 tokens: 0.8 s uncancelled
    await asyncio.gather(*followers)
    for i, job in enumerate(plain):
        await check(job, [30 + i, 5], 1)
    order = [names[request_id] for request_id in worker.worker.engine.submitted]
    assert order == ["rated"] * 4 + ["plain"] * 4, order


# --- 5. llmq status, a quota removed live, cancels --------------------------------------------------------------


async def test_status_shows_shares_and_removing_max_running_lets_held_requests_run(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """One worker of 6 slots; `qa` (max queued 10, max running 1) and `qb` submit 3 long requests each: qa runs 1
    and holds 2 although 2 slots are free, qb runs 3. `llmq status` shows each with held, running and share (docs:
    "its share of the running ones"). `llmq tenants set qa --max-running 0` removes that quota and keeps max
    queued (docs: "0 removes one quota; the others are kept"): qa's held ones then run. Cancelled, every request's
    final event frees its running count."""
    rc, out, err = await llmq(redis_url, "tenants", "set", "qa", "--max-queued", "10", "--max-running", "1")
    assert rc == 0, (out, err)
    worker = await start_worker(worker_id="status", max_running=6, step_s=0.1)
    await wait_until(lambda: redis.exists(READERS), 10)
    jobs = [await submit(client, tenant, i, tokens=200) for tenant in ("qa", "qb") for i in range(3)]  # 20 s each

    async def settled() -> bool:
        now = await tenants_now(redis_url)
        return (now["qa"].running, sum(now["qa"].held.values()), now["qb"].running) == (1, 2, 3)

    await wait_until(settled, 10)
    engine = worker.worker.engine
    await wait_until(lambda: engine.stats().running == 4, 10)  # counted when moved, started once admitted: after
    await asyncio.sleep(0.3)  # three steps: a fifth would have started by now
    assert engine.stats().running == 4 and await settled()  # two slots free, and qa's held ones still wait
    rc, out, err = await llmq(redis_url, "status")
    assert rc == 0, (out, err)
    assert "tenants: 2 with requests held or running" in out, out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("  qa ", "  qb "))}
    assert rows["qa"] == ["held", "2", "running", "1", "share", "25%"], out
    assert rows["qb"] == ["held", "0", "running", "3", "share", "75%"], out

    rc, out, err = await llmq(redis_url, "tenants", "set", "qa", "--max-running", "0")
    assert rc == 0, (out, err)

    async def qa_runs_all() -> bool:
        return (await tenants_now(redis_url))["qa"].running == 3

    await wait_until(qa_runs_all, 10)
    assert not any(job.finish_reason for job, _, _ in jobs)  # the first was still running: the quota went away
    listed = await listed_json(redis_url)
    assert listed["qa"]["limits"] == {
        "max_queued": 10,
        "max_queued_tokens": None,
        "max_running": None,
        "tokens_per_minute": None,
    }
    for job, _, _ in jobs:
        await job.cancel()
    for job, _, _ in jobs:
        with pytest.raises(Cancelled):
            await job.result(timeout=RESULT_TIMEOUT_S)
    listed = await listed_json(redis_url)
    assert {name: one["running"] for name, one in listed.items()} == {"qa": 0, "qb": 0}
    rc, out, err = await llmq(redis_url, "status")
    assert rc == 0 and "tenants:" not in out, out  # none with requests held or running


# --- 6. the command line --------------------------------------------------------------------------------------------


async def test_llmq_tenants_quotas_take_effect_and_bad_values_change_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/cli.md: `--max-queued N`, `--max-queued-tokens N`, `--max-running N` and `--tokens-per-minute N` set
    quotas (0 removes one; what is not given is kept); `tenants unset` gives back no quotas; bad flags exit 2. Each
    change is what the next submit is checked against."""
    all_four = ["--max-queued", "2", "--max-queued-tokens", "100", "--max-running", "3", "--tokens-per-minute", "600"]
    rc, out, err = await llmq(redis_url, "tenants", "set", "cl", *all_four)
    assert rc == 0, (out, err)
    quotas = {"max_queued": 2, "max_queued_tokens": 100, "max_running": 3, "tokens_per_minute": 600}
    assert (await listed_json(redis_url))["cl"]["limits"] == quotas
    rc, out, err = await llmq(redis_url, "tenants", "set", "cl", "--max-running", "0", "--tokens-per-minute", "0")
    assert rc == 0, (out, err)
    quotas |= {"max_running": None, "tokens_per_minute": None}
    assert (await listed_json(redis_url))["cl"]["limits"] == quotas
    rc, out, err = await llmq(redis_url, "tenants", "list")
    assert rc == 0, (out, err)
    assert any(line.endswith("max queued 2, max queued tokens 100") for line in out.splitlines()), out

    bad = [
        ["--max-queued", "-1"],
        ["--max-running", "abc"],
        ["--max-queued-tokens", "2.5"],
        ["--tokens-per-minute", "1e3"],
        ["--max-queued", ""],
        ["--weight", "0"],
        ["--weight", "-2"],
    ]
    for flags in bad:
        rc, out, err = await llmq(redis_url, "tenants", "set", "cl", *flags)
        assert rc == 2, (flags, rc, out, err)
    rc, out, err = await llmq(redis_url, "tenants", "set", "bad name", "--max-queued", "3")
    assert rc == 2, (out, err)
    listed = await listed_json(redis_url)
    assert listed["cl"]["limits"] == quotas and listed["cl"]["weight"] == 1  # nothing of the bad calls written
    assert set(listed) == {"cl"}

    await prime(start_worker, redis)
    jobs = [await submit(client, "cl", i, tokens=4) for i in range(2)]  # 14 tokens each
    with pytest.raises(TenantQuotaExceeded):
        await submit(client, "cl", 2, tokens=4)  # max queued 2
    rc, out, err = await llmq(redis_url, "--tenant", "cl", "submit", "over the quota", "--max-new-tokens", "2")
    assert rc == 7, (rc, out, err)  # a QueueFull: "retry later"
    assert err.startswith("llmq: error:") and len(err.strip().splitlines()) == 1, err
    assert sum((await tenants_now(redis_url))["cl"].held.values()) == 2
    rc, out, err = await llmq(redis_url, "tenants", "set", "cl", "--max-queued", "0")
    assert rc == 0, (out, err)
    jobs.append(await submit(client, "cl", 3, tokens=4))  # that quota gone: 42 tokens held
    with pytest.raises(TenantQuotaExceeded):
        await submit(client, "cl", 4, tokens=59)  # 42 + 69 > 100: the tokens quota was kept
    jobs.append(await submit(client, "cl", 5, tokens=48))  # 42 + 58 = 100: at it, not past it
    rc, out, err = await llmq(redis_url, "tenants", "unset", "cl")
    assert rc == 0, (out, err)
    jobs.append(await submit(client, "cl", 6, tokens=200))  # no quotas at all now
    rc, out, err = await llmq(redis_url, "tenants", "list")
    assert rc == 0, (out, err)
    [row] = [line for line in out.splitlines() if line.startswith("  cl ")]
    assert row.split()[-1] == "none", out
    await start_worker(worker_id="cli", max_running=8, step_s=0.002)
    await asyncio.gather(*[check(*job) for job in jobs])


# --- 7. partitions ---------------------------------------------------------------------------------------------------


async def test_each_partition_applies_the_queued_quota_on_its_own(
    start_worker: Callable[..., Any], redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md: "With `LLMQ_QUEUE_PARTITIONS` above 1, each partition applies them on its own (a quota of
    100 queued allows up to 100 per partition)"; `llmq tenants set` writes "in every partition". docs/operations/
    redis.md: "A request lives in the partition of its id (CRC-32 of the id modulo P)". Max queued 2 over two
    partitions: two ids of each partition go in, the third of each is refused."""
    rc, out, err = await llmq(redis_url, "--partitions", "2", "tenants", "set", "wide", "--max-queued", "2")
    assert rc == 0, (out, err)
    primer = await start_worker(worker_id="parts-primer", queue_partitions=2)

    async def both_read() -> bool:
        return len(await redis.keys("*:held:readers")) == 2

    await wait_until(both_read, 10)
    await stop(primer)
    by_part: dict[int, list[str]] = {0: [], 1: []}
    n = 0
    while min(len(ids) for ids in by_part.values()) < 3:
        request_id = f"wide-{n}"
        n += 1
        part = zlib.crc32(request_id.encode()) % 2
        if len(by_part[part]) < 3:
            by_part[part].append(request_id)
    accepted: list[tuple[AsyncJob, str, int]] = []
    async with AsyncClient(redis_url, partitions=2, tenant="wide") as client:
        for ids in by_part.values():
            for i, request_id in enumerate(ids):
                prompt = text(request_id, i)
                if i < 2:
                    job = await client.submit(prompt=prompt, max_new_tokens=2, request_id=request_id)
                    accepted.append((job, prompt, 2))
                else:
                    with pytest.raises(TenantQuotaExceeded):
                        await client.submit(prompt=prompt, max_new_tokens=2, request_id=request_id)
        info = (await tenants_now(redis_url, partitions=2))["wide"]
        assert info.held["default"] == 4, info  # two per partition
        assert info.limits == TenantLimits(max_queued=2)
        await start_worker(worker_id="parts", queue_partitions=2)
        await asyncio.gather(*[check(*job) for job in accepted])


# --- 8. a worker killed with kill -9 -------------------------------------------------------------------------------

WORKER_PROCESS = """
import asyncio, signal, sys
from client.connection import open_async
from testing.scripted_engine import ScriptedEngine
from worker.config import Settings
from worker.service import Worker

async def main(url, name):
    settings = Settings(
        _env_file=None, redis_url=url, worker_id=name, model="scripted", max_running=4, metrics_port=0,
        read_block_ms=20, heartbeat_s=0.2, lease_timeout_s=1.0, lease_renew_s=0.2, claim_interval_s=0.2,
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with open_async(url) as redis:
        await Worker(settings, ScriptedEngine(step_s=0.02, max_running=4), redis).run(stop)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@contextlib.contextmanager
def worker_processes(url: str, names: list[str], logs: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """`WORKER_PROCESS` per name, stopped (SIGTERM, then SIGKILL) at the end."""
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in names:
            with (logs / f"{name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-c", WORKER_PROCESS, url, name],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def holder_of(redis: Redis, tenant: str) -> str | None:
    """The worker that has one of `tenant`'s requests running: the consumer an entry of the lane's stream is
    pending on (docs/protocol.md: the stream is read by the group `workers`; the entry's field `o` its tenant)."""
    stream = f"{TAG}:requests"
    for pending in await redis.xpending_range(stream, "workers", "-", "+", 100):
        entry = await redis.xrange(stream, pending["message_id"], pending["message_id"])
        if entry and entry[0][1].get(b"o") == tenant.encode():
            return str(pending["consumer"].decode())
    return None


def log_tails(logs: Path) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs.glob("*.log"))


def usage_of(url: str) -> dict[str, Any]:
    admin = Admin(url)
    try:
        return {one.tenant: one for one in read_usage(admin, "default", since_s=3600)}
    finally:
        admin.close()


async def test_kill_9_under_quotas_loses_nothing_counts_once_and_leaks_no_running_count(
    redis: Redis, redis_url: str, tmp_path: Path
) -> None:
    """docs/tenants.md: "a worker killed with `kill -9` leaks nothing: its requests resume on another worker under
    the same count, and their final event frees it"; usage counts "each request ... exactly once, however often it
    was ... claimed after its worker died". Two worker processes of 4 slots; `qk` (max running 3, max queued 50)
    and `qo` (no quota) submit 10 requests each; the worker running the most is killed with SIGKILL. Every answer
    is whole, qk never runs more than 3, the usage equals what the clients saw, and nothing stays counted as
    running."""
    rc, out, err = await llmq(redis_url, "tenants", "set", "qk", "--max-running", "3", "--max-queued", "50")
    assert rc == 0, (out, err)
    with worker_processes(redis_url, ["k-0", "k-1"], tmp_path) as procs:
        async with AsyncClient(redis_url) as client:

            async def both_up() -> bool:
                if any(p.poll() is not None for p in procs.values()):
                    raise AssertionError(await asyncio.to_thread(log_tails, tmp_path))
                return len((await client.status()).workers) == 2 and bool(await redis.exists(READERS))

            await wait_until(both_up, 60)
            with Sampler(redis_url) as sampler:
                jobs: list[tuple[str, AsyncJob, list[int], int]] = []
                for i in range(10):
                    for tenant in ("qk", "qo"):
                        ids = [20 + i, 3 if tenant == "qk" else 4, 9]
                        job = await client.submit(input_ids=ids, max_new_tokens=30, tenant=tenant)
                        jobs.append((tenant, job, ids, 30))

                async def busy() -> Any:
                    workers = (await client.status()).workers
                    return all(w.running > 0 for w in workers) and await holder_of(redis, "qk") in procs

                await wait_until(busy, 20)
                victim = await holder_of(redis, "qk")  # a worker running one of qk's requests
                procs[victim].send_signal(signal.SIGKILL)
                await asyncio.to_thread(procs[victim].wait, 10)
                results = await asyncio.gather(*[check(job, ids, n) for _, job, ids, n in jobs])
            assert sampler.most.get("qk", 0) <= 3, sampler.most
            assert all(proc.poll() is None for name, proc in procs.items() if name != victim)  # the survivor
            assert (await client.status()).dead == 0

    seen: dict[str, list[int]] = {"qk": [0, 0, 0], "qo": [0, 0, 0]}
    for (tenant, _, _, _), result in zip(jobs, results, strict=True):
        assert result.finish_reason == "length"
        seen[tenant][0] += 1
        seen[tenant][1] += result.usage.prompt_tokens
        seen[tenant][2] += result.usage.completion_tokens
    assert seen["qk"] == [10, 30, 300]
    counted = await asyncio.to_thread(usage_of, redis_url)
    assert set(counted) == {"qk", "qo"}, counted
    for tenant, (requests, prompt, generated) in seen.items():
        one = counted[tenant]
        assert one.requests == {"length": requests}, one  # each request once, the killed worker's included
        assert (one.prompt_tokens, one.generated_tokens) == (prompt, generated), (one, seen)
    resumed = [tenant for tenant, job, _, _ in jobs if int(await redis.hget(f"{TAG}:fence:{job.id}", "a") or 0) > 1]
    assert "qk" in resumed, resumed  # the kill did land mid-run: qk's requests were taken over
    assert len(resumed) < len(jobs), resumed  # (and only the victim's)
    listed = await listed_json(redis_url)
    assert "qk" in listed and {tenant["running"] for tenant in listed.values()} == {0}, listed
    rc, out, err = await llmq(redis_url, "usage", "--json")
    assert rc == 0, (out, err)
    by_cli = {row["tenant"]: row for row in json.loads(out)["tenants"]}
    assert {name: row["total_requests"] for name, row in by_cli.items()} == {"qk": 10, "qo": 10}


# --- 9. the gateway --------------------------------------------------------------------------------------------------


def tenants_file(tmp_path: Path, content: Any) -> Path:
    path = tmp_path / "tenants.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


async def test_gateway_tokens_quota_429_uses_the_gateways_retry_after_for_that_tenant_only(
    gateway: Callable[..., Any],  # noqa: F811 - the fixture imported above
    start_worker: Callable[..., Any],
    redis: Redis,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """docs/gateway.md: `limits` takes `max_queued_tokens`; "a request that would pass the tenant's queued quota
    gets `429` with code `tenant_quota_exceeded` and `Retry-After: <retry_after_s>` (the tenant's own, else
    `LLMQ_GATEWAY_RETRY_AFTER_S`)"; the file's quotas are "written to ... Redis ... at each start (as `llmq tenants
    set` does)". One worker of one slot, busy with another tenant's request: `bill` (50 queued tokens, no
    retry_after_s of its own) gets 2 + 40 held, then 2 + 10 is refused with the gateway's Retry-After 4; 2 + 6
    fills it exactly; `srch`, whose own retry_after_s is 9, is never refused; every accepted request answers."""
    content = {
        "bill": {"keys": ["sk-bill"], "limits": {"max_queued_tokens": 50}},
        "srch": {"keys": ["sk-srch"], "retry_after_s": 9},
    }
    await start_worker(worker_id="gw", max_running=1, step_s=0.02)
    served = await gateway(tenants_file=tenants_file(tmp_path, content), retry_after_s=4)
    assert (await tenants_now(redis_url))["bill"].limits == TenantLimits(max_queued_tokens=50)
    async with served.http(timeout=60) as http:
        models: list[str] = []

        async def listed() -> bool:  # a key is needed once the file names keys
            answer = await http.get("/v1/models", headers={"Authorization": "Bearer sk-bill"})
            models[:] = [m["id"] for m in answer.json()["data"]]
            return bool(models)

        await wait_until(listed, 10)
        model = models[0]

        def post(key: str, max_tokens: int) -> Any:
            body = {"model": model, "prompt": "abcdefgh", "max_tokens": max_tokens}  # 8 bytes: 2 tokens
            return http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})

        blocker = asyncio.create_task(post("sk-srch", 100))  # 2 s on the only slot

        async def occupied() -> bool:
            return (await tenants_now(redis_url)).get("srch", TenantInfo("srch", 1)).running == 1

        await wait_until(occupied, 10)
        first = asyncio.create_task(post("sk-bill", 40))  # 42 held

        async def held_one() -> bool:
            return sum((await tenants_now(redis_url)).get("bill", TenantInfo("bill", 1)).held.values()) == 1

        await wait_until(held_one, 10)
        refused = await post("sk-bill", 10)  # 42 + 12 > 50
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tenant_quota_exceeded"
        assert refused.headers["Retry-After"] == "4"
        fits = asyncio.create_task(post("sk-bill", 6))  # 42 + 8 = 50

        async def held_two() -> bool:
            return sum((await tenants_now(redis_url))["bill"].held.values()) == 2

        await wait_until(held_two, 10)
        other = [asyncio.create_task(post("sk-srch", 30)) for _ in range(3)]  # another tenant: held, not refused
        answers = await asyncio.gather(blocker, first, fits, *other)
    assert [answer.status_code for answer in answers] == [200] * 6, [a.text for a in answers]
    assert [answer.json()["usage"]["completion_tokens"] for answer in answers] == [100, 40, 6, 30, 30, 30]


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"max_queued": -5}, "max_queued"),
        ({"tokens_per_minute": True}, "tokens_per_minute"),
        ({"max_queued_tokens": "100"}, "max_queued_tokens"),
        ({"max_running": 3, "max_queued": 1.5}, "max_queued"),
    ],
)
def test_gateway_refuses_to_start_with_a_bad_limit_naming_no_key(
    tmp_path: Path, limits: dict[str, Any], field: str
) -> None:
    """docs/gateway.md: `limits` take "whole numbers from 1"; "The file is checked whole at start (a key listed
    twice, a bad name, weight or quota refuses the start, naming no key)". `llmq-gateway` as a process: it exits
    at once, without reaching Redis (nothing listens at the URL), and its message names the quota, not the key."""
    content = {"ok": {"keys": ["sk-fine-key"]}, "bad": {"keys": ["sk-very-secret-key"], "limits": limits}}
    path = tenants_file(tmp_path, content)
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--tenants-file", str(path), "--redis-url", "redis://127.0.0.1:1/0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode != 0, (done.stdout, done.stderr)
    said = done.stdout + done.stderr
    assert field in said, said
    assert "sk-very-secret-key" not in said and "sk-fine-key" not in said, said


# --- 10. hostile values through the Python API --------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 2.5, "3", True, math.nan, math.inf, -(2**60)])
@pytest.mark.parametrize("name", ["max_queued", "max_queued_tokens", "max_running", "tokens_per_minute"])
def test_tenant_limits_refuse_what_is_not_a_whole_number_from_one(name: str, value: Any) -> None:
    """docs/gateway.md: quotas are "whole numbers from 1" (0 only means "none" on `llmq tenants set`)."""
    with pytest.raises(ValueError, match=name):
        TenantLimits(**{name: value})


async def test_huge_quotas_round_trip_exactly_and_refuse_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """The largest quota the Python API takes (2**53, where a double still counts by ones) is stored and listed
    exactly and refuses no submit; a larger one is refused before anything is written, never stored rounded.
    A bad tenant name is a ValueError too (docs/tenants.md: names are 1-128 characters of `[A-Za-z0-9._:-]`)."""
    huge = TenantLimits(max_queued=MAX_LIMIT, max_queued_tokens=MAX_LIMIT, max_running=MAX_LIMIT)
    await set_limits(redis_url, "big", huge)
    listed = await listed_json(redis_url)
    assert listed["big"]["limits"] == {
        "max_queued": MAX_LIMIT,
        "max_queued_tokens": MAX_LIMIT,
        "max_running": MAX_LIMIT,
        "tokens_per_minute": None,
    }
    try:
        larger: TenantLimits | None = TenantLimits(max_queued=10**30)
    except ValueError:
        larger = None
    if larger is not None:  # taken: then it must come back as given
        await set_limits(redis_url, "bigger", larger)
        assert (await tenants_now(redis_url))["bigger"].limits == larger
    with pytest.raises(ValueError):
        await set_limits(redis_url, "no spaces", TenantLimits(max_queued=3))
    with pytest.raises(ValueError):
        await set_limits(redis_url, "x" * 129, TenantLimits(max_queued=3))
    assert set(await tenants_now(redis_url)) <= {"big", "bigger"}
    await prime(start_worker, redis)
    jobs = [await submit(client, "big", i, tokens=3) for i in range(5)]
    assert sum((await tenants_now(redis_url))["big"].held.values()) == 5
    await start_worker(worker_id="huge", max_running=4)
    await asyncio.gather(*[check(*job) for job in jobs])
