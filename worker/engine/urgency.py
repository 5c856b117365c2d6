"""Urgent requests' prompts go first: an interactive request's prefill before any other request's.

transformers' FIFO scheduler (5.24) fills a step's token budget with every decoding row first, then with the
prefill chunks of requests already prefilling, then with waiting requests in arrival order. A request that just
preempted batch work would so wait behind the prefill of whatever started before it, such as the long resumed
prompts of requests preempted earlier: several steps, where the interactive lane asks for the next one.

`urgent_first` reorders the scheduler's candidates so that urgent ones (library request ids in `urgent`, kept by the
engine) follow the decoding rows and precede every other prefill. Decoding rows keep their place, so no running
request stalls. `library.py` runs it in the scheduler it registers with the library (`UrgentFirstScheduler`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol, TypeVar


class Candidate(Protocol):
    @property
    def request_id(self) -> str: ...


C = TypeVar("C", bound=Candidate)


def urgent_first(candidates: list[C], urgent: Collection[str], decoding: Callable[[C], bool]) -> list[C]:
    """Decoding rows, then urgent requests, then the rest, each in the scheduler's own order (a stable sort)."""
    if not urgent:
        return candidates
    return sorted(candidates, key=lambda s: not decoding(s) and s.request_id not in urgent)
