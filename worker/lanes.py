"""Traffic classes in a worker, as pure decisions: which lanes a read takes from (`read_steps`), and which
running request makes room for a waiting interactive one (`pick_victim`).

A worker fills free slots from the highest lane first, but each lower lane keeps `reserved` slots while it has
work, so batch work is never starved by a stream of interactive requests. Preemption is lossless: the victim
is handed back, and whichever worker claims it next resumes it from its published tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Protocol, TypeVar

from client.protocol import LANES, Lane


def reserved_slots(max_running: int, share: float) -> int:
    """Slots each lower lane keeps while it has work."""
    return math.ceil(share * max_running) if share > 0 else 0


def read_steps(free: int, running: Mapping[Lane, int], reserved: int) -> list[tuple[Lane, int]]:
    """(lane, wanted) steps of one read, in order: each lower lane up to its reserved slots (those it runs
    count), then every lane, highest first, with whatever is left of `free` (the script stops at `free`)."""
    shares = [(lane, reserved - running.get(lane, 0)) for lane in LANES[1:] if running.get(lane, 0) < reserved]
    return [*shares, *((lane, free) for lane in LANES)]


class Running(Protocol):
    @property
    def lane(self) -> Lane: ...
    @property
    def started(self) -> float: ...
    @property
    def preemptions(self) -> int: ...


_Running = TypeVar("_Running", bound=Running)


def pick_victim(
    running: Iterable[_Running], counts: Mapping[Lane, int], reserved: int, max_preemptions: int
) -> _Running | None:
    """The request to hand back for an interactive one: from the lowest lane that holds more than its reserved
    slots, the most recently started (the least work moves; a resumed request counts from its first start), never
    one preempted `max_preemptions` times."""
    candidates = [
        r
        for r in running
        if r.lane != "interactive" and counts.get(r.lane, 0) > reserved and r.preemptions < max_preemptions
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda r: (LANES.index(r.lane), r.started))
