"""Cache affinity through the whole service: the requests of one prompt start run on the worker that holds that
start (keys spread evenly over the live workers) whenever it has a free slot, so a shared prompt is computed once
per fleet; the holders follow joins and departures, a worker that dies holding assignments loses nothing (they are
taken after the wait), and interactive requests are never routed."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis

from client import AsyncClient
from client.store import Keys
from tests.polling import wait_until

pytestmark = pytest.mark.redis

PAGE = 16  # `worker_settings`' page size
KEYS = Keys("default")  # the tests' queue


def system(index: int) -> list[int]:
    """A 64-token system prompt (four pages): the affinity window of a token prompt."""
    return [3 + (index * 7 + i) % 90 for i in range(64)]


def question(index: int) -> list[int]:
    return [3 + (index * 11 + i) % 90 for i in range(6)]


def ran_on(workers: list[Any]) -> dict[str, str]:
    """Request id -> the id of the worker whose (scripted) engine ran it."""
    return {rid: w.worker.settings.worker_id for w in workers for rid in w.worker.engine.submitted}


async def reported(redis_url: str, *workers: Any) -> None:
    """Waits until every worker has reported to cache affinity (it reads at least every read block)."""
    conn = aioredis.Redis.from_url(redis_url)
    try:
        for running in workers:
            await wait_until(lambda r=running: conn.hexists(KEYS.affinity_workers, r.worker.settings.worker_id))
    finally:
        await conn.aclose()


def one_worker_per_start(where: dict[str, str], starts: dict[str, int]) -> dict[int, str]:
    """Start -> the one worker that ran its requests (fails when a start's requests ran on two)."""
    by_start: dict[int, set[str]] = {}
    for request_id, start in starts.items():
        by_start.setdefault(start, set()).add(where[request_id])
    assert all(len(workers) == 1 for workers in by_start.values()), by_start
    return {start: workers.pop() for start, workers in by_start.items()}


async def test_each_prompt_start_runs_on_one_worker_and_the_starts_are_spread_evenly(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    workers = [await start_worker() for _ in range(2)]
    await reported(redis_url, *workers)
    starts: dict[str, int] = {}
    for wave in range(3):  # four system prompts, a question each, submitted together
        jobs = []
        for s in range(4):
            job = await client.submit(input_ids=system(s) + question(wave * 4 + s), max_new_tokens=3)
            starts[job.id] = s
            jobs.append(job)
        for job in jobs:
            await job.result(timeout=30)
    holders = one_worker_per_start(ran_on(workers), starts)
    assert sorted(Counter(holders.values()).values()) == [2, 2]  # four starts over two workers: two each
    moved = sum(w.worker.partitions.all[0].intake.routed["assigned"] for w in workers)
    taken = sum(w.worker.partitions.all[0].intake.routed["taken"] for w in workers)
    assert moved == taken  # what was read by the other worker was given to its owner, which took it


async def test_a_joining_worker_takes_its_share_and_a_leaving_one_gives_it_back(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    first = await start_worker()
    await reported(redis_url, first)
    prompts = [system(s) + question(s) for s in range(12)]
    alone = [await client.submit(input_ids=p, max_new_tokens=2) for p in prompts]
    for job in alone:
        await job.result(timeout=30)
    assert set(ran_on([first]).values()) == {first.worker.settings.worker_id}

    second = await start_worker()  # joins: keys move to it as they are used, until both hold as many
    await reported(redis_url, second)
    jobs = [await client.submit(input_ids=p, max_new_tokens=2) for p in prompts]
    await asyncio.gather(*(job.result(timeout=30) for job in jobs))
    holders = one_worker_per_start(ran_on([first, second]), {job.id: s for s, job in enumerate(jobs)})
    assert Counter(holders.values()) == {first.worker.settings.worker_id: 6, second.worker.settings.worker_id: 6}

    second.stop.set()  # leaves (drains): its keys go back to the first
    await asyncio.wait_for(second.task, 30)
    left = [await client.submit(input_ids=p, max_new_tokens=2) for p in prompts]
    for job in left:
        await job.result(timeout=30)
    assert {ran_on([first])[job.id] for job in left} == {first.worker.settings.worker_id}


async def test_requests_assigned_to_a_worker_that_died_are_taken_after_the_wait(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    """A worker killed right after it reported free slots: entries are assigned to it until its report ages out,
    and each is taken by a live worker once the wait has passed. Nothing is lost."""
    worker = await start_worker(affinity_wait_ms=100)
    await reported(redis_url, worker)
    conn = aioredis.Redis.from_url(redis_url)
    seconds, micros = await conn.time()
    await conn.hset(KEYS.affinity_workers, "ghost", f"8 {seconds * 1000 + micros // 1000}")
    await conn.aclose()
    jobs = [await client.submit(input_ids=system(s) + question(s), max_new_tokens=2) for s in range(8)]
    results = [await job.result(timeout=30) for job in jobs]
    assert all(r.finish_reason == "length" for r in results)
    routed = worker.worker.partitions.all[0].intake.routed
    assert routed["assigned"] == routed["stolen"] == 4  # eight keys over two workers: the dead one held four


async def test_interactive_requests_are_taken_by_whoever_reads_them(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    workers = [await start_worker() for _ in range(2)]
    await reported(redis_url, *workers)
    jobs = [
        await client.submit(input_ids=system(s) + question(s), max_new_tokens=2, priority="interactive")
        for s in range(8)
    ]
    for job in jobs:
        await job.result(timeout=30)
    assert sum(w.worker.partitions.all[0].intake.routed["assigned"] for w in workers) == 0


async def test_a_shared_prompt_is_computed_once_per_fleet(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    """Two real workers, two system prompts, three questions each, one at a time: each system prompt's pages are
    computed by one worker, once; every later question computes only its own tokens."""
    workers = [await start_worker(real_model=True) for _ in range(2)]
    await reported(redis_url, *workers)
    for q in range(3):
        for s in range(2):
            await (await client.submit(input_ids=system(s) + question(q * 2 + s), max_new_tokens=2)).result(timeout=60)
    stats = [w.worker.engine.stats() for w in workers]
    prompt = 64 + 6
    assert sum(s.prefill_tokens for s in stats) == 2 * prompt + 4 * 6
    assert sum(s.prefix_cache_hits or 0 for s in stats) == 4 * 64
