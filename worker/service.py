"""The worker: read -> start -> drain. Wires Redis, the intake, the engine and the publisher, and owns the
lifecycle of its helpers (heartbeat, cancel listener, lease renewal, publisher).

intake (XREADGROUP COUNT=free slots) -> decide_ready -> engine.submit -> one relay task per request -> publisher
cancel listener (pub/sub) -> engine.cancel          heartbeat -> {<queue>}:workers
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from client.protocol import LANES, ErrorCode, ErrorEvent, Lane, encode
from client.store import CONSUMER_GROUP, HAND_BACK_DRAIN, HAND_BACK_ENGINE_FAILURE, HAND_BACK_PREEMPTION, Keys, Scripts
from worker.adapter import engine_request
from worker.cancels import CancelListener
from worker.config import Settings
from worker.engine import EngineError, EngineFailed, GenerationEngine, Resume
from worker.engine.interface import DeltaStream
from worker.heartbeat import Heartbeat
from worker.intake import (
    Accepted,
    Complete,
    DeadLetter,
    Decision,
    Intake,
    Ready,
    Refuse,
    Rejected,
    Run,
    decide_ready,
)
from worker.lanes import pick_victim, read_steps, reserved_slots
from worker.leases import Claimed, Leases
from worker.logging import get_logger, redact
from worker.metrics import Metrics
from worker.pausing import pause
from worker.publisher import Publisher, Target
from worker.relay import Relay, done_event, target_of

_PREEMPTIVE_WAIT_MS = 100  # a full worker with preemptible work blocks on the lanes this long at a time


class Worker:
    """One worker process's service loops over an already started engine."""

    def __init__(self, settings: Settings, engine: GenerationEngine, redis: Redis) -> None:
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.keys = Keys(settings.queue, settings.prefix)
        scripts = Scripts.register(redis)
        self.intake = Intake(
            redis, self.keys, settings.worker_id, settings.limits, settings.dead_letter_maxlen, scripts
        )
        self.leases = {
            lane: Leases(redis, self.keys, settings.worker_id, settings.lease_timeout_s, scripts, lane)
            for lane in LANES
        }
        self._reserved = reserved_slots(settings.max_running, settings.lane_share)
        self.publisher = Publisher(
            redis,
            self.keys,
            on_error=self._publish_failed,
            on_fenced=self._fenced,
            on_failed=self._events_refused,
            scripts=scripts,
            reply_maxlen=settings.reply_maxlen,
        )
        self.log = get_logger(worker=settings.worker_id, queue=settings.queue)
        self.metrics = Metrics(engine, settings.queue, settings.model)
        self.metrics.watch_publisher(self.publisher.stats)
        self.heartbeat = Heartbeat(
            redis, self.keys, settings, engine, self.metrics, lambda: self.publisher.stats.tokens, self.log
        )
        self.cancels = CancelListener(redis, self.keys, engine, lambda: list(self.relays), self.log)
        self.relays: dict[str, Relay] = {}
        self._capacity = asyncio.Event()
        self._next_claim = 0.0
        self._preempted: dict[Lane, list[bytes]] = {lane: [] for lane in LANES}  # handed back here, to resume here
        self._chores: set[asyncio.Task[None]] = set()  # dead letters written from callbacks
        # Helpers stop on this flag, not by cancellation (see `worker.pausing`).
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
            asyncio.create_task(self.cancels.run(self._finished), name="cancels"),
            asyncio.create_task(self.heartbeat.run(self._finished), name="heartbeat"),
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
        """Removes this consumer from each lane's group where it holds nothing, so restarts leave no trail."""
        for stream in self.keys.lanes.values():
            mine = await self.redis.xpending_range(
                stream, CONSUMER_GROUP, min="-", max="+", count=1, consumername=self.settings.worker_id
            )
            if not mine:
                await self.redis.xgroup_delconsumer(stream, CONSUMER_GROUP, self.settings.worker_id)

    # ------------------------------------------------------------------ read

    def free_slots(self) -> int:
        if self.publisher.backlog > self.settings.max_buffered_events:
            return 0  # Redis is away and we hold enough undelivered output: take nothing new
        return self.engine.free_slots()

    async def _read_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            free = self.free_slots()
            if free == 0 and self.settings.preemption and self._preemptible() is not None:
                try:
                    await self._preempt_for_interactive()
                except RedisError as error:
                    self.log.warning("reading the interactive lane failed", error=redact(str(error)))
                    await asyncio.sleep(1.0)
                continue
            if free == 0:  # read nothing an idle worker could run sooner
                self._capacity.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.read_block_ms / 1000):
                        await self._capacity.wait()
                continue
            try:
                free -= await self._claim(free)
                if free > 0:
                    steps = read_steps(free, self._running_by_lane(), self._reserved)
                    await self._start_all(await self.intake.read(free, steps, self.settings.read_block_ms))
            except RedisError as error:  # Redis unreachable: keep serving what is in flight, retry shortly
                self.log.warning("reading the queue failed", error=redact(str(error)))
                if "NOGROUP" in str(error):  # Redis came back without its data: nothing is read until the group is
                    with contextlib.suppress(RedisError):
                        await self.intake.ensure_group()
                await asyncio.sleep(1.0)

    async def _claim(self, free: int) -> int:
        """Resumes requests this worker preempted and takes over those whose worker died (idle past the lease)
        or that were handed back; returns how many were claimed."""
        taken = 0
        for lane, entry_ids in self._preempted.items():  # first the requests this worker preempted, highest lane first
            resumable, self._preempted[lane] = entry_ids[: free - taken], entry_ids[free - taken :]
            taken += await self._start_claimed(lane, await self.leases[lane].reclaim(resumable))
        now = asyncio.get_running_loop().time()
        if now < self._next_claim:
            return taken
        self._next_claim = now + self.settings.claim_interval_s
        for lane, leases in self.leases.items():  # highest lane first
            taken += await self._start_claimed(lane, await leases.claim(free - taken))
        return taken

    async def _start_claimed(self, lane: Lane, claimed: list[Claimed]) -> int:
        if claimed:
            self.metrics.claims.inc(len(claimed))
            self.log.info("claimed", lane=lane, count=len(claimed), entries=[c.entry_id.decode() for c in claimed])
            decisions, deliveries = self.intake.decide_claimed(lane, claimed)
            await self._start_all(decisions, deliveries)
        return len(claimed)

    def _running_by_lane(self) -> dict[Lane, int]:
        return dict(Counter(relay.lane for relay in self.relays.values() if not relay.fenced))

    def _preemptible(self) -> Relay | None:
        running = [relay for relay in self.relays.values() if not relay.fenced]
        return pick_victim(running, self._running_by_lane(), self._reserved, self.settings.max_preemptions)

    async def _preempt_for_interactive(self) -> None:
        """A full engine running preemptible work: wait (briefly, so a freed slot is noticed soon too) for an
        interactive request and take it (so no other worker preempts for it as well). Only once the engine has
        accepted it and it waits for a slot (not refused, expired or cancelled), cancel the victim `pick_victim`
        names, whose slot goes to the urgent request at once, then hand the victim back once its output is
        published."""
        block_ms = min(self.settings.read_block_ms, _PREEMPTIVE_WAIT_MS)
        decisions = await self.intake.read(1, [("interactive", 1)], block_ms=block_ms)
        if not decisions:
            return
        await self._start_all(decisions)  # queued in the engine (urgent: first in line), or answered
        victim = self._preemptible()  # again: the wait may have changed what runs
        if victim is None or self.engine.stats().waiting == 0:
            return  # it runs already, was answered without running, or waits here for the next free slot
        victim.fenced = True  # writes nothing more; whoever claims it resumes from what is published
        self.engine.cancel(victim.request.id)
        self.metrics.preempted(victim.lane)
        self.log.info(
            "preempted",
            request_id=victim.request.id,
            lane=victim.lane,
            tokens=victim.tokens,
            preemptions=victim.preemptions + 1,
            for_entry=decisions[0].entry_id.decode(),
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self.publisher.wait_idle()
        await self.leases[victim.lane].hand_back([(victim.entry_id, victim.request.id)], HAND_BACK_PREEMPTION)
        self._preempted[victim.lane].append(victim.entry_id)

    # ------------------------------------------------------------------ start

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
        target = Target(
            decision.request_id,
            decision.result_ttl,
            entry_id=decision.entry_id,
            reply_to=decision.reply_to,
            notify=decision.notify,
            lane=decision.lane,
        )
        self.publisher.finish(target, event)

    async def _start(self, ready: Ready) -> None:
        request = ready.accepted.request
        decision = decide_ready(
            ready,
            eos_token_ids=self.engine.eos_token_ids,
            max_deliveries=self.settings.max_deliveries,
            max_engine_failures=self.settings.max_engine_failures,
            running_here=request.id in self.relays,
        )
        delivered = len(ready.delivered_ids)
        output = (ready.delivered_text, ready.delivered_ids)
        if isinstance(decision, Complete):
            event = None
            if decision.finish_reason is not None:
                event = done_event(request, ready, decision.finish_reason, prompt_tokens=0, completion_tokens=delivered)
            self.publisher.finish(target_of(ready), event, seq=delivered, output=output)
        elif isinstance(decision, Refuse):
            self.log.warning("refused", request_id=request.id, code=decision.code, reason=decision.reason)
            letter = DeadLetter(ready.accepted.entry_id, encode(request), decision.reason, ready.accepted.lane)
            await self.intake.dead_letter(letter, acknowledge=False)  # the error event acknowledges it
            self.metrics.dead_letters.inc()
            if decision.code == ErrorCode.POISON_REQUEST:
                self.metrics.quarantined.inc()
            error = ErrorEvent(code=decision.code, message=f"the request was refused: {decision.reason}")
            self.publisher.finish(target_of(ready), error, seq=delivered, output=output)
        else:
            self._run(ready, decision)

    def _run(self, ready: Ready, decision: Run) -> None:
        request = ready.accepted.request
        relay = Relay(ready, self.publisher, self.log, self.metrics)
        if decision.replaces_own:  # we claimed our own request (our lease lapsed, say in an outage)
            self._fence_out(self.relays[request.id])  # the old run stops; this attempt resumes from its output
        resume = Resume(ready.delivered_ids, ready.delivered_text) if ready.delivered_ids else None
        try:
            urgent = ready.accepted.lane == "interactive"
            stream = self.engine.submit(engine_request(request, resume, suspect=decision.suspect, urgent=urgent))
        except EngineError as error:
            self.log.info("rejected", request_id=request.id, reason=str(error))
            relay.fail(error)
            return
        if resume is not None:
            self.log.info("resumed", request_id=request.id, delivered=len(resume.token_ids), attempt=ready.attempt)
        self.relays[request.id] = relay
        relay.task = asyncio.create_task(self._relay(relay, stream), name=request.id)

    async def _relay(self, relay: Relay, stream: DeltaStream) -> None:
        try:
            failure = await relay.run(stream)
            if failure is not None:
                await self._hand_back_failed(relay, failure)
        finally:
            if self.relays.get(relay.request.id) is relay:  # not a newer attempt of the same request
                del self.relays[relay.request.id]
            self._capacity.set()

    async def _hand_back_failed(self, relay: Relay, failure: EngineFailed) -> None:
        """After an engine failure: whoever claims the request next resumes it, counting the failure against it
        if it was implicated (which quarantines a request that keeps killing engines)."""
        reason = HAND_BACK_ENGINE_FAILURE if failure.implicated else HAND_BACK_DRAIN
        with contextlib.suppress(RedisError):
            await self.leases[relay.lane].hand_back([(relay.entry_id, relay.request.id)], reason)

    # ------------------------------------------------------------------ ownership

    async def _renew_leases(self) -> None:
        while await pause(self._finished, self.settings.lease_renew_s):
            for lane, leases in self.leases.items():
                relays = [relay for relay in self.relays.values() if relay.lane == lane and not relay.fenced]
                try:
                    lost = await leases.renew([relay.entry_id for relay in relays])
                except RedisError as error:
                    self.log.warning("renewing leases failed", error=redact(str(error)))
                    continue
                for relay in relays:
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
        letter = DeadLetter(target.entry_id, raw, f"Redis refused the request's result events: {message}", target.lane)
        chore = asyncio.create_task(self._dead_letter_quietly(letter))
        self._chores.add(chore)
        chore.add_done_callback(self._chores.discard)

    async def _dead_letter_quietly(self, letter: DeadLetter) -> None:
        try:
            await self.intake.dead_letter(letter)
            self.metrics.dead_letters.inc()
        except RedisError as error:  # its lease lapses and another worker meets the same refusal: bounded by deliveries
            self.log.warning("dead-lettering failed", entry=letter.entry_id.decode(), error=redact(str(error)))

    def _publish_failed(self, error: Exception) -> None:
        self.log.error("publishing results failed", error=redact(str(error)))

    # ------------------------------------------------------------------ drain

    async def _drain(self, hurry: asyncio.Event) -> None:
        """Stopped reading: lets requests in flight finish within the drain timeout (or until `hurry`), hands
        back the rest (claimable at once by any worker, which resumes them), and writes what is queued."""
        tasks = [relay.task for relay in self.relays.values() if relay.task is not None]
        if tasks:
            self.log.info("draining", in_flight=len(tasks), timeout_s=self.settings.drain_timeout_s)
            finished: asyncio.Future[Any] = asyncio.gather(*tasks, return_exceptions=True)
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
            for lane, leases in self.leases.items():
                with contextlib.suppress(RedisError):
                    await leases.hand_back([(relay.entry_id, relay.request.id) for relay in left if relay.lane == lane])
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(self.settings.drain_timeout_s, 1.0)):
                await self.publisher.wait_idle()
