"""Helpers of the partitions black-box suite: in-process workers on the scripted engine, sized by their settings
(so `max_running` is the engine's too), that can be stopped gracefully or killed; request ids that land in a
chosen partition; and readers of what Redis holds, through the public key names only."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client import AsyncJob
from client.connection import open_async
from client.protocol import decode_event
from client.store import Keys, partition_of
from testing.redis_topologies import RedisClusterSet, RedisNode
from testing.scripted_engine import ScriptedEngine
from tests.worker.conftest import worker_settings
from worker.service import Worker

_ids = itertools.count()


def ids_in(partition: int, partitions: int, count: int = 1, prefix: str = "id") -> list[str]:
    """`count` fresh request ids that live in `partition` of a queue of `partitions`."""
    found: list[str] = []
    while len(found) < count:
        candidate = f"{prefix}-{next(_ids)}"
        if partition_of(candidate, partitions) == partition:
            found.append(candidate)
    return found


def spread_over_three_masters(cluster: RedisClusterSet, prefix: str) -> tuple[str, RedisNode]:
    """A queue name whose 3 partitions live on 3 different masters, and the master of its partition 1."""
    for n in range(1000):
        parts = Keys(f"{prefix}{n}").partitioned(3)
        masters = [cluster.master_for_key(part.requests) for part in parts]
        if len({master.port for master in masters}) == 3:
            return parts[0].queue, masters[1]
    raise LookupError("no queue name spreads over three masters")


@dataclass
class InProcessWorker:
    """A worker on the scripted engine and its task; `kill()` ends it as a crash would (no drain, no hand-back)."""

    worker: Worker
    engine: ScriptedEngine
    task: asyncio.Task[None]
    stop_event: asyncio.Event
    hurry: asyncio.Event
    redis: Any
    killed: bool = field(default=False)

    async def kill(self) -> None:
        self.killed = True
        self.task.cancel()
        with contextlib.suppress(BaseException):
            await self.task
        await self.engine.close()

    async def stop(self) -> None:
        if self.task.done():
            return
        self.stop_event.set()
        self.hurry.set()
        await asyncio.wait_for(self.task, 30)


@contextlib.asynccontextmanager
async def running_worker(
    url: str, queue: str, root: Path, *, step_s: float = 0.002, **overrides: Any
) -> AsyncIterator[InProcessWorker]:
    """One in-process worker of `queue` on any Redis URL (connected as `python -m worker` connects); `overrides`
    are settings (`queue_partitions=4`, `max_running=2`, ...)."""
    settings = worker_settings(url, root / "model", queue=queue, **overrides)
    engine = ScriptedEngine(
        step_s=step_s,
        max_running=settings.max_running,
        kv_cache_tokens=32768,
        page_size=16,
        max_batch_tokens=512,
    )
    redis = open_async(url, socket_timeout=5, socket_connect_timeout=2)
    worker = Worker(settings, engine, redis)
    stop, hurry = asyncio.Event(), asyncio.Event()
    running = InProcessWorker(worker, engine, asyncio.create_task(worker.run(stop, hurry)), stop, hurry, redis)
    try:
        yield running
    finally:
        try:
            await running.stop()
        finally:
            with contextlib.suppress(Exception):
                await engine.close()
            await redis.aclose()


async def follow(job: AsyncJob, timeout: float = 60) -> list[int]:  # noqa: ASYNC109 - passed to stream()
    """The whole output of `job`, asserting each delta starts where the previous one ended."""
    tokens: list[int] = []
    async for delta in job.stream(timeout=timeout):
        assert delta.seq == len(tokens), f"{job.id}: a gap or a duplicate at {delta.seq} after {len(tokens)}"
        tokens += delta.token_ids
    return tokens


async def terminal_counts(url: str, jobs: Iterable[AsyncJob]) -> Counter[str]:
    """How many terminal events (`done`, `error`) each job's raw result stream holds, read where the job reads."""
    raw = open_async(url)
    try:
        counts: Counter[str] = Counter()
        for job in jobs:
            counts[job.id] += 0
            for _, fields in await raw.xrange(job.keys.result(job.id)):
                if decode_event(fields[b"m"]).type != "tokens":
                    counts[job.id] += 1
        return counts
    finally:
        await raw.aclose()


async def stream_lengths(url: str, keys: list[Keys], lane: str = "default") -> list[int]:
    """XLEN of one lane's request stream in each partition (what is queued or running there)."""
    raw = open_async(url)
    try:
        return [await raw.xlen(part.lane(lane)) for part in keys]
    finally:
        await raw.aclose()
