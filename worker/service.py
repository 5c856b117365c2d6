"""The worker: wires Redis, the intake, the engine and the publisher, and owns their lifecycle.

intake (XREADGROUP COUNT=free slots) -> engine.submit -> one relay task per request -> publisher
cancel listener (pub/sub) -> engine.cancel          heartbeat -> {<queue>}:workers
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from typing import Any

from redis.asyncio import Redis

from client.errors import ErrorCode
from client.protocol import (
    DoneEvent,
    ErrorEvent,
    GenerateRequest,
    Keys,
    Timings,
    TokensEvent,
    Usage,
    WorkerInfo,
    encode,
    ms_now,
)
from worker.config import Settings
from worker.engine import (
    Engine,
    EngineClosed,
    EngineConfig,
    EngineError,
    EngineRequest,
    LoadOptions,
    RequestStream,
    SamplingParams,
    load_model,
)
from worker.intake import Accepted, DeadLetter, Decision, Intake, Rejected
from worker.logging import configure, get_logger, redact
from worker.publisher import Publisher

_STALE_WORKER_MS = 10 * 60 * 1000  # heartbeats older than this are pruned from the workers hash


class Worker:
    """One worker process's service loop over an already started engine."""

    def __init__(self, settings: Settings, engine: Engine, redis: Redis) -> None:
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.keys = Keys(settings.queue, settings.prefix)
        self.intake = Intake(redis, self.keys, settings.worker_id, settings.limits, settings.dead_letter_maxlen)
        self.publisher = Publisher(redis, self.keys, on_error=self._publish_failed)
        self.log = get_logger(worker=settings.worker_id, queue=settings.queue)
        self.started_ms = ms_now()
        self.tokens_generated = 0
        self._relays: dict[str, asyncio.Task[None]] = {}
        self._capacity = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Serves until `stop` is set, then stops reading and lets the requests in flight finish."""
        await self.intake.ensure_group()
        helpers = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(self._listen_for_cancels(stop), name="cancels"),
            asyncio.create_task(self._heartbeat(stop), name="heartbeat"),
        ]
        self.log.info("worker ready", model=self.settings.model, kv_blocks=self.engine.stats().kv_blocks_total)
        try:
            await self._read_until(stop)
            await self._drain()
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.redis.hdel(self.keys.workers, self.settings.worker_id)
            self.log.info("worker stopped")

    async def _drain(self) -> None:
        """Stopped reading: lets requests in flight finish within the drain timeout, then writes what is queued.

        Requests still running afterwards end with `EngineClosed` when the engine closes and stay unacknowledged.
        """
        if self._relays:
            self.log.info("draining", in_flight=len(self._relays), timeout_s=self.settings.drain_timeout_s)
            _, unfinished = await asyncio.wait(list(self._relays.values()), timeout=self.settings.drain_timeout_s)
            if unfinished:
                self.log.warning("drain timeout: requests left unfinished", count=len(unfinished))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_timeout_s or 1.0):
                await self.publisher.wait_idle()

    async def _read_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            free = self.engine.free_slots()
            if free == 0:  # read nothing an idle worker could run sooner
                self._capacity.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.read_block_ms / 1000):
                        await self._capacity.wait()
                continue
            try:
                decisions = await self.intake.read(free, self.settings.read_block_ms)
            except Exception as error:  # Redis unreachable: keep serving what is in flight, retry shortly
                self.log.warning("reading the queue failed", error=redact(str(error)))
                await asyncio.sleep(1.0)
                continue
            await self._handle(decisions)

    async def _handle(self, decisions: list[Decision]) -> None:
        accepted = [d for d in decisions if isinstance(d, Accepted)]
        cancelled = await self._cancel_marks([d.request.id for d in accepted])
        for decision in decisions:
            if isinstance(decision, DeadLetter):
                self.log.warning("dead letter", entry=decision.entry_id.decode(), reason=decision.reason)
                await self.intake.dead_letter(decision)
            elif isinstance(decision, Rejected):
                self.log.info("rejected", request_id=decision.request_id, code=decision.code, reason=decision.message)
                event = ErrorEvent(code=decision.code, message=decision.message)
                self.publisher.finish(decision.request_id, decision.result_ttl, event, decision.entry_id)
            elif decision.request.id in cancelled:
                self._finish_unstarted(
                    decision, DoneEvent(finish_reason="cancelled", usage=Usage(prompt_tokens=0, completion_tokens=0))
                )
            else:
                self._start(decision)

    async def _cancel_marks(self, request_ids: list[str]) -> set[str]:
        if not request_ids:
            return set()
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.exists(self.keys.cancel(request_id))
            marks = await pipe.execute()
        return {request_id for request_id, mark in zip(request_ids, marks, strict=True) if mark}

    def _start(self, accepted: Accepted) -> None:
        request = accepted.request
        try:
            stream = self.engine.submit(engine_request(request))
        except EngineError as error:
            self.log.info("rejected", request_id=request.id, code=error.code, reason=str(error))
            self._finish_unstarted(accepted, ErrorEvent(code=error.code, message=str(error), retryable=error.retryable))
            return
        self._relays[request.id] = asyncio.create_task(self._relay(accepted, stream, ms_now()), name=request.id)

    def _finish_unstarted(self, accepted: Accepted, event: DoneEvent | ErrorEvent) -> None:
        self.publisher.finish(accepted.request.id, accepted.request.result_ttl, event, accepted.entry_id)

    async def _relay(self, accepted: Accepted, stream: RequestStream, started_ms: int) -> None:
        """Turns one request's engine deltas into result events, ending with `done` or `error`."""
        request, ttl = accepted.request, accepted.request.result_ttl
        seq, first_token_ms = 0, None
        try:
            async for delta in stream:
                if delta.token_ids:
                    first_token_ms = first_token_ms or ms_now()
                    self.publisher.tokens(request.id, ttl, TokensEvent(seq=seq, ids=delta.token_ids, text=delta.text))
                    seq += len(delta.token_ids)
                    self.tokens_generated += len(delta.token_ids)
                if delta.finish_reason is not None:
                    timings = Timings(
                        queue_ms=started_ms - request.submitted,
                        ttft_ms=None if first_token_ms is None else first_token_ms - request.submitted,
                        total_ms=ms_now() - request.submitted,
                    )
                    usage = Usage(prompt_tokens=stream.prompt_tokens, completion_tokens=seq)
                    done = DoneEvent(finish_reason=delta.finish_reason.value, usage=usage, timings=timings)
                    self.publisher.finish(request.id, ttl, done, accepted.entry_id)
                    self.log.info("finished", request_id=request.id, reason=delta.finish_reason.value, tokens=seq)
        except EngineClosed:
            self.log.info("left unacknowledged at shutdown", request_id=request.id)
        except EngineError as error:
            self.log.warning("failed", request_id=request.id, code=error.code, error=str(error))
            event = ErrorEvent(code=ErrorCode(error.code), message=str(error), retryable=error.retryable)
            self.publisher.finish(request.id, ttl, event, accepted.entry_id)
        finally:
            self._relays.pop(request.id, None)
            self._capacity.set()

    async def _listen_for_cancels(self, stop: asyncio.Event) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.keys.cancel_channel)
        try:
            while not stop.is_set():
                message = await pubsub.get_message(timeout=1.0)
                if message is not None and self.engine.cancel(_text(message["data"])):
                    self.log.info("cancelled", request_id=_text(message["data"]))
        finally:
            await pubsub.aclose()

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.redis.hset(self.keys.workers, self.settings.worker_id, encode(self.info()))
                if self.engine.alive:  # the container health check reads this file's age
                    self.settings.health_file.write_text(str(ms_now()))
                await self._prune_stale_workers()
            except Exception as error:
                self.log.warning("heartbeat failed", error=redact(str(error)))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.heartbeat_s):
                    await stop.wait()

    async def _prune_stale_workers(self) -> None:
        """Keeps the workers hash bounded: entries of workers dead for long are removed."""
        from client.protocol import MalformedEntry, decode_worker

        stale = []
        for worker_id, raw in (await self.redis.hgetall(self.keys.workers)).items():
            try:
                if ms_now() - decode_worker(raw).heartbeat > _STALE_WORKER_MS:
                    stale.append(worker_id)
            except MalformedEntry:
                stale.append(worker_id)
        if stale:
            await self.redis.hdel(self.keys.workers, *stale)

    def info(self) -> WorkerInfo:
        stats = self.engine.stats()
        return WorkerInfo(
            id=self.settings.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            queue=self.settings.queue,
            model=self.settings.model,
            running=stats.running,
            waiting=stats.waiting,
            kv_used_blocks=stats.kv_blocks_used,
            kv_total_blocks=stats.kv_blocks_total,
            tokens_generated=self.tokens_generated,
            started=self.started_ms,
            heartbeat=ms_now(),
        )

    def _publish_failed(self, error: Exception) -> None:
        self.log.error("publishing results failed", error=redact(str(error)))


def engine_request(request: GenerateRequest) -> EngineRequest:
    params = request.params
    return EngineRequest(
        request_id=request.id,
        prompt=request.prompt,
        messages=[m.model_dump() for m in request.messages] if request.messages is not None else None,
        input_ids=request.input_ids,
        params=SamplingParams(
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop=tuple(params.stop),
            ignore_eos=params.ignore_eos,
        ),
    )


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        kv_cache_tokens=settings.kv_cache_tokens,
        page_size=settings.page_size,
        max_batch_tokens=settings.max_batch_tokens,
        max_running=settings.max_running,
        prefix_sharing=settings.prefix_sharing,
        seed=settings.seed,
    )


def connect(settings: Settings) -> Redis:
    kwargs: dict[str, Any] = {"health_check_interval": 15}
    if settings.redis_ca_file is not None:
        kwargs["ssl_ca_certs"] = str(settings.redis_ca_file)
    return Redis.from_url(settings.redis_url.get_secret_value(), **kwargs)


class RedisUnavailable(RuntimeError):
    """Redis refused or could not be reached at start-up: wrong URL, password, ACL or TLS settings."""


async def serve(settings: Settings, *, handle_signals: bool = True) -> None:
    """Checks Redis, loads the model, starts the engine and serves until SIGTERM or SIGINT."""
    configure(settings.log_format, settings.log_level)
    log = get_logger(worker=settings.worker_id)
    url = redact(settings.redis_url.get_secret_value())
    redis = connect(settings)
    try:
        await redis.ping()  # fail in a second on a wrong password or address, not after loading the model
    except Exception as error:
        await redis.aclose()
        raise RedisUnavailable(f"cannot use Redis at {url}: {redact(str(error)) or type(error).__name__}") from None
    stop = asyncio.Event()
    if handle_signals:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    try:
        log.info("loading model", model=settings.model, device=settings.device, redis=url)
        options = LoadOptions(
            device=settings.device,
            dtype=settings.dtype,
            attn_implementation=settings.attn_implementation,
            trust_remote_code=settings.trust_remote_code,
            cache_dir=settings.model_cache_dir,
        )
        model, tokenizer = await asyncio.to_thread(load_model, settings.model, options)
        async with Engine(model, tokenizer, engine_config(settings)) as engine:
            await Worker(settings, engine, redis).run(stop)
    finally:
        await redis.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
