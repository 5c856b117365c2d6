"""Step counters written by the library's thread and read by the event loop (plain ints: GIL-atomic)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from worker.engine.types import Step

_RECENT_STEPS = 2048


class StepCounters:
    """Steps, prefill, decode and generated tokens, and recent tokens-per-step, counted around the library's
    forward pass; prefix-cache lookups where prefix sharing is on; and the engine paths `library.start` chose."""

    def __init__(self) -> None:
        self.steps = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.generation_tokens = 0
        self.restarts = 0
        self.finished: Counter[str] = Counter()
        self.recent_batch_tokens: deque[int] = deque(maxlen=_RECENT_STEPS)
        self.step_observers: list[Callable[[Step], None]] = []  # called in the engine thread after each step
        # Prefix-cache lookups (vLLM's prefix_cache_queries/hits, in tokens); None while prefix sharing is off.
        self.prefix_cache_queries: int | None = None
        self.prefix_cache_hits: int | None = None
        self.paths: dict[str, str] = {}  # engine component -> the implementation that runs it (`library.start`)

    def count_step(self, tokens: int, decode: int, generated: int) -> None:
        """One forward pass of `tokens` tokens, `decode` of them decode rows, that gave `generated` requests a
        new token: every decode row and every prompt whose last chunk ran (its first token comes from the
        prefill). Called after the pass, in its thread: `library.py` wraps the library's step with this."""
        self.steps += 1
        self.decode_tokens += decode
        self.prefill_tokens += tokens - decode
        self.generation_tokens += generated
        self.recent_batch_tokens.append(tokens)
        step = Step(tokens, decode, generated)
        for observe in self.step_observers:
            observe(step)

    def count_prefix_lookup(self, queried: int, hit: int) -> None:
        """One request's prompt of `queried` tokens looked up in the prefix cache, `hit` of them found there."""
        self.prefix_cache_queries = (self.prefix_cache_queries or 0) + queried
        self.prefix_cache_hits = (self.prefix_cache_hits or 0) + hit

    def fill_percentiles(self, max_batch_tokens: int) -> tuple[float, float, float]:
        """P50/P95/P99 of tokens per step over the batch budget, over the recent steps."""
        recent = sorted(self.recent_batch_tokens)
        if not recent:
            return (0.0, 0.0, 0.0)

        def at(q: float) -> float:
            return recent[min(len(recent) - 1, int(q * len(recent)))] / max_batch_tokens

        return (at(0.50), at(0.95), at(0.99))
