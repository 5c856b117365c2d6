"""What the worker uses of an engine, as a `typing.Protocol`: `Engine` implements it over transformers, and a
scripted engine (`testing/scripted_engine.py`) implements it in a few lines for service tests and benchmarks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from worker.engine.types import EngineRequest, EngineStats, OutputDelta, Step


class DeltaStream(Protocol):
    """One request's output deltas; the last has `finish_reason` set, or the iteration raises an `EngineError`."""

    prompt_tokens: int

    def __aiter__(self) -> AsyncIterator[OutputDelta]: ...


class GenerationEngine(Protocol):
    eos_token_ids: tuple[int, ...]

    @property
    def alive(self) -> bool:
        """False while the engine restarts: the worker's health check reads it."""
        ...

    def submit(self, request: EngineRequest) -> DeltaStream:
        """Validates and queues a request; raises `RequestRejected` or `EngineClosed`, never fails others."""
        ...

    def cancel(self, request_id: str) -> bool:
        """Ends the request's stream with `cancelled`; False if it is not here."""
        ...

    def free_slots(self) -> int:
        """How many more requests it would start now: what the worker reads from its queue."""
        ...

    def stats(self) -> EngineStats: ...

    def observe_steps(self, observer: Callable[[Step], None]) -> None:
        """Calls `observer(step)` after every step (from the engine's thread: keep it cheap)."""
        ...
