"""Black-box: kept slots (`LLMQ_IDLE_TENANT_SLOTS`), from the documentation only.

The contract: docs/tenants.md ("Kept slots", read with "Fair share", "Weights" and "Quotas") and the settings table
of docs/workers.md. Each worker keeps its last N free slots, on the `default` and `batch` lanes, for tenants with
nothing running (in the queue partition, any lane); a tenant with requests running never takes one (a flood runs on
`max_running - N` slots per worker); the first request of a tenant with nothing running takes a kept slot the moment
it is held, its next ones wait their turn in fair order; the `interactive` lane takes any free slot; nothing is
preempted; requests that carry no tenant take only open slots; the setting is below `LLMQ_MAX_RUNNING`; `0` (the
default) keeps nothing.

The surface used: the client (`AsyncClient.submit(..., tenant=, priority=, n=)`, job results), `client.tenants`
(weights and quotas, what `llmq tenants set` writes), the settings (`worker.config.Settings`, `python -m worker`),
the Redis keys docs/tenants.md lists (`:held:<lane>:order`, `:tenants:counts`, `:tenants:running`, `:held:readers`)
and docs/protocol.md's result streams, and in-process workers on the scripted engine (the `start_worker` fixture):
`engine.submitted` is the order in which a worker started requests, and the engine's running plus waiting requests
are what occupies its slots.

A test that checks that something does *not* happen (a flood's request in a kept slot) gives the worker a short
while (`SETTLE_S`) to do it first; nothing here asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Cancelled
from client.admin import Admin
from client.protocol import ENTRY_FIELD, DoneEvent, ErrorEvent, GenerateRequest, decode_event, encode, ms_now
from client.tenants import TenantLimits, Tenants
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until
from tests.worker.tenant_support import LANE_NAMES, READERS, REPO, RESULT_TIMEOUT_S, TAG, check, stop, submit, text
from worker.config import Settings

COUNTS = f"{TAG}:tenants:counts"
RUNNING = f"{TAG}:tenants:running"
SETTLE_S = 0.3  # a chance for a worker to do what it must not (several read blocks of 50 ms)
LONG = 120  # tokens of a request that holds its slot for a while (1.2 s at a step of 10 ms)
QUICK = {"lease_timeout_s": 1.0, "lease_renew_s": 0.2, "claim_interval_s": 0.2}


# --- helpers ---------------------------------------------------------------------------------------------------------


def lane_stream(lane: str) -> str:
    """docs/client.md: `{llmq:<queue>}:requests` for `default`, `...:requests:<lane>` for the others."""
    return f"{TAG}:requests" if lane == "default" else f"{TAG}:requests:{lane}"


async def held_of(redis: Redis, tenant: str, lane: str = "default") -> int:
    """The tenant's requests held in the lane: `:held:<lane>:order` has `"<tenant>\\0<padded id>\\0<id>"` each."""
    members = await redis.zrangebylex(f"{TAG}:held:{lane}:order", b"[" + tenant.encode() + b"\0", b"+")
    return sum(1 for member in members if member.startswith(tenant.encode() + b"\0"))


async def finals(redis: Redis, request_id: str) -> int:
    """Final events (`done` or `error`) in the request's result stream: exactly one for an answered request."""
    entries = await redis.xrange(f"{TAG}:result:{request_id}")
    return sum(isinstance(decode_event(fields[ENTRY_FIELD]), DoneEvent | ErrorEvent) for _, fields in entries)


async def running_counts(redis: Redis) -> dict[str, int]:
    """`:tenants:counts`' `<tenant>|running` fields that are not 0."""
    counts = await redis.hgetall(COUNTS)
    return {
        field.decode(): int(value) for field, value in counts.items() if field.endswith(b"|running") and int(value) != 0
    }


async def assert_nothing_leaked(redis: Redis) -> None:
    """Everything answered: nothing held, nothing pending, no running count or running entry left."""
    for lane in LANE_NAMES:
        assert await redis.xlen(f"{TAG}:held:{lane}") == 0, lane
        with contextlib.suppress(Exception):  # a lane no one created
            assert (await redis.xpending(lane_stream(lane), "workers"))["pending"] == 0, lane
    assert await running_counts(redis) == {}
    assert await redis.zcard(RUNNING) == 0, await redis.zrange(RUNNING, 0, -1)


def occupancy(engine: Any) -> int:
    """Requests the worker gave its engine and that have not ended: what fills its slots."""
    stats = engine.stats()
    return int(stats.running + stats.waiting)


class Peak:
    """Samples `measure` about every millisecond in the background; `most` is the highest value seen."""

    def __init__(self, measure: Callable[[], int]) -> None:
        self.measure = measure
        self.most = 0
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.most = max(self.most, self.measure())
            self.samples += 1
            await asyncio.sleep(0.001)

    def __enter__(self) -> Peak:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def kill(running: Any) -> None:
    """Cancels a worker's task until it is gone, as a crash would: nothing handed back, its leases lapse."""
    while not running.task.done():
        running.task.cancel()
        await asyncio.wait([running.task], timeout=1)


async def readers(redis: Redis) -> None:
    await wait_until(lambda: redis.exists(READERS), 10)


async def prime_quietly(start_worker: Callable[..., Any], redis: Redis) -> None:
    """A worker reads the queue once and stops (clients now hold every request and nothing moves them)."""
    primer = await start_worker(worker_id="primer")
    await readers(redis)
    await stop(primer)


def ids(jobs: Sequence[tuple[AsyncJob, str, int]]) -> list[str]:
    return [job.id for job, _, _ in jobs]


async def set_tenant(redis_url: str, tenant: str, weight: float | None = None, **limits: int) -> None:
    def write() -> None:
        admin = Admin(redis_url)
        try:
            tenants = Tenants(admin, "default")
            if weight is not None:
                tenants.set_weight(tenant, weight)
            if limits:
                tenants.set_limits(tenant, TenantLimits(**limits))
        finally:
            admin.close()

    await asyncio.to_thread(write)


async def span_ms(redis: Redis, request_id: str) -> tuple[int, int]:
    """The first and the final event's times by Redis's clock (the entry ids): inside the request's running time."""
    entries = await redis.xrange(f"{TAG}:result:{request_id}")
    assert entries, request_id
    return int(entries[0][0].split(b"-")[0]), int(entries[-1][0].split(b"-")[0])


def most_at_once(spans: list[tuple[int, int]]) -> int:
    """The most spans open at one instant (one ending in the millisecond another starts does not overlap it)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


async def flood_with_long_heads(
    client: AsyncClient, heads: int, tail: int, tenant: str = "flood", lane: str = "default"
) -> tuple[list[tuple[AsyncJob, str, int]], list[tuple[AsyncJob, str, int]]]:
    """`heads` long requests, then `tail` short ones behind them (a tenant's requests run in its order): the long
    ones hold the open slots while the short ones wait."""
    longs = [await submit(client, tenant, i, tokens=LONG, priority=lane) for i in range(heads)]
    shorts = [await submit(client, tenant, 1000 + i, tokens=2, priority=lane) for i in range(tail)]
    return longs, shorts


# --- 1. a flood never takes a kept slot -----------------------------------------------------------------------------


@pytest.mark.parametrize(("lane", "keep"), [("default", 1), ("batch", 1), ("default", 0)])
async def test_a_flood_of_thousands_runs_on_the_open_slots_only(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, lane: str, keep: int
) -> None:
    """2,000 requests of one tenant held on the lane, then a worker of 4 slots, `keep` kept: over 60 quick requests
    started and ended, the engine never holds more than 4 - keep at once, and does hold that many (the open slots are
    used). With a slot kept, a quiet tenant's request then starts and is answered while the flood still waits
    almost whole. With none kept (docs/workers.md: `0` is off), the flood fills every slot, as before."""
    await prime_quietly(start_worker, redis)
    for i in range(125):  # 16 choices a call, each a request of its own in the queue (docs/client.md)
        await client.submit(prompt=text("flood", i), max_new_tokens=2, n=16, seed=i, tenant="flood", priority=lane)
    assert await held_of(redis, "flood", lane) == 2000
    worker = await start_worker(worker_id="thousands", max_running=4, idle_tenant_slots=keep, step_s=0.002)
    engine = worker.worker.engine
    with Peak(lambda: occupancy(engine)) as peak:
        await wait_until(lambda: len(engine.submitted) >= 60, 30)
    assert peak.samples > 50
    assert peak.most == 4 - keep, (peak.most, keep)
    quiet = await submit(client, "quiet", 0, tokens=2, priority=lane)
    await check(*quiet)
    assert engine.submitted.count(quiet[0].id) == 1
    assert await held_of(redis, "flood", lane) > 1000  # the quiet tenant did not wait for the flood


# --- 2. a tenant with nothing running starts at once ----------------------------------------------------------------


@pytest.mark.parametrize("lane", ["default", "batch"])
async def test_a_quiet_tenant_starts_before_the_floods_next_request_every_time_it_is_quiet(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, lane: str
) -> None:
    """A worker of 4 slots, 1 kept; the flood's 3 long requests fill the open slots and 20 more of its wait. The kept
    slot stays empty. Three times in a row, a quiet tenant (nothing running again each time its last request ended)
    submits one request: each is the next request the worker starts, and is answered while the flood's long ones
    still run (none ended to make room, none was preempted: every request started exactly once)."""
    worker = await start_worker(worker_id="next", max_running=4, idle_tenant_slots=1, step_s=0.01)
    await readers(redis)
    engine = worker.worker.engine
    longs, shorts = await flood_with_long_heads(client, 3, 20, lane=lane)
    await wait_until(lambda: len(engine.submitted) == 3, 10)
    await asyncio.sleep(SETTLE_S)
    assert engine.submitted == ids(longs)
    assert engine.free_slots() == 1
    assert await held_of(redis, "flood", lane) == 20
    quiet = []
    for k in range(3):
        job = await submit(client, "quiet", k, tokens=3, priority=lane)
        await check(*job)
        quiet.append(job)
        assert engine.submitted[3 + k] == job[0].id, engine.submitted
    assert [await finals(redis, i) for i in ids(longs)] == [0, 0, 0]  # the flood's long requests still run
    assert await held_of(redis, "flood", lane) == 20
    await asyncio.gather(*[check(*job) for job in longs + shorts])
    everything = ids(longs + shorts + quiet)
    assert sorted(engine.submitted) == sorted(everything)  # each started once: nothing preempted, nothing lost
    assert [await finals(redis, i) for i in everything] == [1] * len(everything)
    await assert_nothing_leaked(redis)


# --- 3. a tenant with one running does not get a kept slot for its next ----------------------------------------------


@pytest.mark.parametrize("first_lane", ["default", "interactive"])
async def test_a_tenant_with_a_request_running_never_gets_a_kept_slot_for_its_next(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, first_lane: str
) -> None:
    """A worker of 4 slots, 2 kept; the flood's 2 long requests fill the open ones. `busy` submits a long request on
    `first_lane` (it starts: a kept slot, or any slot for `interactive`), then a second on `default`: with one
    running ("in the queue partition, any lane") it must wait, though a kept slot is free. A third tenant, `calm`,
    with nothing running, then takes that slot at once, before busy's second."""
    worker = await start_worker(worker_id="second", max_running=4, idle_tenant_slots=2, step_s=0.01)
    await readers(redis)
    engine = worker.worker.engine
    longs, shorts = await flood_with_long_heads(client, 2, 6)
    await wait_until(lambda: len(engine.submitted) == 2, 10)
    await asyncio.sleep(SETTLE_S)
    assert engine.free_slots() == 2  # both kept slots empty beside a waiting flood
    first = await submit(client, "busy", 0, tokens=LONG, priority=first_lane)
    await wait_until(lambda: len(engine.submitted) == 3, 10)
    assert engine.submitted[2] == first[0].id
    second = await submit(client, "busy", 1, tokens=2)
    await asyncio.sleep(SETTLE_S)
    assert second[0].id not in engine.submitted, engine.submitted
    assert engine.free_slots() == 1
    assert await held_of(redis, "busy") == 1
    calm = await submit(client, "calm", 0, tokens=3)
    await check(*calm)
    assert engine.submitted[3] == calm[0].id, engine.submitted
    assert second[0].id not in engine.submitted  # still waiting for an open slot
    assert [await finals(redis, i) for i in ids(longs)] == [0, 0]
    await asyncio.gather(*[check(*job) for job in [*longs, *shorts, first, second]])
    assert engine.submitted.index(second[0].id) > 3
    everything = ids([*longs, *shorts, first, second, calm])
    assert sorted(engine.submitted) == sorted(everything)
    await assert_nothing_leaked(redis)


async def test_a_quiet_tenants_burst_gets_one_kept_slot_not_all_of_them(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """A worker of 5 slots, 3 kept; the flood's 2 long requests fill the open ones. `burst`, with nothing running,
    submits 3 requests at once (one call of 3 choices): the first takes a kept slot, the others ("its next ones,
    while it has one running, wait their turn") do not, so two kept slots stay free for others: `a` and `b` each
    start at once beside it."""
    worker = await start_worker(worker_id="burst", max_running=5, idle_tenant_slots=3, step_s=0.01)
    await readers(redis)
    engine = worker.worker.engine
    longs, shorts = await flood_with_long_heads(client, 2, 4)
    await wait_until(lambda: len(engine.submitted) == 2, 10)
    prompt = text("burst", 0)
    choices = await client.submit(prompt=prompt, max_new_tokens=100, n=3, seed=3, tenant="burst")
    await wait_until(lambda: len(engine.submitted) == 3, 10)
    await asyncio.sleep(SETTLE_S)
    assert len(engine.submitted) == 3, engine.submitted
    assert engine.free_slots() == 2
    assert await held_of(redis, "burst") == 2
    others = [await submit(client, tenant, 0, tokens=3) for tenant in ("a", "b")]
    await asyncio.gather(*[check(*job) for job in others])
    assert set(engine.submitted[3:5]) == set(ids(others)), engine.submitted
    assert [await finals(redis, i) for i in ids(longs)] == [0, 0]
    result = await choices.result(timeout=RESULT_TIMEOUT_S)
    assert [one.token_ids for one in result.choices] == [expected_tokens(list(prompt.encode()), 100)] * 3
    await asyncio.gather(*[check(*job) for job in longs + shorts])
    assert len(engine.submitted) == len(set(engine.submitted)) == 2 + 4 + 3 + 2
    await assert_nothing_leaked(redis)


# --- 4. the interactive lane takes any free slot --------------------------------------------------------------------


async def test_the_interactive_lane_of_a_busy_tenant_takes_a_kept_slot_without_preempting(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """A worker of 4 slots, 1 kept; the flood fills the 3 open ones with long requests and holds more. The flood's
    own `interactive` request takes the kept slot at once ("the `interactive` lane takes any free slot"): it is the
    next started and answered while every long request still runs; none was preempted (each started once)."""
    worker = await start_worker(worker_id="urgent", max_running=4, idle_tenant_slots=1, step_s=0.01)
    await readers(redis)
    engine = worker.worker.engine
    longs, shorts = await flood_with_long_heads(client, 3, 10)
    await wait_until(lambda: len(engine.submitted) == 3, 10)
    await asyncio.sleep(SETTLE_S)
    assert engine.free_slots() == 1
    urgent = await submit(client, "flood", 500, tokens=3, priority="interactive")
    await check(*urgent)
    assert engine.submitted[3] == urgent[0].id, engine.submitted
    assert [await finals(redis, i) for i in ids(longs)] == [0, 0, 0]
    assert await held_of(redis, "flood") == 10
    await asyncio.gather(*[check(*job) for job in longs + shorts])
    assert len(engine.submitted) == len(set(engine.submitted)) == 3 + 10 + 1
    await assert_nothing_leaked(redis)


# --- 5. every worker of a fleet keeps its slots ---------------------------------------------------------------------


async def test_every_worker_of_a_fleet_keeps_its_slot(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Two workers of 3 slots, 1 kept each; the flood's 4 long requests fill the 2 open slots of each, 20 more wait.
    Each worker leaves its kept slot empty. Two quiet tenants then submit at once: each worker starts one of them
    (a worker moves at most its one kept slot's worth), both answered while the long requests still run."""
    workers = [
        await start_worker(worker_id=f"fleet-{i}", max_running=3, idle_tenant_slots=1, step_s=0.01) for i in range(2)
    ]
    await readers(redis)
    engines = [w.worker.engine for w in workers]
    longs, shorts = await flood_with_long_heads(client, 4, 20)
    names = {job.id: f"long{i}" for i, (job, _, _) in enumerate(longs)}
    names |= {job.id: f"short{i}" for i, (job, _, _) in enumerate(shorts)}

    def started() -> list[list[str]]:
        return [[names.get(i, i) for i in e.submitted] for e in engines]

    await wait_until(lambda: sum(len(e.submitted) for e in engines) >= 4, 10)
    await asyncio.sleep(SETTLE_S)
    assert [len(e.submitted) for e in engines] == [2, 2], started()
    assert [e.free_slots() for e in engines] == [1, 1]
    quiet = list(await asyncio.gather(*[submit(client, tenant, 0, tokens=3) for tenant in ("q1", "q2")]))
    await asyncio.gather(*[check(*job) for job in quiet])
    third = [e.submitted[2] for e in engines if len(e.submitted) > 2]
    assert sorted(third) == sorted(ids(quiet)), [e.submitted for e in engines]
    assert [await finals(redis, i) for i in ids(longs)] == [0, 0, 0, 0]
    await asyncio.gather(*[check(*job) for job in longs + shorts])
    started = Counter(i for e in engines for i in e.submitted)
    assert set(started.values()) == {1}
    assert set(started) == set(ids(longs + shorts + quiet))
    await assert_nothing_leaked(redis)


# --- 6. off: every slot open ----------------------------------------------------------------------------------------


async def test_with_no_slot_kept_the_flood_fills_every_slot_and_a_quiet_tenant_waits_for_one(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """The setting left at its default (0, off): the flood's long requests take all 4 slots, and a quiet tenant's
    request starts only after one of them ends (tenants do not preempt each other)."""
    worker = await start_worker(worker_id="off", max_running=4, step_s=0.01)
    assert worker.worker.settings.idle_tenant_slots == 0
    await readers(redis)
    engine = worker.worker.engine
    longs, shorts = await flood_with_long_heads(client, 4, 4)
    await wait_until(lambda: len(engine.submitted) == 4, 10)
    assert engine.free_slots() == 0
    quiet = await submit(client, "quiet", 0, tokens=3)
    await check(*quiet)
    assert sum([await finals(redis, i) for i in ids(longs)]) >= 1  # it waited for a slot to free
    assert engine.submitted.index(quiet[0].id) >= 4
    await asyncio.gather(*[check(*job) for job in longs + shorts])
    assert len(engine.submitted) == len(set(engine.submitted)) == 9


# --- 7. the setting ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_running", "keep"), [(4, 4), (4, 5), (1, 1), (32, 32)])
def test_kept_slots_at_or_above_max_running_are_a_settings_error(max_running: int, keep: int) -> None:
    with pytest.raises(ValidationError, match="idle_tenant_slots"):
        Settings(_env_file=None, max_running=max_running, idle_tenant_slots=keep)  # type: ignore[call-arg]


def test_the_setting_defaults_to_off_reads_its_variable_and_refuses_a_negative(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LLMQ_IDLE_TENANT_SLOTS", raising=False)
    monkeypatch.delenv("LLMQ_MAX_RUNNING", raising=False)
    assert Settings(_env_file=None).idle_tenant_slots == 0  # type: ignore[call-arg]
    assert Settings(_env_file=None, max_running=4, idle_tenant_slots=3).idle_tenant_slots == 3  # type: ignore[call-arg]
    monkeypatch.setenv("LLMQ_IDLE_TENANT_SLOTS", "31")
    assert Settings(_env_file=None).idle_tenant_slots == 31  # type: ignore[call-arg]  # below the default 32
    monkeypatch.setenv("LLMQ_IDLE_TENANT_SLOTS", "32")
    with pytest.raises(ValidationError, match="idle_tenant_slots"):
        Settings(_env_file=None)  # type: ignore[call-arg]
    monkeypatch.setenv("LLMQ_MAX_RUNNING", "33")
    assert Settings(_env_file=None).idle_tenant_slots == 32  # type: ignore[call-arg]
    monkeypatch.delenv("LLMQ_IDLE_TENANT_SLOTS")
    with pytest.raises(ValidationError):
        Settings(_env_file=None, idle_tenant_slots=-1)  # type: ignore[call-arg]


@pytest.mark.parametrize("how", ["flags", "environment"])
async def test_the_worker_command_refuses_kept_slots_at_max_running(how: str) -> None:
    """docs/workers.md: "Below `LLMQ_MAX_RUNNING`"; the worker's exit status 2 is "for a bad flag or setting"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    args = ["--redis-url", "redis://127.0.0.1:1/0", "--metrics-port", "0"]
    if how == "flags":
        args += ["--max-running", "4", "--idle-tenant-slots", "4"]
    else:
        env |= {"LLMQ_MAX_RUNNING": "4", "LLMQ_IDLE_TENANT_SLOTS": "6"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker",
        *args,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
            await process.wait()
    assert process.returncode == 2, (out, err)
    assert b"idle_tenant_slots" in err or b"idle-tenant-slots" in err, err
    assert b"Traceback" not in err, err


# --- 8. fair share and quotas still hold ----------------------------------------------------------------------------


async def test_weights_still_share_tokens_with_a_slot_kept(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """Weights 3:1, each tenant 120 requests of the same cost held, one worker of 8 slots with 1 kept: over the
    first 120 completions (both always waiting) heavy's share of the tokens is still about 3/4. A move for a kept
    slot counts against its tenant's virtual time like any other, so the kept slot does not hand light more than
    its weight. The tolerance (0.08) is fair share's own black-box test's: it tells 3/4 from 1/2."""
    await set_tenant(redis_url, "heavy", weight=3)
    await prime_quietly(start_worker, redis)
    each, tokens = 120, 8
    jobs = []
    for tenant in ("heavy", "light"):
        jobs += [(tenant, *await submit(client, tenant, i, tokens)) for i in range(each)]
    order: list[tuple[str, Any]] = []

    async def follow(tenant: str, job: AsyncJob, prompt: str, n: int) -> None:
        order.append((tenant, await check(job, prompt, n)))

    waits = [asyncio.create_task(follow(*job)) for job in jobs]
    await start_worker(worker_id="weights", max_running=8, idle_tenant_slots=1, step_s=0.005)
    await asyncio.gather(*waits)
    window = Counter[str]()
    for tenant, result in order[:each]:
        window[tenant] += result.usage.prompt_tokens + result.usage.completion_tokens
    share = window["heavy"] / sum(window.values())
    assert abs(share - 0.75) <= 0.08, (share, window, [t for t, _ in order[:each]])
    await assert_nothing_leaked(redis)


async def test_max_running_quota_holds_with_kept_slots_on(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, redis_url: str
) -> None:
    """docs/tenants.md ("Quotas"): at its running quota a tenant's next request waits. `capped` (max running 2)
    and `flood` share two workers of 4 slots, 1 kept each: capped never has more than 2 running at once (though
    it has nothing running at first, and kept slots wait for such tenants), the flood never more than 3 per
    worker (it always has something running); everything is answered and no running count is left."""
    await set_tenant(redis_url, "capped", max_running=2)
    workers = [
        await start_worker(worker_id=f"capq-{i}", max_running=4, idle_tenant_slots=1, step_s=0.01) for i in range(2)
    ]
    await readers(redis)
    flood = [await submit(client, "flood", i, tokens=15) for i in range(16)]
    capped = [await submit(client, "capped", i, tokens=15) for i in range(8)]
    await asyncio.gather(*[check(*job) for job in flood + capped])
    capped_spans = [await span_ms(redis, i) for i in ids(capped)]
    assert most_at_once(capped_spans) <= 2, capped_spans
    assert most_at_once(capped_spans) == 2, capped_spans  # it did use its two
    for running in workers:
        mine = set(running.worker.engine.submitted)
        spans = [await span_ms(redis, i) for i in ids(flood) if i in mine]
        assert most_at_once(spans) <= 3, (running.worker.settings.worker_id, spans)
    started = Counter(i for w in workers for i in w.worker.engine.submitted)
    assert set(started.values()) == {1} and set(started) == set(ids(flood + capped))
    await assert_nothing_leaked(redis)


# --- 9. a worker lost mid-run loses nothing -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["killed", "stopped"])
async def test_a_worker_lost_mid_run_loses_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, how: str
) -> None:
    """Two workers of 4 slots, 1 kept each; a flood of 24 and quiet tenants arriving one by one, some on the kept
    slots. One worker is killed (its task cancelled: nothing handed back) or stopped (SIGTERM twice: hands back)
    while it runs both the flood's requests and a quiet tenant's. Every request is answered whole, with exactly one
    final event; nothing is left held or pending, and no tenant's running count is left behind."""
    victim = await start_worker(worker_id="victim", max_running=4, idle_tenant_slots=1, step_s=0.01, **QUICK)
    await readers(redis)
    flood = [await submit(client, "flood", i, tokens=20) for i in range(24)]
    await wait_until(lambda: len(victim.worker.engine.submitted) >= 3, 10)
    quiet = [await submit(client, "quiet0", 0, tokens=60)]  # the victim's kept slot: nobody else reads yet
    await wait_until(lambda: quiet[0][0].id in victim.worker.engine.submitted, 10)
    survivor = await start_worker(worker_id="survivor", max_running=4, idle_tenant_slots=1, step_s=0.01, **QUICK)
    for k in range(1, 4):
        quiet.append(await submit(client, f"quiet{k}", 0, tokens=10))
    if how == "killed":
        await kill(victim)
    else:
        await stop(victim)
    for k in range(4, 8):
        quiet.append(await submit(client, f"quiet{k}", 0, tokens=10))
    everything = flood + quiet
    await asyncio.gather(*[check(*job) for job in everything])
    assert not survivor.task.done()
    assert [await finals(redis, i) for i in ids(everything)] == [1] * len(everything)
    survivors = Counter(survivor.worker.engine.submitted)
    assert set(survivors.values()) <= {1}  # nothing started twice on the survivor
    assert set(survivors) | set(victim.worker.engine.submitted) == set(ids(everything))
    await assert_nothing_leaked(redis)
    assert await redis.xlen(f"{TAG}:dead") == 0


async def test_a_dead_workers_flood_claimed_by_another_stays_off_its_kept_slot(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """docs/tenants.md: a tenant with requests running "never" fills the kept slots: "a flood runs on
    `LLMQ_MAX_RUNNING - LLMQ_IDLE_TENANT_SLOTS` slots per worker". The victim runs 3 of the flood's requests and is
    killed; the survivor runs 3 long ones of the flood's own on its open slots all the while its leases lapse
    (about 1 s) and it takes the victim's over. It never runs more than 3 at once: the claimed requests are the
    flood's too, and its kept slot is for a tenant with nothing running."""
    victim = await start_worker(worker_id="victim", max_running=4, idle_tenant_slots=1, step_s=0.01, **QUICK)
    await readers(redis)
    flood = [await submit(client, "flood", i, tokens=60) for i in range(3)]
    await wait_until(lambda: len(victim.worker.engine.submitted) == 3, 10)
    survivor = await start_worker(worker_id="survivor", max_running=4, idle_tenant_slots=1, step_s=0.01, **QUICK)
    flood += [await submit(client, "flood", i, tokens=200) for i in range(3, 6)]  # 2 s: past the lease
    engine = survivor.worker.engine
    await wait_until(lambda: len(engine.submitted) == 3, 10)
    with Peak(lambda: occupancy(engine)) as peak:
        await kill(victim)
        await asyncio.gather(*[check(*job) for job in flood])
    assert sorted(engine.submitted) == sorted(ids(flood)), engine.submitted  # it did take the victim's over
    assert peak.most <= 3, peak.most
    await assert_nothing_leaked(redis)


# --- 10. many quiet tenants at once ---------------------------------------------------------------------------------


async def test_many_quiet_tenants_at_once_are_all_served_and_none_lost(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Two workers of 4 slots, 1 kept each, under a flood of 150 short requests; 16 quiet tenants (8 times the kept
    slots) submit together, one request each, plus one more with 4 choices. Each is answered whole and exactly
    once; the kept slots start two at once and fair share serves the rest before the flood's backlog (each new
    tenant starts at the lane's clock): while they are served, the flood moves fewer requests than they are
    (docs/tenants.md: "about one request of the flood per request of its own"). The flood drains while it is
    submitted, by as much as the machine is loaded, so what it moves is counted from the quiet ones' submission."""
    workers = [
        await start_worker(worker_id=f"many-{i}", max_running=4, idle_tenant_slots=1, step_s=0.005) for i in range(2)
    ]
    await readers(redis)
    flood = [await submit(client, "flood", i, tokens=12) for i in range(150)]
    await wait_until(lambda: sum(len(w.worker.engine.submitted) for w in workers) >= 6, 10)
    quiet = list(await asyncio.gather(*[submit(client, f"quiet-{k:02d}", 0, tokens=4) for k in range(16)]))
    prompt = text("chorus", 0)
    chorus = await client.submit(prompt=prompt, max_new_tokens=4, n=4, seed=1, tenant="chorus")
    flood_held = await held_of(redis, "flood")
    await asyncio.gather(*[check(*job) for job in quiet])
    result = await chorus.result(timeout=RESULT_TIMEOUT_S)
    assert [one.token_ids for one in result.choices] == [expected_tokens(list(prompt.encode()), 4)] * 4
    moved_meanwhile = flood_held - await held_of(redis, "flood")
    assert moved_meanwhile <= len(quiet), (flood_held, moved_meanwhile)
    await asyncio.gather(*[check(*job) for job in flood])
    chorus_ids = [f"{chorus.id}-{i}" for i in range(4)]
    everything = [*ids(flood + quiet), *chorus_ids]
    started = Counter(i for w in workers for i in w.worker.engine.submitted)
    assert set(started.values()) == {1} and set(started) == set(everything)
    assert [await finals(redis, i) for i in everything] == [1] * len(everything)
    await assert_nothing_leaked(redis)


# --- 11. requests on a lane's stream -------------------------------------------------------------------------------


async def write_to_the_stream(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, source: str, count: int, tokens: int
) -> tuple[Any, list[tuple[str, str]]]:
    """`count` requests on the default lane's stream itself, not held, then a worker of 2 slots with 1 kept reading
    them: written as the last release's client wrote them (`old client`: docs/protocol.md, one field `m`, no
    tenant), or submitted by this release's client before any worker read the queue (`no reader yet`:
    docs/tenants.md, "Clients hold requests only while a worker of this release has read the queue lately").
    Returns the worker and each request's (id, prompt)."""
    written = [(f"stream-{i}", text("stream", i)) for i in range(count)]
    if source == "old client":
        worker = await start_worker(worker_id="stream", max_running=2, idle_tenant_slots=1, step_s=0.01)
        await readers(redis)
        for request_id, prompt in written:
            body = GenerateRequest(id=request_id, submitted=ms_now(), prompt=prompt, params={"max_new_tokens": tokens})
            await redis.xadd(lane_stream("default"), {ENTRY_FIELD: encode(body)})
    else:
        for request_id, prompt in written:
            await client.submit(prompt=prompt, max_new_tokens=tokens, tenant="early", request_id=request_id)
        assert await redis.xlen(lane_stream("default")) == count  # not held: no worker read yet
        worker = await start_worker(worker_id="stream", max_running=2, idle_tenant_slots=1, step_s=0.01)
    return worker, written


async def answered(client: AsyncClient, written: list[tuple[str, str]], tokens: int) -> None:
    for request_id, prompt in written:
        result = await AsyncJob.attach(client, request_id).result(timeout=RESULT_TIMEOUT_S)
        assert result.token_ids == expected_tokens(list(prompt.encode()), tokens), request_id


@pytest.mark.parametrize("source", ["old client", "no reader yet"])
async def test_requests_on_the_lane_stream_alone_take_only_the_open_slots(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, source: str
) -> None:
    """docs/tenants.md: "requests on a lane's stream that carry no tenant (from clients of the last release) take
    only open slots". Four such requests on a worker of 2 slots, 1 kept: they run one at a time, all answered."""
    worker, written = await write_to_the_stream(start_worker, client, redis, source, 4, tokens=10)
    with Peak(lambda: occupancy(worker.worker.engine)) as peak:
        await answered(client, written, 10)
    assert peak.most == 1, peak.most
    spans = [await span_ms(redis, request_id) for request_id, _ in written]
    assert most_at_once(spans) == 1, spans
    assert worker.worker.engine.submitted == [request_id for request_id, _ in written]


@pytest.mark.parametrize("source", ["old client", "no reader yet"])
async def test_a_quiet_tenant_takes_the_kept_slot_once_the_lane_stream_is_read(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, source: str
) -> None:
    """docs/tenants.md: requests on a lane's stream (no tenant, or written while no worker read) "take only open
    slots", and while any waits unread a kept slot waits for them to be read. Four requests on the stream, 40
    tokens each, run one at a time on a worker of 2 slots, 1 kept; a tenant's request, held once a worker read,
    starts right after the last of them, not before (it would go behind them on the stream); the four never
    overlap."""
    worker, written = await write_to_the_stream(start_worker, client, redis, source, 4, tokens=40)
    engine = worker.worker.engine
    await wait_until(lambda: len(engine.submitted) == 1, 10)
    before = len(engine.submitted)
    quiet = await submit(client, "quiet", 0, tokens=3)
    await check(*quiet)
    await answered(client, written, 40)
    spans = [await span_ms(redis, request_id) for request_id, _ in written]
    assert before >= 1 and engine.submitted == [request_id for request_id, _ in written] + [quiet[0].id]
    assert most_at_once(spans) == 1, spans


# --- 12. a cancelled flood frees nothing it should not --------------------------------------------------------------


async def test_a_tenant_whose_last_request_was_cancelled_is_quiet_again(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """`busy` runs one long request on a kept slot; it is cancelled. Its running count goes with it (the final
    event frees it), so busy has nothing running again and its next request takes the kept slot at once, while the
    flood's long requests still hold the open ones."""
    worker = await start_worker(worker_id="cancel", max_running=3, idle_tenant_slots=1, step_s=0.01)
    await readers(redis)
    engine = worker.worker.engine
    longs, shorts = await flood_with_long_heads(client, 2, 4)
    await wait_until(lambda: len(engine.submitted) == 2, 10)
    first = await submit(client, "busy", 0, tokens=LONG)
    await wait_until(lambda: len(engine.submitted) == 3, 10)
    assert engine.submitted[2] == first[0].id
    await first[0].cancel()
    with pytest.raises(Cancelled):
        await first[0].result(timeout=RESULT_TIMEOUT_S)
    await wait_until(lambda: _no_running(redis, "busy"), 10)
    again = await submit(client, "busy", 1, tokens=3)
    await check(*again)
    assert engine.submitted[3] == again[0].id, engine.submitted
    assert [await finals(redis, i) for i in ids(longs)] == [0, 0]
    await asyncio.gather(*[check(*job) for job in longs + shorts])
    await assert_nothing_leaked(redis)


async def _no_running(redis: Redis, tenant: str) -> bool:
    return f"{tenant}|running" not in await running_counts(redis)
