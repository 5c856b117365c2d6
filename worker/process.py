"""The worker process: connect to Redis (failing fast on bad credentials), load the model, start the engine,
and serve until SIGTERM or SIGINT (the first drains, a second ends the drain). `python -m worker` calls
`serve`; `Worker` (worker.service) is the service itself, over an already started engine. Torch and transformers
are imported only once Redis answers (seconds of imports): a URL the worker cannot use is refused at once, and then a
model path that is not there."""

from __future__ import annotations

import asyncio
import gc
import signal
from typing import Any

from redis.asyncio import Redis

from client.connection import check_async, open_async
from client.errors import RedisUnavailable
from worker.config import Settings
from worker.logging import configure, get_logger, redact
from worker.model_spec import missing_path


class CannotStart(Exception):
    """The worker cannot start as configured: the model does not load, or the engine's sizing does not fit in
    memory. Its message is one line for the operator; `status` is the process's exit status (1 for what is missing
    around the worker, 2 for a setting to change, as for a bad flag)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


def connect(settings: Settings) -> Redis:
    # A read that never gets its reply (a half-open connection) must fail and be retried, not hang the loop:
    # every call here is short (XREADGROUP blocks for read_block_ms at most).
    timeout_s = max(10.0, 4 * settings.read_block_ms / 1000)
    kwargs: dict[str, Any] = {"health_check_interval": 15, "socket_timeout": timeout_s, "socket_connect_timeout": 5.0}
    ca_file = None if settings.redis_ca_file is None else str(settings.redis_ca_file)
    client: Redis = open_async(settings.redis_url.get_secret_value(), ssl_ca_certs=ca_file, **kwargs)
    return client


async def serve(settings: Settings, *, handle_signals: bool = True) -> None:
    """Checks Redis, loads the model, starts the engine and serves until SIGTERM or SIGINT."""
    configure(settings.log_format, settings.log_level)
    log = get_logger(worker=settings.worker_id)
    url = redact(settings.redis_url.get_secret_value())
    try:
        redis = connect(settings)
    except ValueError as error:  # a URL that is no Redis URL, a CA file without TLS
        raise RedisUnavailable(f"cannot use Redis at {url}: {error}") from None
    try:
        await check_async(redis, settings.redis_url.get_secret_value())  # in a second, not after loading the model
    except Exception as error:
        await redis.aclose()
        raise RedisUnavailable(f"cannot use Redis at {url}: {redact(str(error)) or type(error).__name__}") from None
    missing = missing_path(settings.model)
    if missing is not None:  # at once, not after seconds of imports
        await redis.aclose()
        raise CannotStart(f"cannot load model {settings.model!r}: no such file or folder: {missing}", status=1)
    from worker.adapter import engine_config
    from worker.engine import Engine, LoadOptions, load_model
    from worker.service import Worker

    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first signal drains, a second one ends the drain at once
        (hurry if stop.is_set() else stop).set()

    if handle_signals:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal)
    try:
        log.info("loading model", model=settings.model, device=settings.device, redis=url)
        options = LoadOptions(
            device=settings.device,
            dtype=settings.dtype,
            attn_implementation=settings.attn_implementation,
            trust_remote_code=settings.trust_remote_code,
            cache_dir=settings.model_cache_dir,
            quantize=settings.quantize,
            float32_few_rows=settings.float32_few_rows,
        )
        try:
            model, tokenizer = await asyncio.to_thread(load_model, settings.model, options)
        except (OSError, ValueError, ImportError) as error:  # no such folder or hub id, no hub, a broken checkpoint
            raise CannotStart(f"cannot load model {settings.model!r}: {one_line(error)}", status=1) from error
        log.info("model loaded", dtype=str(model.dtype).removeprefix("torch."), device=str(model.device))
        engine = Engine(model, tokenizer, engine_config(settings))
        try:
            await engine.start()
        except MemoryError as error:  # the library sizes the cache and batch buffers before allocating them
            raise CannotStart(
                f"the engine does not fit in memory ({one_line(error)}): lower --kv-cache-tokens, --max-running, "
                "--max-batch-tokens or --page-size",
                status=2,
            ) from error
        log.info("startup heap frozen", objects=freeze_startup_heap())
        try:
            await Worker(settings, engine, redis).run(stop, hurry)
        finally:
            await engine.close()
    finally:
        await redis.aclose()


def freeze_startup_heap() -> int:
    """Moves what the imports, the model and the engine left (some 400,000 objects with a tiny model, all living as
    long as the process) out of the garbage collector's reach, and returns how many: a full collection no longer
    walks them (0.19 s each time, on whichever thread allocates, the engine's too) and a stopped worker exits about
    0.2 s after `worker stopped` instead of 1.5 s of collecting at shutdown. Garbage is collected first, so none of it
    is kept."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def one_line(error: BaseException) -> str:
    """A library's message (transformers' span several lines and end in advice) as one line."""
    return " ".join(str(error).split()) or type(error).__name__
