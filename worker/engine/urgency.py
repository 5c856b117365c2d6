"""Urgent requests' prompts go first: an interactive request's prefill before any other request's.

transformers' FIFO scheduler (5.24) fills a step's token budget with every decoding row first, then with the
prefill chunks of requests already prefilling, then with waiting requests in arrival order. A request that just
preempted batch work would so wait behind the prefill of whatever started before it, such as the long resumed
prompts of requests preempted earlier: several steps, where the interactive lane asks for the next one.

`install(manager, urgent)` wraps that one scheduler's candidate pass (an instance attribute, nothing global): the
candidates are reordered so that urgent ones (library request ids in `urgent`, kept by the engine) follow the
decoding rows and precede every other prefill. Decoding rows keep their place, so no running request stalls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from transformers.generation.continuous_batching.requests import RequestStatus


def urgent_first(candidates: list[Any], urgent: Collection[str]) -> list[Any]:
    """Decoding rows, then urgent requests, then the rest, each in the scheduler's own order (a stable sort)."""
    if not urgent:
        return candidates
    return sorted(candidates, key=lambda s: s.status != RequestStatus.DECODING and s.request_id not in urgent)


def install(manager: Any, urgent: Collection[str]) -> bool:
    """Makes this manager's scheduler take urgent requests' prefills first. False where it has no candidate pass."""
    scheduler = manager.batch_processor.scheduler
    process: Callable[..., Any] | None = getattr(scheduler, "_process_candidates", None)
    if process is None:
        return False

    def process_urgent_first(candidates: list[Any], *args: Any, **kwargs: Any) -> Any:
        return process(urgent_first(candidates, urgent), *args, **kwargs)

    scheduler._process_candidates = process_urgent_first
    return True
