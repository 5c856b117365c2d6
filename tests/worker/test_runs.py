"""The runs table on plain objects (no Redis, no engine): `Runs.stop` pairs the fence, the cancel and the hand-back
as each reason says, and `Runs.start` submits, relays and forgets a request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from unittest.mock import MagicMock

import pytest
import structlog
from structlog.testing import capture_logs

from client.protocol import LANES, GenerateRequest, Lane, ms_now
from client.scripts import HandBackReason
from worker.engine import EngineFailed, OutputDelta, RequestRejected
from worker.intake import Accepted, Ready, Start
from worker.partitions import Partition
from worker.publisher import Target
from worker.runs import PAIRINGS, Reason, Run, Runs


class FakeLeases:
    def __init__(self, fail: bool = False) -> None:
        self.handed: list[tuple[list[tuple[bytes, str]], HandBackReason]] = []
        self.fail = fail

    async def hand_back(self, entries: list[tuple[bytes, str]], reason: HandBackReason = HandBackReason.DRAIN) -> int:
        if self.fail:
            raise ConnectionError("Redis is away")
        self.handed.append((entries, reason))
        return len(entries)


class FakeEngine:
    def __init__(self, stream: Any = None) -> None:
        self.cancelled: list[str] = []
        self.submitted: list[Any] = []
        self.stream = stream

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True

    def submit(self, request: Any) -> Any:
        if isinstance(self.stream, Exception):
            raise self.stream
        self.submitted.append(request)
        return self.stream


class FakePublisher:
    def __init__(self) -> None:
        self.finished: list[tuple[Target, Any]] = []
        self.waited = 0

    def finish(self, target: Target, event: Any, seq: int = 0, output: Any = ("", [])) -> None:
        self.finished.append((target, event))

    def tokens(self, target: Target, event: Any) -> None:
        pass

    async def wait_idle(self) -> None:
        self.waited += 1


def partition(index: int = 0, fail: bool = False) -> Partition:
    leases: dict[Lane, Any] = {lane: FakeLeases(fail) for lane in LANES}
    return Partition(index, keys=None, intake=None, leases=leases)  # type: ignore[arg-type]


def ready(request_id: str = "r", lane: Lane = "batch", index: int = 0, delivered: list[int] | None = None) -> Ready:
    request = GenerateRequest(id=request_id, input_ids=[3], params={"max_new_tokens": 5}, submitted=ms_now())
    accepted = Accepted(f"{len(request_id)}-0".encode(), request, lane=lane, partition=index)
    return Ready(accepted, 2, False, delivered or [], "", False, preemptions=1)


class Table:
    """A `Runs` on fakes, with its captured log lines."""

    def __init__(self, partitions: list[Partition] | None = None, stream: Any = None) -> None:
        self.partitions = partitions or [partition()]
        self.engine = FakeEngine(stream)
        self.publisher = FakePublisher()
        self.metrics = MagicMock()
        self.runs = Runs(
            self.engine,  # type: ignore[arg-type]
            self.publisher,  # type: ignore[arg-type]
            structlog.get_logger(),
            self.metrics,
            self.partitions,
        )

    def run(self, request_id: str = "r", lane: Lane = "batch", index: int = 0) -> Run:
        item = ready(request_id, lane, index, delivered=[7, 8])
        publisher: Any = self.publisher
        return Run(item, self.partitions[index], publisher, structlog.get_logger(), self.metrics)

    def handed(self, index: int = 0, lane: Lane = "batch") -> list[Any]:
        leases: Any = self.partitions[index].leases[lane]
        return leases.handed


def events(logs: list[dict[str, Any]]) -> list[str]:
    return [line["event"] for line in logs]


def test_every_reason_has_a_pairing() -> None:
    assert set(PAIRINGS) == set(Reason)


async def test_preempted_is_fenced_cancelled_and_handed_back_after_its_output_to_resume_here_first() -> None:
    table = Table()
    with capture_logs() as logs:
        run = table.run()
        await table.runs.stop(run, reason=Reason.PREEMPTED, for_entry=b"9-0")
    assert run.fenced and table.engine.cancelled == ["r"] and table.publisher.waited == 1
    assert table.handed() == [([(b"1-0", "r")], HandBackReason.PREEMPTION)]
    assert table.runs.preempted[table.partitions[0], "batch"] == [b"1-0"]
    table.metrics.preempted.assert_called_once_with("batch")
    (line,) = logs
    assert line["event"] == "preempted" and line["for_entry"] == "9-0" and line["preemptions"] == 2
    assert line["tokens"] == 2 and line["lane"] == "batch" and line["log_level"] == "info"


async def test_a_failed_preemption_hand_back_reaches_the_read_loop_and_is_not_remembered() -> None:
    table = Table([partition(fail=True)])
    run = table.run()
    with pytest.raises(ConnectionError):
        await table.runs.stop(run, reason=Reason.PREEMPTED, for_entry=b"9-0")
    assert run.fenced and table.runs.preempted[table.partitions[0], "batch"] == []


async def test_lost_ownership_stops_once_and_hands_nothing_back() -> None:
    table = Table()
    with capture_logs() as logs:
        run = table.run()
        await table.runs.stop(run, reason=Reason.LOST)
        await table.runs.stop(run, reason=Reason.LOST)  # a second report of the same loss
    assert run.fenced and table.engine.cancelled == ["r"] and table.handed() == []
    assert events(logs) == ["lost ownership; stopped"] and logs[0]["attempt"] == 2


async def test_a_stream_behind_is_fenced_cancelled_and_handed_back_quietly() -> None:
    table = Table()
    with capture_logs() as logs:
        run = table.run()
        await table.runs.stop(run, reason=Reason.BEHIND)
    assert run.fenced and table.engine.cancelled == ["r"]
    assert table.handed() == [([(b"1-0", "r")], HandBackReason.DRAIN)]
    assert events(logs) == ["result stream behind (a failover lost writes); handed back"]
    assert table.runs.preempted[table.partitions[0], "batch"] == []

    failing = Table([partition(fail=True)])
    await failing.runs.stop(failing.run(), reason=Reason.BEHIND)  # its lease lapses instead: nothing raised


async def test_refused_events_fence_and_cancel_and_leave_the_dead_letter_to_the_worker() -> None:
    table = Table()
    with capture_logs() as logs:
        run = table.run()
        await table.runs.stop(run, reason=Reason.REFUSED)
    assert run.fenced and table.engine.cancelled == ["r"] and table.handed() == [] and logs == []


async def test_shutdown_fences_without_cancelling_and_hands_back_each_lease_in_one_call() -> None:
    table = Table([partition(0), partition(1)])
    runs = [table.run("a"), table.run("bb"), table.run("ccc", "default"), table.run("dddd", index=1)]
    with capture_logs() as logs:
        await table.runs.stop(*runs, reason=Reason.SHUTDOWN)
    assert all(run.fenced for run in runs) and table.engine.cancelled == [] and logs == []
    assert table.handed(0) == [([(b"1-0", "a"), (b"2-0", "bb")], HandBackReason.DRAIN)]
    assert table.handed(0, "default") == [([(b"3-0", "ccc")], HandBackReason.DRAIN)]
    assert table.handed(1) == [([(b"4-0", "dddd")], HandBackReason.DRAIN)]


@pytest.mark.parametrize(
    ("reason", "counted"),
    [(Reason.ENGINE_FAILURE, HandBackReason.ENGINE_FAILURE), (Reason.ENGINE_RESTART, HandBackReason.DRAIN)],
)
async def test_an_engine_failure_hands_back_what_already_ended(reason: Reason, counted: HandBackReason) -> None:
    table = Table()
    run = table.run()
    await table.runs.stop(run, reason=reason)
    assert not run.fenced and table.engine.cancelled == []
    assert table.handed() == [([(b"1-0", "r")], counted)]


async def test_a_cancel_heard_before_the_start_only_cancels() -> None:
    table = Table()
    run = table.run()
    await table.runs.stop(run, reason=Reason.CANCELLED)
    assert not run.fenced and table.engine.cancelled == ["r"] and table.handed() == []


class Failing:
    prompt_tokens = 1

    def __init__(self, implicated: bool) -> None:
        self.implicated = implicated

    async def __aiter__(self) -> AsyncIterator[OutputDelta]:
        yield OutputDelta("r", token_ids=[5], text="x")
        raise EngineFailed("the engine died", implicated=self.implicated)


@pytest.mark.parametrize(("implicated", "counted"), [(True, HandBackReason.ENGINE_FAILURE), (False, None)])
async def test_a_started_request_that_the_engine_fails_is_handed_back_and_forgotten(
    implicated: bool, counted: HandBackReason | None
) -> None:
    table = Table(stream=Failing(implicated))
    table.runs.start(Start(ready()), cancelled=True)
    assert "r" in table.runs and len(table.runs) == 1 and table.engine.cancelled == ["r"]
    (run,) = table.runs
    assert table.runs.writing(run.target) is run and table.runs.running_in(table.partitions[0]) == ["r"]
    assert table.runs.by_lane() == {"batch": 1} and table.runs.holding(table.partitions[0].leases["batch"]) == [run]
    await asyncio.wait_for(table.runs.freed.wait(), 5)
    assert "r" not in table.runs and not table.runs
    assert table.handed() == [([(b"1-0", "r")], counted or HandBackReason.DRAIN)]


async def test_a_request_the_engine_rejects_is_answered_and_never_runs() -> None:
    table = Table(stream=RequestRejected("the prompt is empty"))
    with capture_logs() as logs:
        table.runs.start(Start(ready()))
    assert not table.runs and events(logs) == ["rejected"]
    ((target, event),) = table.publisher.finished
    assert target.request_id == "r" and target.attempt == 2 and event.message == "the prompt is empty"


async def test_claiming_its_own_request_stops_the_older_run_and_keeps_the_newer() -> None:
    table = Table(stream=Failing(implicated=False))
    table.runs.start(Start(ready()))
    (older,) = table.runs
    with capture_logs() as logs:
        table.runs.start(Start(ready(), replaces_own=True))
    (newer,) = table.runs
    assert newer is not older and older.fenced and not newer.fenced
    assert events(logs) == ["lost ownership; stopped"]
    await asyncio.gather(*(run.task for run in (older, newer) if run.task is not None))
    assert not table.runs
