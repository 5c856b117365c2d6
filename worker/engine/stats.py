"""Step counters written by the library's thread and read by the event loop (plain ints: GIL-atomic)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

_RECENT_STEPS = 2048


class StepCounters:
    """Steps, prefill and decode tokens, and recent tokens-per-step, counted around the library's forward pass."""

    def __init__(self) -> None:
        self.steps = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.restarts = 0
        self.finished: Counter[str] = Counter()
        self.recent_batch_tokens: deque[int] = deque(maxlen=_RECENT_STEPS)
        self.step_observers: list[Callable[[int], None]] = []  # called in the engine thread with tokens per step

    def instrument(self, manager: Any) -> None:
        """Wraps the manager's `_generation_step` (called once per forward, in its thread; pinned to 5.24)."""
        step = manager._generation_step

        def counted_step() -> None:
            io = manager.batch_processor.inputs_and_outputs
            batch = getattr(io, "requests_in_batch", [])
            # A row decodes when its request already has output; otherwise it is (a chunk of) its prompt.
            decode = sum(1 for future in batch if future.state.generated_tokens)
            tokens = sum(future.query_length for future in batch)
            step()
            self.steps += 1
            self.decode_tokens += decode
            self.prefill_tokens += tokens - decode
            self.recent_batch_tokens.append(tokens)
            for observe in self.step_observers:
                observe(tokens)

        manager._generation_step = counted_step

    def fill_percentiles(self, max_batch_tokens: int) -> tuple[float, float, float]:
        """P50/P95/P99 of tokens per step over the batch budget, over the recent steps."""
        recent = sorted(self.recent_batch_tokens)
        if not recent:
            return (0.0, 0.0, 0.0)

        def at(q: float) -> float:
            return recent[min(len(recent) - 1, int(q * len(recent)))] / max_batch_tokens

        return (at(0.50), at(0.95), at(0.99))
