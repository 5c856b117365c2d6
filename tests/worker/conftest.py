from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from redis.asyncio import Redis

from client import AsyncClient
from client.connection import open_async
from testing.scripted_engine import ScriptedEngine
from testing.tiny_models import save_tiny_model
from worker.adapter import engine_config
from worker.config import Settings
from worker.embedded_redis import RedisServer
from worker.engine import Engine, LoadOptions, load_model
from worker.service import Worker

if TYPE_CHECKING:
    from tests.worker.live_worker import LiveWorker


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("worker-model"), "llama", max_positions=512)


def worker_settings(redis_url: str, model_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "model": str(model_dir),
        "kv_cache_tokens": 2048,
        "page_size": 16,
        "max_batch_tokens": 128,
        "max_running": 8,
        "read_block_ms": 50,
        "heartbeat_s": 0.2,
        "model_cache_dir": model_dir / "cache",
        "metrics_port": 0,
        **overrides,
    }
    return Settings(_env_file=None, **values)


@dataclass
class RunningWorker:
    worker: Worker
    stop: asyncio.Event  # the first SIGTERM
    hurry: asyncio.Event  # the second
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def serving(
    url: str, queue: str, tmp_path: Path, step_s: float = 0.002, model: str = "model", **overrides: Any
) -> AsyncIterator[Worker]:
    """One in-process worker on the scripted engine and `queue` of any Redis URL, connected as `python -m worker`
    connects (`open_async`); `overrides` are settings."""
    settings = worker_settings(url, tmp_path / model, queue=queue, **overrides)
    engine = ScriptedEngine(step_s=step_s, max_running=32, kv_cache_tokens=32768, page_size=16, max_batch_tokens=512)
    ca_file = None if settings.redis_ca_file is None else str(settings.redis_ca_file)
    redis = open_async(url, ssl_ca_certs=ca_file, socket_timeout=5, socket_connect_timeout=2)
    worker = Worker(settings, engine, redis)
    stop, hurry = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(worker.run(stop, hurry))
    try:
        yield worker
    finally:
        stop.set()
        hurry.set()
        await asyncio.wait_for(task, 30)
        await redis.aclose()


@pytest.fixture
async def start_worker(redis_url: str, model_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    """Starts in-process workers on a real Redis: on the scripted engine (service logic, fast), or with
    `real_model=True` on the real engine and a tiny model. All are stopped after the test."""
    started: list[tuple[RunningWorker, Any, Redis]] = []

    async def start(*, real_model: bool = False, step_s: float = 0.002, **overrides: Any) -> RunningWorker:
        settings = worker_settings(redis_url, model_dir, **overrides)
        engine: Any
        if real_model:
            model, tokenizer = load_model(settings.model, LoadOptions(cache_dir=settings.model_cache_dir))
            engine = await Engine(model, tokenizer, engine_config(settings)).start()
        else:
            engine = ScriptedEngine(
                step_s=step_s,
                max_running=settings.max_running,
                kv_cache_tokens=settings.kv_cache_tokens,
                page_size=settings.page_size,
                max_batch_tokens=settings.max_batch_tokens,
            )
        redis = Redis.from_url(redis_url)
        worker = Worker(settings, engine, redis)
        stop, hurry = asyncio.Event(), asyncio.Event()
        running = RunningWorker(worker, stop, hurry, asyncio.create_task(worker.run(stop, hurry)))
        started.append((running, engine, redis))
        return running

    yield start
    for running, engine, redis in started:
        running.stop.set()
        running.hurry.set()
        await asyncio.wait([running.task], timeout=30)  # ended by a test (raised, cancelled) or stopping now
        await engine.close()
        await redis.aclose()


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """A plain asyncio connection to the session's Redis (modules that need another define their own)."""
    connection = Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(redis_url) as client:
        yield client


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveWorker]:
    """One live worker (real engine, tiny model, a redis-server of its own) for a whole module."""
    from tests.worker.live_worker import MAX_POSITIONS, LiveWorker  # it builds on worker_settings, above

    server = RedisServer(Path(tmp_path_factory.mktemp("blackbox-redis"))).start()
    model_dir = save_tiny_model(tmp_path_factory.mktemp("blackbox-model"), "llama", max_positions=MAX_POSITIONS)
    live = LiveWorker(server.url, model_dir)
    try:
        live.call(live.start(), timeout=120)
        yield live
    finally:
        try:
            if hasattr(live, "task"):
                live.call(live.close(), timeout=60)
        finally:
            live.loop.call_soon_threadsafe(live.loop.stop)
            live.thread.join(10)
            server.stop()
