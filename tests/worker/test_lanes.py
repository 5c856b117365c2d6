"""Lanes: the read order and the lower lanes' share (pure, and on a worker with the scripted engine), and
lossless preemption of batch work for interactive requests on a real tiny model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from redis.exceptions import ResponseError

from client import AsyncClient, QueueFull
from client.errors import InvalidRequest
from client.protocol import Lane
from client.store import CONSUMER_GROUP, Fence
from tests.polling import wait_until
from worker.engine import EngineRequest, GenerationParams
from worker.lanes import pick_victim, read_steps, reserved_slots

# --- pure decisions --------------------------------------------------------------------------------


def test_a_read_serves_the_lower_lanes_share_first_then_every_lane_highest_first() -> None:
    assert reserved_slots(32, 0.1) == 4 and reserved_slots(8, 0.1) == 1 and reserved_slots(32, 0) == 0
    assert read_steps(10, {}, 2) == [
        ("default", 2),
        ("batch", 2),
        ("interactive", 10),
        ("default", 10),
        ("batch", 10),
    ]
    steps = read_steps(3, {"default": 2, "batch": 1}, 2)
    assert steps == [("batch", 1), ("interactive", 3), ("default", 3), ("batch", 3)]
    assert read_steps(3, {}, 0) == [("interactive", 3), ("default", 3), ("batch", 3)]


@dataclass
class Run:
    lane: Lane
    started: float
    preemptions: int = 0


def test_the_victim_is_the_newest_of_the_lowest_lane_above_its_share() -> None:
    old_batch, new_batch, new_default = Run("batch", 1.0), Run("batch", 5.0), Run("default", 9.0)
    running = [old_batch, new_batch, new_default, Run("interactive", 10.0)]
    assert pick_victim(running, {"batch": 2, "default": 1}, 0, 3) is new_batch
    assert pick_victim(running, {"batch": 2, "default": 1}, 2, 3) is None  # batch keeps its reserved slots
    assert pick_victim([new_default, Run("interactive", 1.0)], {"default": 1}, 0, 3) is new_default
    assert pick_victim([Run("batch", 1.0, preemptions=3)], {"batch": 1}, 0, 3) is None  # preempted enough
    assert pick_victim([Run("interactive", 1.0)], {"interactive": 1}, 0, 3) is None


def test_a_resumed_request_counts_from_its_first_start_so_fresher_work_is_preempted_first() -> None:
    from client.protocol import GenerateRequest, ms_now
    from worker.intake import Accepted, Ready
    from worker.relay import Relay

    def relay(first_started_ms: int | None) -> Relay:
        request = GenerateRequest(id="r", input_ids=[3], params={"max_new_tokens": 5}, submitted=ms_now())
        accepted = Accepted(b"1-0", request, lane="batch")
        ready = Ready(accepted, 2, False, [7], "", False, first_started_ms=first_started_ms)
        return Relay(ready, publisher=None, log=None, metrics=None)  # type: ignore[arg-type]

    fresh = relay(first_started_ms=None)
    resumed = relay(first_started_ms=ms_now() - 60_000)  # resumed after the fresh one started
    assert resumed.started < fresh.started
    assert pick_victim([fresh, resumed], {"batch": 2}, 0, 3) is fresh


# --- a worker, scripted engine -----------------------------------------------------------------------


async def test_free_slots_go_to_the_highest_lane_but_lower_lanes_keep_their_share(
    start_worker: Any, client: AsyncClient
) -> None:
    for lane in ("batch", "default", "interactive"):  # oldest first, so arrival order cannot explain the result
        for _ in range(12):
            await client.submit(input_ids=[5, 6], max_new_tokens=400, ignore_eos=True, priority=lane)
    running = await start_worker(step_s=0.05, max_running=10, lane_share=0.1, preemption=False)
    redis = running.worker.redis

    async def pending() -> list[int]:
        return [
            (await redis.xpending(client.keys.lane(lane), CONSUMER_GROUP))["pending"]
            for lane in ("interactive", "default", "batch")
        ]

    async def full() -> bool:
        try:
            return sum(await pending()) == 10
        except ResponseError:  # the worker has not created the lanes' groups yet
            return False

    await wait_until(full)
    assert await pending() == [8, 1, 1]  # one slot each (10 % of 10) for the lower lanes, the rest interactive


async def test_lanes_have_their_own_backlog_limit_and_unknown_lanes_are_refused(redis_url: str) -> None:
    async with AsyncClient(redis_url, max_queue_len=2) as client:
        for _ in range(2):
            await client.submit(input_ids=[1], priority="batch")
        with pytest.raises(QueueFull, match="batch"):
            await client.submit(input_ids=[1], priority="batch")
        await client.submit(input_ids=[1], priority="interactive")  # another lane, another backlog
        with pytest.raises(InvalidRequest, match="priority"):
            await client.submit(input_ids=[1], priority="urgent")  # type: ignore[arg-type]
        status = await client.status()
    assert [(lane.lane, lane.depth) for lane in status.lanes] == [("interactive", 1), ("default", 0), ("batch", 2)]


# --- preemption, real tiny model ------------------------------------------------------------------------

PROMPT = [3, 7, 11, 13]
BATCH_TOKENS = 100


async def reference(worker: Any, tokens: int) -> list[int]:
    """The batch request's greedy output, generated alone and uninterrupted."""
    params = GenerationParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    stream = worker.engine.submit(EngineRequest("reference", input_ids=PROMPT, params=params))
    return [token async for delta in stream for token in delta.token_ids]


async def published_tokens(redis: Any, key: str) -> int:
    return int(await redis.xlen(key))


async def fence(redis: Any, request_id: str, field: str, keys: Any) -> int:
    return int(await redis.hget(keys.fence(request_id), field) or 0)


async def test_an_interactive_request_preempts_batch_work_which_resumes_on_another_worker(
    start_worker: Any, client: AsyncClient
) -> None:
    first = await start_worker(real_model=True, max_running=1, lane_share=0)
    expected = await reference(first.worker, BATCH_TOKENS)
    redis = first.worker.redis
    batch = await client.submit(
        input_ids=PROMPT, max_new_tokens=BATCH_TOKENS, temperature=0, ignore_eos=True, priority="batch"
    )
    await wait_until(lambda: published_tokens(redis, client.keys.result(batch.id)), within_s=30)  # it runs
    urgent = await client.submit(input_ids=[9, 8, 7], max_new_tokens=150, temperature=0, priority="interactive")
    await wait_until(lambda: fence(redis, batch.id, Fence.PREEMPTED, client.keys), within_s=30)
    second = await start_worker(real_model=True, max_running=4, claim_interval_s=0.1)
    batch_result, urgent_result = await asyncio.gather(batch.result(timeout=120), urgent.result(timeout=120))
    assert batch_result.token_ids == expected  # no gap, no duplicate, the same greedy tokens
    assert len(urgent_result.token_ids) > 0
    assert second.worker.publisher.stats.tokens > 0  # the other worker generated the rest of the batch request
    assert not first.task.done()  # the preempting worker serves on
    assert await fence(redis, batch.id, Fence.PREEMPTED, client.keys) == 1
    assert await fence(redis, batch.id, Fence.HANDED_BACK, client.keys) == 0  # not counted as a delivery


async def test_a_request_preempted_to_its_limit_runs_to_the_end(start_worker: Any, client: AsyncClient) -> None:
    running = await start_worker(real_model=True, max_running=1, lane_share=0, max_preemptions=1, claim_interval_s=0.1)
    expected = await reference(running.worker, BATCH_TOKENS)
    redis = running.worker.redis
    batch = await client.submit(
        input_ids=PROMPT, max_new_tokens=BATCH_TOKENS, temperature=0, ignore_eos=True, priority="batch"
    )
    await wait_until(lambda: published_tokens(redis, client.keys.result(batch.id)), within_s=30)
    first = await client.submit(input_ids=[9, 8], max_new_tokens=10, temperature=0, priority="interactive")
    await first.result(timeout=60)

    async def resumed() -> bool:  # claimed back and running here again
        return await fence(redis, batch.id, Fence.ATTEMPT, client.keys) >= 2 and batch.id in running.worker.runs

    await wait_until(resumed, within_s=30)
    second = await client.submit(input_ids=[9, 7], max_new_tokens=10, temperature=0, priority="interactive")
    finished: list[str] = []

    async def note(name: str, job: Any) -> Any:
        result = await job.result(timeout=120)
        finished.append(name)
        return result

    batch_result, _ = await asyncio.gather(note("batch", batch), note("interactive", second))
    assert finished == ["batch", "interactive"]  # not preempted again: the interactive request waited
    assert not running.task.done()
    assert batch_result.token_ids == expected
    assert await fence(redis, batch.id, Fence.PREEMPTED, client.keys) == 1
    labels = {"queue": "default", "model_name": running.worker.settings.model, "lane": "batch"}
    assert running.worker.metrics.registry.get_sample_value("llmq:preemptions_total", labels) == 1


async def test_a_preempted_request_resumes_in_the_next_free_slot_before_newer_entries_of_its_lane(
    start_worker: Any, client: AsyncClient
) -> None:
    """Claiming runs once a minute here, so only the preempting worker's own reclaim can resume the victim
    ahead of the batch entry submitted after it."""
    running = await start_worker(step_s=0.01, max_running=1, lane_share=0, claim_interval_s=60)
    redis = running.worker.redis
    victim = await client.submit(input_ids=[5, 6], max_new_tokens=300, ignore_eos=True, priority="batch")
    await wait_until(lambda: published_tokens(redis, client.keys.result(victim.id)))
    newer = await client.submit(input_ids=[5, 7], max_new_tokens=300, ignore_eos=True, priority="batch")
    urgent = await client.submit(input_ids=[9], max_new_tokens=5, ignore_eos=True, priority="interactive")
    await urgent.result(timeout=30)

    async def resumed() -> bool:
        return await fence(redis, victim.id, Fence.ATTEMPT, client.keys) == 2

    await wait_until(resumed)
    assert await fence(redis, newer.id, Fence.ATTEMPT, client.keys) == 0  # ...while the newer one waits
    victim_result, newer_result = await asyncio.gather(victim.result(timeout=60), newer.result(timeout=60))
    assert len(victim_result.token_ids) == len(newer_result.token_ids) == 300
    assert await fence(redis, victim.id, Fence.PREEMPTED, client.keys) == 1
