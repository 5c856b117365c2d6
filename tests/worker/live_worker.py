"""One live worker (real engine on the tiny model, real redis-server) for the whole black-box module.

It runs in a background thread with its own event loop, so plain (sync) tests, hypothesis' `@given` included,
drive it through `LiveWorker.call(coroutine)`. Everything it needs is private: its own redis-server and its
own model folder, so nothing else in the test session flushes Redis under it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from redis.asyncio import Redis

from client import AsyncClient
from client.store import Keys
from tests.worker.conftest import worker_settings
from worker.adapter import engine_config
from worker.engine import Engine, LoadOptions, load_model
from worker.service import Worker

T = TypeVar("T")

CONTROL_IDS = [3, 4, 5]
CONTROL_TOKENS = 8
MAX_POSITIONS = 512


class LiveWorker:
    """A worker serving queue `default`, plus a client and a raw Redis connection, all on one loop thread."""

    def __init__(self, redis_url: str, model_dir: Path) -> None:
        self.redis_url = redis_url
        self.model_dir = model_dir
        self.keys = Keys("default")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="blackbox-worker", daemon=True)
        self.thread.start()
        self.vocab_size = 0
        self.max_positions = MAX_POSITIONS
        self.baseline: dict[bool, list[int]] = {}  # ignore_eos -> greedy output of CONTROL_IDS on an idle worker

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self) -> None:
        settings = worker_settings(self.redis_url, self.model_dir)
        model, tokenizer = load_model(settings.model, LoadOptions(cache_dir=settings.model_cache_dir))
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.engine = await Engine(model, tokenizer, engine_config(settings)).start()
        self.redis = Redis.from_url(self.redis_url)
        self.worker_redis = Redis.from_url(self.redis_url)
        self.worker = Worker(settings, self.engine, self.worker_redis)
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self.task = asyncio.create_task(self.worker.run(self.stop, self.hurry))
        self.client = AsyncClient(self.redis_url)
        for ignore_eos in (False, True):
            job = await self.client.submit(
                input_ids=CONTROL_IDS, max_new_tokens=CONTROL_TOKENS, temperature=0, ignore_eos=ignore_eos
            )
            self.baseline[ignore_eos] = (await job.result(timeout=60)).token_ids

    async def close(self) -> None:
        self.stop.set()
        self.hurry.set()
        try:
            await asyncio.wait_for(self.task, 30)
        finally:
            await self.engine.close()
            await self.client.aclose()
            await self.redis.aclose()
            await self.worker_redis.aclose()

    def restarts(self) -> int:
        async def read() -> int:
            return self.engine.stats().restarts

        return self.call(read())

    def worker_alive(self) -> bool:
        return not self.task.done()
