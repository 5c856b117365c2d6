"""What the black-box suites of tenants (`test_fair_share_blackbox.py`, `test_quotas_blackbox.py`) share: the
documented key names, starting and stopping in-process workers, prompts whose scripted answers are known, and
`llmq` as a subprocess (their `redis` fixture is in `conftest.py`). Public surface only: the docs' key names, the
client, the CLI."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from client import AsyncClient, AsyncJob
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
TAG = "{llmq:default}"  # docs/tenants.md: "`{llmq:default}` for partition 0"
LANE_NAMES = ("interactive", "default", "batch")
READERS = f"{TAG}:held:readers"
RESULT_TIMEOUT_S = 60.0


async def stop(running: Any) -> None:
    running.stop.set()
    running.hurry.set()
    await asyncio.wait_for(running.task, 30)


async def prime(start_worker: Callable[..., Any], redis: Redis, name: str = "primer", **settings: Any) -> None:
    """A worker of this release reads the queue, then stops: from now on (for about 30 s) clients hold requests
    and nothing moves them until a worker starts again."""
    primer = await start_worker(worker_id=name, **settings)
    await wait_until(lambda: redis.exists(READERS), 10)
    await stop(primer)
    assert await redis.exists(READERS), "the readers mark went away with the worker"


def text(tag: str, index: int, width: int = 40) -> str:
    """A prompt of exactly `width` ASCII bytes (`width` / 4 tokens by the documented estimate), unique per
    (tag, index) in its first characters so no two requests share a cache-affinity key."""
    head = f"{tag}-{index:05d}:"
    return (head + "x" * width)[:width]


async def submit(
    client: AsyncClient, tenant: str, index: int, tokens: int = 4, width: int = 40, **options: Any
) -> tuple[AsyncJob, str, int]:
    prompt = text(tenant, index, width)
    job = await client.submit(prompt=prompt, max_new_tokens=tokens, tenant=tenant, **options)
    assert isinstance(job, AsyncJob)
    return job, prompt, tokens


async def check(job: AsyncJob, prompt: str | list[int], tokens: int) -> Any:
    """The whole answer, as the scripted engine scripts it (text prompts are their UTF-8 bytes)."""
    result = await job.result(timeout=RESULT_TIMEOUT_S)
    ids = list(prompt.encode()) if isinstance(prompt, str) else prompt
    assert result.token_ids == expected_tokens(ids, tokens), job.id
    return result


async def llmq(url: str, *args: str) -> tuple[int, str, str]:
    """`llmq --url URL ARGS...` as a subprocess (without blocking the workers' event loop)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "client.cli",
        "--url",
        url,
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()
