"""The retry delays every loop shares: doubling from a base to a cap, each one drawn from its upper half ("equal
jitter"). Without the jitter a fleet that lost Redis at one instant retries in lockstep, every worker and client
at the same moments, and hammers the server that is coming back; with it the retries spread over half of each
delay while the worst case stays the plain doubling's."""

from __future__ import annotations

import random


def jittered(delay: float) -> float:
    """`delay` drawn at random from [delay / 2, delay]."""
    return random.uniform(delay / 2, delay)


class Backoff:
    """Delays that double from `base` to `cap`, jittered; `reset` after a success starts again from `base`."""

    def __init__(self, base: float, cap: float) -> None:
        self.base = base
        self.cap = cap
        self._next = base

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.cap)
        return jittered(delay)

    def reset(self) -> None:
        self._next = self.base
