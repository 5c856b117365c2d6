"""The worker: read -> start -> drain. Wires Redis, the intake, the engine and the publisher, and owns the
lifecycle of its helpers (heartbeat, cancel listener, lease renewal, publisher).

intake (XREADGROUP COUNT=free slots) -> admissions -> start | answer | dead letter
runs: engine.submit -> one relay task per request -> publisher; `Runs.stop` fences, cancels and hands back
cancel listener (pub/sub) -> engine.cancel          heartbeat -> {<queue>}:workers
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from typing import Any

from redis.asyncio import Redis

from client.backoff import jittered
from client.failover import REDIS_FAILURES, reraise_lost_cancellation
from client.protocol import LANES, ErrorCode, ErrorEvent, Lane
from client.scripts import KEEPING_LANES
from client.store import CONSUMER_GROUP, Scripts
from client.tracing import configure_from_env
from worker.cancels import CancelListener
from worker.config import Settings
from worker.engine import GenerationEngine
from worker.heartbeat import Heartbeat
from worker.intake import Answer, Decision, Letter, Policy, Start
from worker.lanes import pick_victim, read_steps, reserved_slots
from worker.leases import Claimed, Leases
from worker.logging import get_logger, redact
from worker.metrics import Metrics
from worker.partitions import Partition, Partitions, open_partitions
from worker.pausing import pause
from worker.publisher import Publisher, Target
from worker.runs import Reason, Run, Runs

READ_RETRY_S = 1.0  # a failed read of the queue is retried after about this long (jittered)
# A full worker with preemptible work and several partitions blocks on the last one's lanes this long per round at
# most (shared out), so an interactive request on another partition waits at most that for the next round. With one
# partition it blocks for the read block: the wait wakes on any new entry, and on a run's end.
_PREEMPTIVE_WAIT_MS = 100


class Worker:
    """One worker process's service loops over an already started engine."""

    def __init__(self, settings: Settings, engine: GenerationEngine, redis: Redis) -> None:
        self.settings = settings
        self.engine = engine
        self.redis = redis
        scripts = Scripts.register(redis)
        self.partitions = Partitions(open_partitions(redis, settings, scripts))
        self.keys = self.partitions.all[0].keys  # the queue's home: heartbeats, the fleet's rate
        self._reserved = reserved_slots(settings.max_running, settings.lane_share)
        self.publisher = Publisher(
            redis,
            self.keys,
            partitions=settings.queue_partitions,
            on_error=self._publish_failed,
            on_fenced=self._fenced,
            on_failed=self._events_refused,
            on_behind=self._stream_behind,
            scripts=scripts,
            reply_maxlen=settings.reply_maxlen,
            wait_replicas=settings.redis_wait_replicas,
            usage_ttl_s=settings.usage_ttl_days * 86400,
        )
        self.log = get_logger(worker=settings.worker_id, queue=settings.queue)
        self.metrics = Metrics(engine, settings.queue, settings.model)
        self.metrics.watch_publisher(self.publisher.stats)
        self.metrics.watch_affinity(lambda: sum((p.intake.routed for p in self.partitions.all), Counter()))
        self.heartbeat = Heartbeat(
            redis, self.keys, settings, engine, self.metrics, lambda: self.publisher.stats.tokens, self.log
        )
        self.runs = Runs(engine, self.publisher, self.log, self.metrics, self.partitions.all)
        self.cancels = [
            CancelListener(redis, partition.keys, engine, functools.partial(self.runs.running_in, partition), self.log)
            for partition in self.partitions.all
        ]
        self._next_claim = 0.0
        self._full_reported: float | None = None  # when cache affinity last heard this worker is full
        # Helpers stop on this flag, not by cancellation (see `worker.pausing`).
        self._finished = asyncio.Event()
        self._helper_failure: BaseException | None = None

    async def run(self, stop: asyncio.Event, hurry: asyncio.Event | None = None) -> None:
        """Serves until `stop` is set; then drains (until `hurry` is set or the drain timeout) and hands back."""
        await self._ensure_groups()
        configure_from_env("llmq-worker").report(self.log, "tracing on", "tracing not configured")
        if self.settings.metrics_port:
            try:
                self.metrics.serve(self.settings.metrics_port, self.settings.metrics_address)
            except OSError as error:  # e.g. a second worker on this host with the same port
                self.log.warning("metrics endpoint not started", port=self.settings.metrics_port, error=str(error))
        helpers = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            *(
                asyncio.create_task(listener.run(self._finished), name=f"cancels-{index}")
                for index, listener in enumerate(self.cancels)
            ),
            asyncio.create_task(self.heartbeat.run(self._finished), name="heartbeat"),
            asyncio.create_task(self._renew_leases(), name="leases"),
        ]
        for task in helpers:
            task.add_done_callback(functools.partial(self._helper_ended, stop))
        self.log.info("worker ready", model=self.settings.model, kv_blocks=self.engine.stats().kv_blocks_total)
        try:
            await self._read_until(stop)
            await self._leave_affinity()
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
                    await self.redis.hdel(self.keys.prefix_caches, self.settings.worker_id)
                    await self._leave_group()
            self.log.info("worker stopped")
        if self._helper_failure is not None:
            raise RuntimeError("a worker loop died; see the log") from self._helper_failure

    def _helper_ended(self, stop: asyncio.Event, task: asyncio.Task[None]) -> None:
        """A helper that ends before the worker leaves it unable to publish, renew its leases or hear cancels:
        rather than serve half-blind, the worker drains and exits with an error, and its supervisor restarts it."""
        if self._finished.is_set() or task.cancelled() or task.exception() is None:
            return
        self._helper_failure = task.exception()
        self.log.error("worker loop died; stopping", task=task.get_name(), error=repr(self._helper_failure))
        stop.set()

    async def _leave_group(self) -> None:
        """Removes this consumer from each lane's group where it holds nothing, so restarts leave no trail."""
        for stream in (stream for partition in self.partitions.all for stream in partition.keys.lanes.values()):
            mine = await self.redis.xpending_range(
                stream, CONSUMER_GROUP, min="-", max="+", count=1, consumername=self.settings.worker_id
            )
            if not mine:
                await self.redis.xgroup_delconsumer(stream, CONSUMER_GROUP, self.settings.worker_id)

    async def _report_full(self) -> None:
        """Full: cache affinity assigns this worker nothing, and still counts it live (so its prefixes stay here).
        Said when it fills up, then a few times per live period, not at every look for a freed slot."""
        now = asyncio.get_running_loop().time()
        if self._full_reported is not None and now - self._full_reported < self.settings.routing.live_ms / 4000:
            return
        self._full_reported = now
        try:
            for partition in self.partitions.all:
                await partition.intake.report_full()
        except REDIS_FAILURES as error:
            self.log.warning("reporting a full engine failed", error=redact(str(error)))

    async def _leave_affinity(self) -> None:
        """Stopping: nothing more is assigned to this worker; what was is taken by others after the wait."""
        for partition in self.partitions.all:
            with contextlib.suppress(*REDIS_FAILURES):
                await partition.intake.leave()

    async def _ensure_groups(self) -> None:
        for partition in self.partitions.all:
            await partition.intake.ensure_group()

    def _all_leases(self) -> list[Leases]:
        return [partition.leases[lane] for partition in self.partitions.all for lane in LANES]

    # ------------------------------------------------------------------ read

    def free_slots(self) -> int:
        if self.publisher.backlog > self.settings.max_buffered_events:
            return 0  # Redis is away and we hold enough undelivered output: take nothing new
        return self.engine.free_slots()

    async def _read_until(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            reraise_lost_cancellation()  # a worker embedded in a program is stopped by cancelling its task, too
            self.runs.freed.clear()  # before looking: a run that ends from here on wakes the waits below
            free = self.free_slots()
            if free == 0:
                await self._report_full()
            if free == 0 and self.settings.preemption and self._preemptible() is not None:
                try:
                    await self._preempt_for_interactive()
                except REDIS_FAILURES as error:
                    self.log.warning("reading the interactive lane failed", error=redact(str(error)))
                    await asyncio.sleep(jittered(READ_RETRY_S))
                continue
            if free == 0:  # read nothing an idle worker could run sooner
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.read_block_ms / 1000):
                        await self.runs.freed.wait()
                continue
            self._full_reported = None
            try:
                free -= await self._claim(free)
                await self._read_new(free)
            except REDIS_FAILURES as error:  # Redis unreachable: keep serving what is in flight, retry shortly
                self.log.warning("reading the queue failed", error=redact(str(error)))
                if "NOGROUP" in str(error):  # Redis came back without its data: nothing is read until the group is
                    with contextlib.suppress(*REDIS_FAILURES):
                        await self._ensure_groups()
                await asyncio.sleep(jittered(READ_RETRY_S))

    async def _read_new(self, free: int) -> None:
        """New requests for up to `free` slots. One partition: one read of its lanes in order, waiting up to the read
        block when there are none. Several: lane by lane (so an interactive request in any partition comes before
        batch work in another), each lane from every partition in this round's order; then, if nothing was read,
        a wait on the round's last partition for the read block shared out over the partitions, so a request on
        any partition waits at most that share before an idle worker reads it."""
        order = self.partitions.rotation()
        # With only kept slots free, what waits may be a busy tenant's, for which a run's end makes room.
        freed = self.runs.freed if free <= self.settings.idle_tenant_slots else None
        if len(order) == 1:
            steps = read_steps(free, self.runs.by_lane(), self._reserved)
            decisions = await order[0].intake.read(free, steps, self.settings.read_block_ms, freed=freed)
            await self._admit(order[0], decisions)
            return
        found, drained = False, set()  # (partition, lane) pairs that gave less than asked: empty for this round
        for lane, wanted in read_steps(free, self.runs.by_lane(), self._reserved):
            for partition in order:
                asked = min(wanted, free)
                if asked <= 0:
                    break
                if (partition.index, lane) in drained:
                    continue
                decisions = await partition.intake.read(free, [(lane, asked)], None)
                if len(decisions) < asked:
                    drained.add((partition.index, lane))
                wanted, free = wanted - len(decisions), free - len(decisions)
                found = found or bool(decisions)
                await self._admit(partition, decisions)
        if not found and free > 0:
            steps = read_steps(free, self.runs.by_lane(), self._reserved)
            block_ms = max(1, self.settings.read_block_ms // len(order))
            await self._admit(order[-1], await order[-1].intake.read(free, steps, block_ms, freed=freed))

    async def _claim(self, free: int) -> int:
        """Resumes requests this worker preempted and takes over those whose worker died (idle past the lease)
        or that were handed back; returns how many were claimed."""
        taken = 0
        for (partition, lane), entry_ids in self.runs.preempted.items():  # first what this worker preempted
            room = self._room(free - taken, lane)
            resumable, self.runs.preempted[partition, lane] = entry_ids[:room], entry_ids[room:]
            taken += await self._start_claimed(partition, lane, await partition.leases[lane].reclaim(resumable))
        now = asyncio.get_running_loop().time()
        if now < self._next_claim:
            return taken
        self._next_claim = now + self.settings.claim_interval_s
        order = self.partitions.rotation()
        for lane in LANES:  # highest lane first
            for partition in order:
                room = self._room(free - taken, lane)
                if room > 0:
                    taken += await self._start_claimed(partition, lane, await partition.leases[lane].claim(room))
        return taken

    def _room(self, free: int, lane: Lane) -> int:
        """The free slots a claimed or resumed request of `lane` may take: a request moved to run already belongs to
        a tenant with something running, so not the kept ones (`LLMQ_IDLE_TENANT_SLOTS`) but on the lanes that
        ignore them."""
        return max(0, free - self.settings.idle_tenant_slots) if lane in KEEPING_LANES else free

    async def _start_claimed(self, partition: Partition, lane: Lane, claimed: list[Claimed]) -> int:
        if claimed:
            self.metrics.claims.inc(len(claimed))
            self.log.info("claimed", lane=lane, count=len(claimed), entries=[c.entry_id.decode() for c in claimed])
            decisions, deliveries = partition.intake.decide_claimed(lane, claimed)
            await self._admit(partition, decisions, deliveries)
        return len(claimed)

    def _preemptible(self) -> Run | None:
        return pick_victim(self.runs.live(), self.runs.by_lane(), self._reserved, self.settings.max_preemptions)

    async def _preempt_for_interactive(self) -> None:
        """A full engine running preemptible work: wait (briefly, and no longer than until a run ends) for an
        interactive request and take it (so no other worker preempts for it as well). Only once the engine has
        accepted it and it waits for a slot (not refused, expired or cancelled), cancel the victim `pick_victim`
        names, whose slot goes to the urgent request at once, then hand the victim back once its output is
        published."""
        order = self.partitions.rotation()
        block_ms = self.settings.read_block_ms
        if len(order) > 1:
            block_ms = max(1, min(block_ms, _PREEMPTIVE_WAIT_MS) // len(order))
        for index, partition in enumerate(order):
            block = block_ms if index == len(order) - 1 else None
            decisions = await partition.intake.read(
                1, [("interactive", 1)], block_ms=block, report=False, freed=self.runs.freed
            )
            if decisions:
                break
        else:
            return
        await self._admit(partition, decisions)  # queued in the engine (urgent: first in line), or answered
        victim = self._preemptible()  # again: the wait may have changed what runs
        if victim is None or self.engine.stats().waiting == 0:
            return  # it runs already, was answered without running, or waits here for the next free slot
        # writes nothing more; whoever claims it resumes from what is published (first this worker)
        await self.runs.stop(victim, reason=Reason.PREEMPTED, for_entry=decisions[0].entry_id)

    # ------------------------------------------------------------------ admit

    async def _admit(
        self, partition: Partition, decisions: list[Decision], deliveries: dict[bytes, int] | None = None
    ) -> None:
        """Does what admission decides for each entry read from `partition`: start it, answer it, dead-letter it."""
        settings = self.settings
        policy = Policy(
            self.engine.eos_token_ids, settings.max_deliveries, settings.max_engine_failures, settings.max_hand_backs
        )
        admissions = partition.intake.admissions(decisions, policy, deliveries, running_here=self.runs.__contains__)
        async with contextlib.aclosing(admissions):
            async for admission in admissions:
                match admission:
                    case Start(ready=ready):
                        heard = self.cancels[ready.accepted.partition].heard(ready.accepted.request.id)
                        self.runs.start(admission, cancelled=heard)
                    case Answer():
                        self._answer(admission)
                    case Letter():
                        await self._dead_letter(partition, admission)

    def _answer(self, answer: Answer) -> None:
        event = answer.event
        if answer.rejected and isinstance(event, ErrorEvent):
            self.log.info("rejected", request_id=answer.target.request_id, code=event.code, reason=event.message)
        self.publisher.finish(answer.target, event, seq=answer.seq, output=answer.output)

    async def _dead_letter(self, partition: Partition, letter: Letter) -> None:
        answer = letter.answer  # a request refused for good: its reader hears why
        code = answer.event.code if answer is not None and isinstance(answer.event, ErrorEvent) else None
        if answer is None:
            self.log.warning("dead letter", entry=letter.entry_id.decode(), reason=letter.reason)
        else:
            self.log.warning("refused", request_id=answer.target.request_id, code=code, reason=letter.reason)
        await partition.intake.dead_letter(letter)  # with an answer, that answer acknowledges the entry
        self.metrics.dead_letters.inc()
        if answer is not None:
            if code == ErrorCode.POISON_REQUEST:
                self.metrics.quarantined.inc()
            self._answer(answer)

    # ------------------------------------------------------------------ ownership

    async def _renew_leases(self) -> None:
        while await pause(self._finished, self.settings.lease_renew_s):
            for leases in self._all_leases():
                runs = self.runs.holding(leases)
                try:
                    lost = await leases.renew([run.entry_id for run in runs])
                except REDIS_FAILURES as error:
                    self.log.warning("renewing leases failed", error=redact(str(error)))
                    continue
                self.runs.stop(*(run for run in runs if run.entry_id in lost), reason=Reason.LOST)

    def _fenced(self, request_id: str, attempt: int) -> None:
        """The publisher's report: a write of `attempt` was refused. A newer attempt of ours runs on."""
        run = self.runs.get(request_id)
        if run is not None and run.target.attempt == attempt:
            self.runs.stop(run, reason=Reason.LOST)

    def _stream_behind(self, target: Target) -> None:
        """The publisher's report: this request's result stream holds fewer tokens than its next event follows, as
        when a failover lost the last writes before the primary died: it is handed back at once."""
        run = self.runs.writing(target)
        if run is not None:
            self.runs.stop(run, reason=Reason.BEHIND)

    def _events_refused(self, target: Target, message: str) -> None:
        """The publisher's report: Redis refused this request's events (its keys alone: a result stream someone
        overwrote with another type, say). Its reader cannot be answered there: stop it and dead-letter it."""
        run = self.runs.writing(target)
        if run is not None:
            self.runs.stop(run, reason=Reason.REFUSED)
        self.log.error("result stream refused; dead-lettered", request_id=target.request_id, error=redact(message))
        reason = f"Redis refused the request's result events: {message}"
        self.runs.later(self._dead_letter_refused(self.partitions.all[target.partition], target, reason))

    async def _dead_letter_refused(self, partition: Partition, target: Target, reason: str) -> None:
        """The letter keeps the entry as it was, read from its lane, where it waits (pending) until the letter
        takes it off: a request refused before it ran (its keys refused at start) has no run to copy it from."""
        try:
            raw = await partition.intake.entry(target.entry_id, target.lane)
            letter = Letter(target.entry_id, raw, reason, target.lane, tenant=target.tenant, cost=target.cost)
            await partition.intake.dead_letter(letter)
            self.metrics.dead_letters.inc()
        except REDIS_FAILURES as error:  # its lease lapses; another worker meets the same refusal: bounded
            self.log.warning("dead-lettering failed", entry=target.entry_id.decode(), error=redact(str(error)))

    def _publish_failed(self, error: Exception) -> None:
        self.log.error("publishing results failed", error=redact(str(error)))

    # ------------------------------------------------------------------ drain

    async def _drain(self, hurry: asyncio.Event) -> None:
        """Stopped reading: lets requests in flight finish within the drain timeout (or until `hurry`), hands
        back the rest (claimable at once by any worker, which resumes them), and writes what is queued."""
        tasks = self.runs.tasks()
        if tasks:
            self.log.info("draining", in_flight=len(tasks), timeout_s=self.settings.drain_timeout_s)
            finished: asyncio.Future[Any] = asyncio.gather(*tasks, return_exceptions=True)
            hurried = asyncio.ensure_future(hurry.wait())
            await asyncio.wait(
                [finished, hurried], timeout=self.settings.drain_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            hurried.cancel()
        left = list(self.runs)
        if left:
            self.log.warning("handing back unfinished requests", count=len(left))
            await self.runs.stop(*left, reason=Reason.SHUTDOWN)  # whoever claims them resumes from what is published
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(self.settings.drain_timeout_s, 1.0)):
                await self.publisher.wait_idle()
