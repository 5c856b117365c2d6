"""The requests a worker runs, in one table: each one's relay, lease, fence state, lane, partition and task, and
the one place that stops one, `Runs.stop`, which pairs the fence, the engine's cancel and the hand-back as its
`Reason` says (`PAIRINGS`).

Fenced: the request writes nothing more and its lease is renewed no more (whoever claims it resumes from what it
published). Cancelled: the engine stops generating it. Handed back: claimable at once by any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from structlog.typing import FilteringBoundLogger

from client.failover import REDIS_FAILURES
from client.protocol import LANES, Lane
from client.scripts import HandBackReason
from worker.adapter import engine_request, prompt_event
from worker.engine import EngineError, EngineFailed, GenerationEngine, OutputDelta, Resume, ScoredPrompt
from worker.engine.interface import DeltaStream
from worker.intake import Ready, Start
from worker.leases import Leases
from worker.metrics import Metrics
from worker.partitions import Partition
from worker.publisher import Publisher, Target
from worker.relay import Relay


class Reason(enum.Enum):
    """Why a running request stops before its end."""

    PREEMPTED = "preempted"  # its slot goes to an interactive request: handed back, and resumed here first
    LOST = "lost ownership"  # another attempt owns it: its lease was lost, a write fenced, or we claimed it again
    BEHIND = "stream behind"  # its result stream lost writes (a failover): writing on would leave a gap
    REFUSED = "events refused"  # Redis refuses its events: the worker dead-letters it
    SHUTDOWN = "shutdown"  # still running when the drain ends: any worker resumes it
    ENGINE_FAILURE = "engine failure"  # the engine failed with it implicated: the failure counts against it
    ENGINE_RESTART = "engine restart"  # the engine failed under it, not implicated: nothing counts against it
    CANCELLED = "cancelled"  # its cancel came before it started: the engine ends it as cancelled


@dataclass(frozen=True, slots=True)
class Pairing:
    fence: bool  # write nothing more, renew nothing more
    cancel: bool  # the engine stops generating it
    hand_back: HandBackReason | None  # made claimable at once, counted as this; None: not handed back


PAIRINGS: dict[Reason, Pairing] = {
    Reason.PREEMPTED: Pairing(fence=True, cancel=True, hand_back=HandBackReason.PREEMPTION),
    Reason.LOST: Pairing(fence=True, cancel=True, hand_back=None),  # not ours to hand back
    # whoever claims it (this worker too) resumes from what the stream holds; greedy and seeded requests
    # regenerate the same tokens
    Reason.BEHIND: Pairing(fence=True, cancel=True, hand_back=HandBackReason.DRAIN),
    Reason.REFUSED: Pairing(fence=True, cancel=True, hand_back=None),  # dead-lettered instead
    Reason.SHUTDOWN: Pairing(fence=True, cancel=False, hand_back=HandBackReason.DRAIN),  # the engine stops after
    Reason.ENGINE_FAILURE: Pairing(fence=False, cancel=False, hand_back=HandBackReason.ENGINE_FAILURE),  # ended
    Reason.ENGINE_RESTART: Pairing(fence=False, cancel=False, hand_back=HandBackReason.DRAIN),
    Reason.CANCELLED: Pairing(fence=False, cancel=True, hand_back=None),  # it ends with `done` (cancelled)
}


class Run(Relay):
    """One running request: its relay (which publishes its output until it ends or is fenced), its partition and
    lease, and its task."""

    def __init__(
        self,
        ready: Ready,
        partition: Partition,
        publisher: Publisher,
        log: FilteringBoundLogger,
        metrics: Metrics,
    ) -> None:
        super().__init__(ready, publisher, log, metrics, partition.keys)
        self.partition = partition
        self.task: asyncio.Task[None] | None = None

    @property
    def leases(self) -> Leases:
        return self.partition.leases[self.lane]

    async def run(self, stream: DeltaStream) -> EngineFailed | None:
        """Relays the stream (`Relay.run`), publishing a scored prompt ahead of the delta that carries it, so the
        prompt's event precedes the request's first token."""
        return await super().run(_PromptTap(stream, self._publish_prompt))

    def _publish_prompt(self, prompt: ScoredPrompt) -> None:
        if not self.fenced:
            self._publisher.prompt(self.target, prompt_event(prompt), seq=self.tokens)


class _PromptTap:
    """A delta stream that hands each delta's scored prompt to `publish` before passing the delta on."""

    def __init__(self, stream: DeltaStream, publish: Callable[[ScoredPrompt], None]) -> None:
        self.prompt_tokens = stream.prompt_tokens
        self._deltas = aiter(stream)
        self._publish = publish

    def __aiter__(self) -> _PromptTap:
        return self

    async def __anext__(self) -> OutputDelta:
        delta = await anext(self._deltas)
        if delta.prompt is not None:
            self._publish(delta.prompt)
        return delta


class Runs:
    """The requests this worker runs, by request id (one run each: a newer attempt replaces an older one)."""

    def __init__(
        self,
        engine: GenerationEngine,
        publisher: Publisher,
        log: FilteringBoundLogger,
        metrics: Metrics,
        partitions: list[Partition],
    ) -> None:
        self._engine = engine
        self._publisher = publisher
        self._log = log
        self._metrics = metrics
        self._partitions = partitions
        self._runs: dict[str, Run] = {}
        self.freed = asyncio.Event()  # set whenever a run ends: a slot may be free
        # handed back here, to resume here: per partition and lane, highest lane first
        self.preempted: dict[tuple[Partition, Lane], list[bytes]] = {
            (partition, lane): [] for lane in LANES for partition in partitions
        }
        self._chores: set[asyncio.Task[None]] = set()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[Run]:
        return iter(list(self._runs.values()))

    def get(self, request_id: str) -> Run | None:
        return self._runs.get(request_id)

    def writing(self, target: Target) -> Run | None:
        """The run whose events go to `target` (not an older or newer attempt of its request)."""
        run = self._runs.get(target.request_id)
        return run if run is not None and run.target == target else None

    def live(self) -> list[Run]:
        """The runs not fenced: those that still write, hold their lease and take a slot of their lane."""
        return [run for run in self._runs.values() if not run.fenced]

    def by_lane(self) -> dict[Lane, int]:
        return dict(Counter(run.lane for run in self.live()))

    def holding(self, leases: Leases) -> list[Run]:
        """The live runs under `leases` (one lane of one partition)."""
        return [run for run in self.live() if run.leases is leases]

    def running_in(self, partition: Partition) -> list[str]:
        """Ids of the requests this worker runs from `partition`."""
        return [request_id for request_id, run in self._runs.items() if run.partition is partition]

    def tasks(self) -> list[asyncio.Task[None]]:
        return [run.task for run in self._runs.values() if run.task is not None]

    def later(self, chore: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Runs `chore` in a task kept until it ends (for work that a callback cannot wait for)."""
        task = asyncio.create_task(chore)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)
        return task

    # ------------------------------------------------------------------ start

    def start(self, start: Start, *, cancelled: bool = False) -> None:
        """Submits an admitted request to the engine and relays its output in a task of its own (`cancelled`: a
        cancel for it came after its mark was read, before this start)."""
        ready = start.ready
        request = ready.accepted.request
        run = Run(ready, self._partitions[ready.accepted.partition], self._publisher, self._log, self._metrics)
        if start.replaces_own:  # we claimed our own request (our lease lapsed, say in an outage)
            self.stop(self._runs[request.id], reason=Reason.LOST)  # the old run stops; this one resumes its output
        resume = Resume(ready.delivered_ids, ready.delivered_text) if ready.delivered_ids else None
        try:
            urgent = ready.accepted.lane == "interactive"
            stream = self._engine.submit(engine_request(request, resume, suspect=start.suspect, urgent=urgent))
        except EngineError as error:
            self._log.info("rejected", request_id=request.id, reason=str(error))
            run.fail(error)
            return
        if cancelled:
            self.stop(run, reason=Reason.CANCELLED)
        if resume is not None:
            self._log.info("resumed", request_id=request.id, delivered=len(resume.token_ids), attempt=ready.attempt)
        self._runs[request.id] = run
        run.task = asyncio.create_task(self._serve(run, stream), name=request.id)

    async def _serve(self, run: Run, stream: DeltaStream) -> None:
        try:
            failure = await run.run(stream)
            if failure is not None:  # whoever claims it next resumes it
                await self.stop(run, reason=Reason.ENGINE_FAILURE if failure.implicated else Reason.ENGINE_RESTART)
        finally:
            if self._runs.get(run.request.id) is run:  # not a newer attempt of the same request
                del self._runs[run.request.id]
            self.freed.set()

    # ------------------------------------------------------------------ stop

    def stop(self, *runs: Run, reason: Reason, for_entry: bytes = b"") -> Awaitable[None]:
        """Stops `runs` for `reason`: fences and cancels them now, as `PAIRINGS` says, and returns the hand-back,
        if the reason has one, running in a task (the loops wait for it; the publisher's reports cannot). A
        preempted run's hand-back waits (briefly) for its output to be written first and fails loudly, so the read
        loop retries; the others' fail quietly, the lease then lapsing. `for_entry`: the interactive entry a
        preemption makes room for (logged)."""
        pairing = PAIRINGS[reason]
        if reason is Reason.LOST:
            runs = tuple(run for run in runs if not run.fenced)  # fenced already: stopped once, by whatever reason
        for run in runs:
            if pairing.fence:
                run.fenced = True
            if pairing.cancel:
                self._engine.cancel(run.request.id)
            self._say(run, reason, for_entry)
        if pairing.hand_back is None or not runs:
            nothing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            nothing.set_result(None)
            return nothing
        return self.later(self._hand_back(runs, reason, pairing.hand_back))

    def _say(self, run: Run, reason: Reason, for_entry: bytes) -> None:
        request_id = run.request.id
        if reason is Reason.PREEMPTED:
            self._metrics.preempted(run.lane)
            self._log.info(
                "preempted",
                request_id=request_id,
                lane=run.lane,
                tokens=run.tokens,
                preemptions=run.preemptions + 1,
                for_entry=for_entry.decode(),
            )
        elif reason is Reason.LOST:
            self._log.warning("lost ownership; stopped", request_id=request_id, attempt=run.target.attempt)
        elif reason is Reason.BEHIND:
            self._log.warning("result stream behind (a failover lost writes); handed back", request_id=request_id)

    async def _hand_back(self, runs: tuple[Run, ...], reason: Reason, code: HandBackReason) -> None:
        if reason is Reason.PREEMPTED:  # its last tokens first, so that whoever resumes it reads them
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._publisher.wait_idle()
        groups: dict[tuple[Partition, Lane], list[Run]] = {}
        for run in runs:
            groups.setdefault((run.partition, run.lane), []).append(run)
        for (partition, lane), group in groups.items():
            entries = [(run.entry_id, run.request.id) for run in group]
            if reason is Reason.PREEMPTED:
                await partition.leases[lane].hand_back(entries, code)
                self.preempted[partition, lane].extend(run.entry_id for run in group)
                continue
            with contextlib.suppress(*REDIS_FAILURES):  # else its lease lapses and it is claimed all the same
                await partition.leases[lane].hand_back(entries, code)
