"""Poison isolation: a request that kills the engine thread is quarantined after `max_engine_failures`; the
innocent requests that shared its steps resume and finish exactly as they would have."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from client import AsyncClient, RequestFailed
from client.store import CONSUMER_GROUP, Keys
from testing import poison
from tests.polling import wait_until
from worker.engine import EngineRequest, GenerationParams
from worker.engine.sampling import FusedSampler

KEYS = Keys("default")
GOOD = 31


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FusedSampler, "__call__", poison.poisoned(FusedSampler.__call__))


async def engine_greedy(worker: Any, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """The engine's own greedy output for a prompt, straight from the engine, bypassing Redis."""
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0)
    stream = worker.engine.submit(EngineRequest(f"direct-{input_ids}", input_ids=input_ids, params=params))
    return [token async for delta in stream for token in delta.token_ids]


def prompts() -> list[list[int]]:
    return [[3 + i % 40, 4 + i % 7, 5, 6 + i % 11] for i in range(GOOD)]


async def run_mixed(workers: list[Any], client: AsyncClient, redis_url: str) -> None:
    expected = [await engine_greedy(workers[0].worker, p, 12) for p in prompts()]
    jobs = [await client.submit(input_ids=p, max_new_tokens=12, temperature=0) for p in prompts()[:16]]
    bad = await client.submit(input_ids=[7, 8, 9], max_new_tokens=12, temperature=1.0, top_p=poison.POISON_TOP_P)
    jobs += [await client.submit(input_ids=p, max_new_tokens=12, temperature=0) for p in prompts()[16:]]

    results = await asyncio.gather(*(job.result(timeout=120) for job in jobs))
    assert [r.token_ids for r in results] == expected  # every innocent, exactly as on an idle engine
    with pytest.raises(RequestFailed) as failure:
        await bad.result(timeout=60)
    assert failure.value.code == "poison_request" and "2 engine failures" in failure.value.message

    restarts = sum(w.worker.engine.stats().restarts for w in workers)
    assert restarts == 2  # the failure it caused among the others, then the one it caused as the only suspect
    assert sum(w.worker.metrics.quarantined._value.get() for w in workers) == 1
    assert sum(w.worker.metrics.claims._value.get() for w in workers) > 2  # innocents were handed back and resumed
    async with Redis.from_url(redis_url) as redis:
        letters = await redis.xrange(KEYS.dead)
        assert len(letters) == 1 and b"quarantined" in letters[0][1][b"m"]

        async def all_acknowledged() -> bool:
            pending = (await redis.xpending(KEYS.requests, CONSUMER_GROUP))["pending"]
            return await redis.xlen(KEYS.requests) == 0 and pending == 0

        await wait_until(all_acknowledged)


@pytest.mark.usefixtures("poisoned")
async def test_poison_among_31_is_quarantined_on_one_worker(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    worker = await start_worker(real_model=True, max_running=32, kv_cache_tokens=4096, claim_interval_s=0.1)
    await run_mixed([worker], client, redis_url)


@pytest.mark.usefixtures("poisoned")
async def test_poison_among_31_is_quarantined_on_two_workers(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    workers = [
        await start_worker(real_model=True, max_running=16, kv_cache_tokens=4096, claim_interval_s=0.1)
        for _ in range(2)
    ]
    await run_mixed(workers, client, redis_url)
