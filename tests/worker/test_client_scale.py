"""One client awaits thousands of jobs over a bounded number of connections: 2,000 concurrent jobs on one
`AsyncClient` and 500 threads on one `Client`, against a real worker on a tiny model (issue: one connection
per awaited job used to exhaust redis-py's pool)."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Client
from worker.engine import EngineRequest, GenerationParams

PROMPTS = [[3 + i, 4 + i % 5, 5, 6 + i % 7] for i in range(16)]
TOKENS = 4


async def references(worker: Any) -> list[list[int]]:
    streams = [
        worker.engine.submit(
            EngineRequest(f"ref-{i}", input_ids=p, params=GenerationParams(max_new_tokens=TOKENS, temperature=0))
        )
        for i, p in enumerate(PROMPTS)
    ]
    return [[token async for delta in stream for token in delta.token_ids] for stream in streams]


class ConnectionCounter:
    """Samples `CLIENT LIST` for connections named `name` while a test runs; keeps the maximum seen."""

    def __init__(self, redis_url: str, name: str) -> None:
        self._redis = Redis.from_url(redis_url)
        self._name = name.encode()
        self.most = 0
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            clients = await self._redis.client_list()
            self.most = max(self.most, sum(1 for c in clients if c.get("name", "").encode() == self._name))
            await asyncio.sleep(0.02)

    async def __aenter__(self) -> ConnectionCounter:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await self._redis.aclose()


async def test_2000_concurrent_jobs_on_one_async_client(
    start_worker: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    running = await start_worker(real_model=True, max_running=64, kv_cache_tokens=4096, max_batch_tokens=256)
    expected = await references(running.worker)
    with caplog.at_level(logging.WARNING):
        async with (
            ConnectionCounter(redis_url, "scale-async") as connections,
            AsyncClient(redis_url, max_queue_len=0, client_name="scale-async") as client,
        ):
            jobs = [
                await client.submit(input_ids=PROMPTS[i % len(PROMPTS)], max_new_tokens=TOKENS, temperature=0)
                for i in range(2000)
            ]
            results = await asyncio.gather(*(job.result(timeout=300) for job in jobs))
    assert [r.token_ids for r in results] == [expected[i % len(PROMPTS)] for i in range(2000)]
    assert 1 <= connections.most <= 4
    assert not [r for r in caplog.records if r.name == "llmq.client" or "connection" in r.getMessage().lower()]


async def test_500_threads_on_one_sync_client(
    start_worker: Any, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    running = await start_worker(real_model=True, max_running=64, kv_cache_tokens=4096, max_batch_tokens=256)
    expected = await references(running.worker)
    threads_seen: set[int] = set()

    def one(index: int) -> list[int]:
        threads_seen.add(threading.get_ident())
        result = client.generate(
            input_ids=PROMPTS[index % len(PROMPTS)], max_new_tokens=TOKENS, temperature=0, timeout=300
        )
        return result.token_ids

    with caplog.at_level(logging.WARNING):
        async with ConnectionCounter(redis_url, "scale-sync") as connections:
            with (
                Client(redis_url, max_queue_len=0, client_name="scale-sync") as client,
                ThreadPoolExecutor(500) as pool,
            ):
                outputs = await asyncio.to_thread(lambda: list(pool.map(one, range(500))))
    assert outputs == [expected[i % len(PROMPTS)] for i in range(500)]
    assert len(threads_seen) > 100 and 1 <= connections.most <= 4
    assert not [r for r in caplog.records if r.name == "llmq.client"]


async def test_the_submitter_is_told_of_writes_and_another_reader_sweeps(start_worker: Any, redis_url: str) -> None:
    """Workers name the result streams they wrote to on the submitting client's wake stream; a client that
    attached to a job it did not submit gets no notices and still reads everything, by its sweep."""
    await start_worker(step_s=0.01)
    async with AsyncClient(redis_url) as submitter, AsyncClient(redis_url) as other:
        jobs = [await submitter.submit(input_ids=[5, 6], max_new_tokens=20) for _ in range(3)]
        attached = [AsyncJob.attach(other, job.id) for job in jobs]
        own, theirs = await asyncio.gather(
            asyncio.gather(*(job.result(timeout=30) for job in jobs)),
            asyncio.gather(*(job.result(timeout=30) for job in attached)),
        )
        notices = await submitter._redis.xrange(submitter.keys.wake(submitter.client_id))
        others = await other._redis.xrange(other.keys.wake(other.client_id))
    assert not [fields for _, fields in others if b"r" in fields]  # only the wakes of its own follows
    assert [r.token_ids for r in theirs] == [r.token_ids for r in own] and all(len(r.token_ids) == 20 for r in own)
    named = {key.decode() for _, fields in notices for key in fields.get(b"r", b"").split()}
    assert named == {submitter.keys.result(job.id) for job in jobs}
