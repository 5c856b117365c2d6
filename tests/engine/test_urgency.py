"""Urgent requests (the interactive lane) prefill before requests that arrived earlier."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from transformers.generation.continuous_batching.requests import RequestStatus

from tests.engine.test_engine import greedy
from worker.engine import EngineRequest
from worker.engine.library import UrgentFirstScheduler
from worker.engine.urgency import urgent_first

BUDGET = 16  # tokens per step


def state(request_id: str, status: RequestStatus) -> Any:
    return SimpleNamespace(request_id=request_id, status=status)


def decoding(candidate: Any) -> bool:
    return bool(candidate.status == RequestStatus.DECODING)


def test_candidates_keep_decoding_rows_first_then_urgent_ones_then_the_rest_in_order() -> None:
    decode_a, decode_b = state("a", RequestStatus.DECODING), state("b", RequestStatus.DECODING)
    prefilling, waiting = state("p", RequestStatus.PREFILLING), state("w", RequestStatus.PENDING)
    urgent_late, urgent_later = state("u1", RequestStatus.PENDING), state("u2", RequestStatus.PENDING)
    candidates = [decode_a, decode_b, prefilling, waiting, urgent_late, urgent_later]
    expected = [decode_a, decode_b, urgent_late, urgent_later, prefilling, waiting]
    assert urgent_first(candidates, {"u1", "u2"}, decoding) == expected
    assert urgent_first(candidates, set(), decoding) == candidates


async def first_tokens(engine: Any, requests: list[EngineRequest]) -> list[str]:
    """Request ids in the order their first token arrives."""
    order: list[str] = []

    async def watch(request: EngineRequest) -> None:
        async for delta in engine.submit(request):
            if delta.token_ids and request.request_id not in order:
                order.append(request.request_id)

    await asyncio.gather(*(watch(request) for request in requests))
    return order


async def test_an_urgent_request_prefills_before_a_long_prompt_that_arrived_first(
    llama_dir: Path, make_engine: Any
) -> None:
    """The long prompt takes six full steps of prefill; without urgency the short one would start after them."""
    engine = await make_engine(llama_dir, max_batch_tokens=BUDGET, max_running=4)
    long_prompt = EngineRequest("long", input_ids=[5 + i % 90 for i in range(6 * BUDGET)], params=greedy(4))
    short = EngineRequest("short", input_ids=[7, 8, 9], params=greedy(4), urgent=True)
    assert await first_tokens(engine, [long_prompt, short]) == ["short", "long"]
    plain = EngineRequest("plain", input_ids=[7, 8, 9], params=greedy(4))
    again = EngineRequest("long-again", input_ids=long_prompt.input_ids, params=greedy(4))
    assert await first_tokens(engine, [again, plain]) == ["long-again", "plain"]  # the library's own order
    assert not engine._urgent, "finished requests leave the urgent set"
    scheduler = engine._manager.library.batch_processor.scheduler
    assert isinstance(scheduler, UrgentFirstScheduler), "chosen by name from the library's scheduler mapping"
    assert scheduler.urgent is engine._urgent
