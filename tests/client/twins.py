"""Both twins behind one awaitable surface, and helpers for tests that play the worker.

`Twin` drives `AsyncClient` directly and `Client` through `asyncio.to_thread`, so a case is written
once (as a coroutine) and the blocking client really blocks in a thread while the test writes events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from client import AsyncClient, AsyncJob, Client, Delta, Job, protocol, store
from client._core import Result
from client.store import QueueStatus


class JobTwin:
    def __init__(self, twin: Twin, job: AsyncJob | Job) -> None:
        self.twin = twin
        self.job = job

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def finish_reason(self) -> str | None:
        return self.job.finish_reason

    async def result(self, wait_s: float | None = None) -> Result:
        return await self.twin.call(self.job.result, wait_s)

    async def cancel(self) -> None:
        await self.twin.call(self.job.cancel)

    async def collect(self, into: list[Delta] | None = None, wait_s: float | None = None) -> list[Delta]:
        """Every delta of `stream()`, appended to `into` as it arrives (so a test can watch progress)."""
        into = [] if into is None else into
        if isinstance(self.job, AsyncJob):
            async for delta in self.job.stream(wait_s):
                into.append(delta)
        else:
            stream = self.job.stream
            await asyncio.to_thread(lambda: into.extend(d for d in stream(wait_s)))
        return into


class Twin:
    """One client of the given kind ("async" or "sync") with the same awaitable surface."""

    def __init__(self, kind: str, url: str, *, redis_retries: bool = True, **kwargs: Any) -> None:
        self.kind = kind
        self.url = url
        if not redis_retries:  # surface connection errors to our own retry loop
            kwargs["retry"] = (AsyncRetry if kind == "async" else Retry)(NoBackoff(), 0)
        self.client: AsyncClient | Client = (AsyncClient if kind == "async" else Client)(url, **kwargs)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.kind == "async":
            return await fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def submit(self, prompt: str | None = "hello", **kwargs: Any) -> JobTwin:
        return JobTwin(self, await self.call(self.client.submit, prompt, **kwargs))

    async def generate(self, prompt: str, **kwargs: Any) -> Result:
        return await self.call(self.client.generate, prompt, **kwargs)

    async def status(self, **kwargs: Any) -> QueueStatus:
        return await self.call(self.client.status, **kwargs)

    def attach(self, request_id: str, **kwargs: Any) -> JobTwin:
        job_cls = AsyncJob if self.kind == "async" else Job
        return JobTwin(self, job_cls.attach(self.client, request_id, **kwargs))  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.call(self.client.aclose if isinstance(self.client, AsyncClient) else self.client.close)


TwinFactory = Callable[..., Twin]

KEYS = store.Keys("default")


async def emit(
    conn: aioredis.Redis,
    request_id: str,
    *events: protocol.TokensEvent | protocol.DoneEvent | protocol.ErrorEvent,
    keys: store.Keys = KEYS,
) -> None:
    """Write events to a request's result stream, as a worker's publisher does."""
    for event in events:
        await conn.xadd(keys.result(request_id), {protocol.ENTRY_FIELD: protocol.encode(event)})


def tokens(seq: int, ids: list[int], text: str) -> protocol.TokensEvent:
    return protocol.TokensEvent(seq=seq, ids=ids, text=text)


def done(finish_reason: str = "eos", completion_tokens: int = 0) -> protocol.DoneEvent:
    return protocol.DoneEvent(
        finish_reason=finish_reason,  # type: ignore[arg-type]
        usage=protocol.Usage(prompt_tokens=3, completion_tokens=completion_tokens),
        timings=protocol.Timings(queue_ms=1.5, ttft_ms=2.0, total_ms=9.0),
    )
