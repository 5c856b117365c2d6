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
from redis.exceptions import RedisError

from client.protocol import ErrorCode, ErrorEvent, WorkerInfo, encode, ms_now
from client.store import CONSUMER_GROUP, Keys, queue_status_commands, status_from_replies
from worker.adapter import engine_config, engine_request
from worker.config import Settings
from worker.engine import (
    Engine,
    EngineError,
    LoadOptions,
    RequestStream,
    Resume,
    load_model,
)
from worker.intake import Accepted, DeadLetter, Decision, Intake, Ready, Rejected
from worker.leases import Leases
from worker.logging import configure, get_logger, redact
from worker.metrics import Metrics
from worker.publisher import Publisher, Target
from worker.relay import Relay, finish_without_generating

_STALE_WORKER_S = 10 * 60  # heartbeats older than this are pruned from the workers hash


class Worker:
    """One worker process's service loops over an already started engine."""

    def __init__(self, settings: Settings, engine: Engine, redis: Redis) -> None:
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.keys = Keys(settings.queue, settings.prefix)
        self.intake = Intake(redis, self.keys, settings.worker_id, settings.limits, settings.dead_letter_maxlen)
        self.leases = Leases(redis, self.keys, settings.worker_id, settings.lease_timeout_s)
        self.publisher = Publisher(
            redis, self.keys, on_error=self._publish_failed, on_fenced=self._fenced, on_failed=self._events_refused
        )
        self.log = get_logger(worker=settings.worker_id, queue=settings.queue)
        self.metrics = Metrics(engine, settings.queue, settings.model)
        self.started_ms = ms_now()
        self.relays: dict[str, Relay] = {}
        self._capacity = asyncio.Event()
        self._next_claim = 0.0
        self._chores: set[asyncio.Task[None]] = set()  # dead letters written from callbacks
        # Helpers stop on this flag, not by cancellation: a redis-py call cancelled mid-reply can surface as
        # another error that a retrying loop would swallow (and it leaves the connection out of step).
        self._finished = asyncio.Event()

    async def run(self, stop: asyncio.Event, hurry: asyncio.Event | None = None) -> None:
        """Serves until `stop` is set; then drains (until `hurry` is set or the drain timeout) and hands back."""
        await self.intake.ensure_group()
        if self.settings.metrics_port:
            try:
                self.metrics.serve(self.settings.metrics_port, self.settings.metrics_address)
            except OSError as error:  # e.g. a second worker on this host with the same port
                self.log.warning("metrics endpoint not started", port=self.settings.metrics_port, error=str(error))
        helpers = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(self._listen_for_cancels(), name="cancels"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._renew_leases(), name="leases"),
        ]
        self.log.info("worker ready", model=self.settings.model, kv_blocks=self.engine.stats().kv_blocks_total)
        try:
            await self._read_until(stop)
            await self._drain(hurry or asyncio.Event())
        finally:
            self._finished.set()
            self.publisher.stop()
            _, stuck = await asyncio.wait(helpers, timeout=5.0)
            for task in stuck:  # last resort, bounded: nothing may keep the process from exiting
                task.cancel()
            if stuck:
                self.log.warning("helpers did not stop in time", tasks=sorted(t.get_name() for t in stuck))
                await asyncio.wait(stuck, timeout=2.0)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5.0):
                    await self.redis.hdel(self.keys.workers, self.settings.worker_id)
                    await self._leave_group()
            self.log.info("worker stopped")

    async def _leave_group(self) -> None:
        """Removes this consumer from the group when it holds nothing, so restarts leave no trail of names."""
        mine = await self.redis.xpending_range(
            self.keys.requests, CONSUMER_GROUP, min="-", max="+", count=1, consumername=self.settings.worker_id
        )
        if not mine:
            await self.redis.xgroup_delconsumer(self.keys.requests, CONSUMER_GROUP, self.settings.worker_id)

    # ------------------------------------------------------------------ reading and claiming

    def free_slots(self) -> int:
        if self.publisher.backlog > self.settings.max_buffered_events:
            return 0  # Redis is away and we hold enough undelivered output: take nothing new
        return self.engine.free_slots()

    async def _read_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            free = self.free_slots()
            if free == 0:  # read nothing an idle worker could run sooner
                self._capacity.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.read_block_ms / 1000):
                        await self._capacity.wait()
                continue
            try:
                free -= await self._claim(free)
                if free > 0:
                    await self._start_all(await self.intake.read(free, self.settings.read_block_ms))
            except RedisError as error:  # Redis unreachable: keep serving what is in flight, retry shortly
                self.log.warning("reading the queue failed", error=redact(str(error)))
                await asyncio.sleep(1.0)

    async def _claim(self, free: int) -> int:
        """Takes over requests whose worker died (idle past the lease); returns how many were claimed."""
        now = asyncio.get_running_loop().time()
        if now < self._next_claim:
            return 0
        self._next_claim = now + self.settings.claim_interval_s
        claimed = await self.leases.claim(free)
        if claimed:
            self.metrics.claims.inc(len(claimed))
            self.log.info("claimed", count=len(claimed), entries=[c.entry_id.decode() for c in claimed])
            decisions, deliveries = self.intake.decide_claimed(claimed)
            await self._start_all(decisions, deliveries)
        return len(claimed)

    async def _start_all(self, decisions: list[Decision], deliveries: dict[bytes, int] | None = None) -> None:
        for decision in decisions:
            if isinstance(decision, DeadLetter):
                self.log.warning("dead letter", entry=decision.entry_id.decode(), reason=decision.reason)
                await self.intake.dead_letter(decision)
                self.metrics.dead_letters.inc()
            elif isinstance(decision, Rejected):
                self._reject(decision)
        accepted = [d for d in decisions if isinstance(d, Accepted)]
        ready, refused = await self.intake.prepare(accepted, deliveries, self.settings.max_hand_backs)
        for rejected in refused:
            self._reject(rejected)
        for item in ready:
            await self._start(item)

    def _reject(self, decision: Rejected) -> None:
        self.log.info("rejected", request_id=decision.request_id, code=decision.code, reason=decision.message)
        event = ErrorEvent(code=decision.code, message=decision.message)
        self.publisher.finish(Target(decision.request_id, decision.result_ttl, entry_id=decision.entry_id), event)

    async def _start(self, ready: Ready) -> None:
        relay = Relay(ready, self.publisher, self.log, self.metrics)
        request = relay.request
        if ready.finished:  # an earlier attempt published its end but died before acknowledging
            self.publisher.finish(relay.target, None)
            return
        if ready.engine_failures >= self.settings.max_engine_failures:
            await self._quarantine(relay)
            return
        if ready.deliveries > self.settings.max_deliveries:
            reason = f"claimed {ready.deliveries} times (max_deliveries {self.settings.max_deliveries})"
            self.log.warning("delivery limit", request_id=request.id, reason=reason)
            await self.intake.dead_letter(DeadLetter(relay.entry_id, encode(request), reason), acknowledge=False)
            self.metrics.dead_letters.inc()
            relay.error(ErrorCode.DELIVERY_LIMIT, f"the request failed repeatedly: {reason}")
            return
        reason = finish_without_generating(relay, self.engine.eos_token_ids)
        if reason is not None:
            relay.done(reason, prompt_tokens=0)
            return
        if request.id in self.relays:  # we claimed our own request (our lease lapsed, say in an outage)
            self._fence_out(self.relays[request.id])  # the old run stops; this attempt resumes from its output
        resume = Resume(ready.delivered_ids, ready.delivered_text) if ready.delivered_ids else None
        try:
            stream = self.engine.submit(engine_request(request, resume, suspect=ready.engine_failures > 0))
        except EngineError as error:
            self.log.info("rejected", request_id=request.id, reason=str(error))
            relay.fail(error)
            return
        if resume is not None:
            self.log.info("resumed", request_id=request.id, delivered=len(resume.token_ids), attempt=ready.attempt)
        self.relays[request.id] = relay
        relay.task = asyncio.create_task(self._run_relay(relay, stream), name=request.id)

    async def _quarantine(self, relay: Relay) -> None:
        """A request implicated in `max_engine_failures` engine failures never runs again, on any worker: its
        reader gets `poison_request`, the dead letters get the request with the reason."""
        failures = relay.ready.engine_failures
        reason = f"implicated in {failures} engine failures (max_engine_failures {self.settings.max_engine_failures})"
        self.log.error("quarantined", request_id=relay.request.id, reason=reason)
        letter = DeadLetter(relay.entry_id, encode(relay.request), f"quarantined: {reason}")
        await self.intake.dead_letter(letter, acknowledge=False)
        self.metrics.dead_letters.inc()
        self.metrics.quarantined.inc()
        relay.error(ErrorCode.POISON_REQUEST, f"the request was quarantined: it was {reason}")

    async def _run_relay(self, relay: Relay, stream: RequestStream) -> None:
        try:
            await relay.run(stream, self._hand_back)
        finally:
            if self.relays.get(relay.request.id) is relay:  # not a newer attempt of the same request
                del self.relays[relay.request.id]
            self._capacity.set()

    async def _hand_back(self, relay: Relay, implicated: bool) -> None:
        """After an engine failure: whoever claims the request next resumes it, and counts the failure against it
        if it was `implicated`."""
        with contextlib.suppress(RedisError):
            await self.leases.hand_back([(relay.entry_id, relay.request.id)], engine_failure=implicated)

    # ------------------------------------------------------------------ ownership

    async def _pause(self, seconds: float) -> bool:
        """Sleeps, but wakes when the worker finishes; True while it should go on."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._finished.wait()
        return not self._finished.is_set()

    async def _renew_leases(self) -> None:
        while await self._pause(self.settings.lease_renew_s):
            try:
                lost = await self.leases.renew([relay.entry_id for relay in self.relays.values() if not relay.fenced])
            except RedisError as error:
                self.log.warning("renewing leases failed", error=redact(str(error)))
                continue
            for relay in list(self.relays.values()):
                if relay.entry_id in lost:
                    self._fence_out(relay)

    def _fenced(self, request_id: str, attempt: int) -> None:
        """The publisher's report: a write of `attempt` was refused. A newer attempt of ours runs on."""
        relay = self.relays.get(request_id)
        if relay is not None and relay.target.attempt == attempt:
            self._fence_out(relay)

    def _fence_out(self, relay: Relay) -> None:
        """Another attempt owns this request now: stop generating it and write nothing more for it."""
        if not relay.fenced:
            relay.fenced = True
            self.engine.cancel(relay.request.id)
            self.log.warning("lost ownership; stopped", request_id=relay.request.id, attempt=relay.target.attempt)

    # ------------------------------------------------------------------ shutdown

    async def _drain(self, hurry: asyncio.Event) -> None:
        """Stopped reading: lets requests in flight finish within the drain timeout (or until `hurry`), hands
        back the rest (claimable at once by any worker, which resumes them), and writes what is queued."""
        tasks = [relay.task for relay in self.relays.values() if relay.task is not None]
        if tasks:
            self.log.info("draining", in_flight=len(tasks), timeout_s=self.settings.drain_timeout_s)
            finished = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
            hurried = asyncio.ensure_future(hurry.wait())
            await asyncio.wait(
                [finished, hurried], timeout=self.settings.drain_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            hurried.cancel()
        left = list(self.relays.values())
        if left:
            self.log.warning("handing back unfinished requests", count=len(left))
            for relay in left:
                relay.fenced = True  # no more renewals or writes: whoever claims it resumes from what is published
            with contextlib.suppress(RedisError):
                await self.leases.hand_back([(relay.entry_id, relay.request.id) for relay in left])
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(self.settings.drain_timeout_s, 1.0)):
                await self.publisher.wait_idle()

    async def _listen_for_cancels(self) -> None:
        """Cancels arrive by pub/sub, also while draining; a lost connection resubscribes (marks cover what was
        missed meanwhile). Runs until the worker finishes."""
        while not self._finished.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.cancel_channel)
                await self._apply_cancel_marks()  # anything published while we were not subscribed
                while not self._finished.is_set():
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and self.engine.cancel(_text(message["data"])):
                        self.log.info("cancelled", request_id=_text(message["data"]))
            except RedisError as error:
                self.log.warning("cancel channel lost; resubscribing", error=redact(str(error)))
                await self._pause(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _apply_cancel_marks(self) -> None:
        request_ids = list(self.relays)
        if not request_ids:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.exists(self.keys.cancel(request_id))
            marks = await pipe.execute()
        for request_id, marked in zip(request_ids, marks, strict=True):
            if marked:
                self.engine.cancel(request_id)

    async def _heartbeat(self) -> None:
        """Stats for `llmq status`, the health file and the queue gauges; also while draining."""
        while not self._finished.is_set():
            try:
                await self.redis.hset(self.keys.workers, self.settings.worker_id, encode(self.info()))
                if self.engine.alive:  # the container health check reads this file's age
                    self.settings.health_file.write_text(str(ms_now()))
                await self._report_queue()
            except Exception as error:
                self.log.warning("heartbeat failed", error=redact(str(error)))
            await self._pause(self.settings.heartbeat_s)

    async def _report_queue(self) -> None:
        """Queue gauges for the metrics, and pruning: heartbeats of workers gone for long leave the hash."""
        pipe = self.redis.pipeline(transaction=False)
        queue_status_commands(pipe, self.keys)
        replies = await pipe.execute(raise_on_error=False)
        status = status_from_replies(self.keys.queue, replies, stale_after_s=_STALE_WORKER_S)
        self.metrics.set_queue(status.depth, status.pending, status.lag)
        if status.stale_workers:
            await self.redis.hdel(self.keys.workers, *status.stale_workers)

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
            tokens_generated=self.publisher.stats.tokens,
            started=self.started_ms,
            heartbeat=ms_now(),
        )

    def _publish_failed(self, error: Exception) -> None:
        self.log.error("publishing results failed", error=redact(str(error)))

    def _events_refused(self, target: Target, message: str) -> None:
        """The publisher's report: Redis refused this request's events (its keys alone: a result stream someone
        overwrote with another type, say). Its reader cannot be answered there: stop it and dead-letter it."""
        relay = self.relays.get(target.request_id)
        raw = b""
        if relay is not None and relay.target == target:
            relay.fenced = True
            self.engine.cancel(target.request_id)
            raw = encode(relay.request)
        self.log.error("result stream refused; dead-lettered", request_id=target.request_id, error=redact(message))
        letter = DeadLetter(target.entry_id, raw, f"Redis refused the request's result events: {message}")
        chore = asyncio.create_task(self._dead_letter_quietly(letter))
        self._chores.add(chore)
        chore.add_done_callback(self._chores.discard)

    async def _dead_letter_quietly(self, letter: DeadLetter) -> None:
        try:
            await self.intake.dead_letter(letter)
            self.metrics.dead_letters.inc()
        except RedisError as error:  # its lease lapses and another worker meets the same refusal: bounded by deliveries
            self.log.warning("dead-lettering failed", entry=letter.entry_id.decode(), error=redact(str(error)))


def connect(settings: Settings) -> Redis:
    # A read that never gets its reply (a half-open connection) must fail and be retried, not hang the loop:
    # every call here is short (XREADGROUP blocks for read_block_ms at most).
    timeout_s = max(10.0, 4 * settings.read_block_ms / 1000)
    kwargs: dict[str, Any] = {"health_check_interval": 15, "socket_timeout": timeout_s, "socket_connect_timeout": 5.0}
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
        )
        model, tokenizer = await asyncio.to_thread(load_model, settings.model, options)
        async with Engine(model, tokenizer, engine_config(settings)) as engine:
            await Worker(settings, engine, redis).run(stop, hurry)
    finally:
        await redis.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
