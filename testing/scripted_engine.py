"""A scripted engine: implements `worker.engine.GenerationEngine` without a model, for service tests and the
queue benchmarks (never a default: only tests and `bench/` construct it).

Every `step_s` each running request gets the next token of its script, a pure function of its prompt and the
token's position, so a resumed request continues exactly where the published tokens stop, as a greedy
request on the real engine does. `fail_next_step()` kills the "engine" under everything running, as a dying
library thread does, with the same blame rule for suspects.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from worker.engine import (
    EngineClosed,
    EngineError,
    EngineFailed,
    EngineRequest,
    EngineStats,
    Finish,
    OutputDelta,
    Step,
)
from worker.engine.errors import RequestRejected

VOCAB = 400


def script(prompt_ids: list[int], position: int) -> int:
    """The token a request with `prompt_ids` generates at `position` (never 0, the EOS id)."""
    return 3 + (sum(prompt_ids) * 31 + position * 7) % (VOCAB - 3)


def expected_tokens(prompt_ids: list[int], count: int) -> list[int]:
    return [script(prompt_ids, i) for i in range(count)]


def prompt_ids_of(request: EngineRequest) -> list[int]:
    """Token ids of any input: `input_ids` as they are, text as its UTF-8 bytes (a byte-level "tokenizer")."""
    if request.input_ids is not None:
        return list(request.input_ids)
    text = request.prompt if request.prompt is not None else "".join(m["content"] for m in request.messages or ())
    return list(text.encode())


def text_of(token: int) -> str:
    return f"<{token}>"


class ScriptedStream:
    """A `DeltaStream`: deltas in a queue, ending after the finishing one or with an `EngineError`."""

    def __init__(self, request: EngineRequest, prompt_ids: list[int], position: int) -> None:
        self.request = request
        self.prompt_ids = prompt_ids
        self.position = position  # index of the next token (after a resume: the tokens already delivered)
        self.prompt_tokens = len(prompt_ids)
        self.prefilled = False
        self._queue: asyncio.Queue[OutputDelta | EngineError] = asyncio.Queue()

    def put(self, item: OutputDelta | EngineError) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[OutputDelta]:
        while True:
            item = await self._queue.get()
            if isinstance(item, EngineError):
                raise item
            yield item
            if item.finish_reason is not None:
                return


@dataclass
class ScriptedEngine:
    """Implements `GenerationEngine`; sized like `EngineConfig` so stats and free slots read the same."""

    step_s: float = 0.002
    max_running: int = 8
    kv_cache_tokens: int = 2048
    page_size: int = 16
    max_context: int = 512
    max_batch_tokens: int = 128
    eos_token_ids: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        self._running: dict[str, ScriptedStream] = {}
        self._waiting: list[ScriptedStream] = []
        self._observers: list[Callable[[Step], None]] = []
        self._steps = self._prefill = self._decode = self._generated = self._restarts = 0
        self._finished: Counter[str] = Counter()
        self.submitted: list[str] = []  # ids of the requests submitted here, in order (which worker ran what)
        self._fail_next = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    # --- GenerationEngine ---

    @property
    def alive(self) -> bool:
        return not self._closed

    def submit(self, request: EngineRequest) -> ScriptedStream:
        if self._closed:
            raise EngineClosed("the engine is not running")
        prompt_ids = prompt_ids_of(request)
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        if any(not 0 <= i < VOCAB for i in prompt_ids):
            raise RequestRejected(f"input_ids outside the vocabulary [0, {VOCAB})")
        total = len(prompt_ids) + request.params.max_new_tokens
        if total > self.max_context:
            raise RequestRejected(
                f"prompt + max_new_tokens = {total} exceeds the model's context of {self.max_context}"
            )
        delivered = len(request.resume.token_ids) if request.resume is not None else 0
        stream = ScriptedStream(request, prompt_ids, delivered)
        self.submitted.append(request.request_id)
        self._waiting.append(stream)
        self._admit()
        if self._task is None:
            self._task = asyncio.create_task(self._steps_forever(), name="scripted-engine")
        return stream

    def cancel(self, request_id: str) -> bool:
        stream = self._find(request_id)
        if stream is None:
            return False
        stream.put(OutputDelta(request_id, [], "", Finish.CANCELLED, stream.prompt_tokens))
        self._end(stream, Finish.CANCELLED.value)
        return True

    def free_slots(self) -> int:
        if self._closed or self._waiting:
            return 0
        return max(0, self.max_running - len(self._running))

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_total=self.kv_cache_tokens // self.page_size,
            kv_blocks_used=0,
            kv_blocks_reserved=0,
            page_size=self.page_size,
            max_batch_tokens=self.max_batch_tokens,
            running=len(self._running),
            waiting=len(self._waiting),
            steps=self._steps,
            prefill_tokens=self._prefill,
            decode_tokens=self._decode,
            generation_tokens=self._generated,
            batch_fill_p50=0.0,
            batch_fill_p95=0.0,
            batch_fill_p99=0.0,
            requests_finished=dict(self._finished),
            restarts=self._restarts,
        )

    def observe_steps(self, observer: Callable[[Step], None]) -> None:
        self._observers.append(observer)

    # --- scripting ---

    def fail_next_step(self) -> None:
        """The next step kills the engine under every running request (it restarts at once)."""
        self._fail_next = True

    async def close(self) -> None:
        self._closed = True
        for stream in [*self._running.values(), *self._waiting]:
            stream.put(EngineClosed("the engine is shutting down"))
        self._running.clear()
        self._waiting.clear()
        if self._task is not None:
            self._task.cancel()

    # --- internals ---

    def _find(self, request_id: str) -> ScriptedStream | None:
        return self._running.get(request_id) or next(
            (s for s in self._waiting if s.request.request_id == request_id), None
        )

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            stream = self._waiting.pop(0)
            self._running[stream.request.request_id] = stream

    def _end(self, stream: ScriptedStream, outcome: str) -> None:
        self._running.pop(stream.request.request_id, None)
        if stream in self._waiting:
            self._waiting.remove(stream)
        self._finished[outcome] += 1
        self._admit()

    async def _steps_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.step_s)
            if self._running:
                self._step()

    def _step(self) -> None:
        running = list(self._running.values())
        if self._fail_next:
            self._fail_next = False
            self._restarts += 1
            suspect_ran = any(s.request.suspect for s in running)
            for stream in running:
                implicated = stream.request.suspect or not suspect_ran
                stream.put(EngineFailed("the scripted engine failed", implicated=implicated))
                self._end(stream, "error")
            return
        tokens = decode = 0
        for stream in running:
            if not stream.prefilled:
                stream.prefilled = True
                self._prefill += stream.prompt_tokens
                tokens += stream.prompt_tokens
            else:
                decode += 1
                tokens += 1
            token = script(stream.prompt_ids, stream.position)
            stream.position += 1
            self._generated += 1  # each step gives every running request a token, its first included
            done = stream.position >= stream.request.params.max_new_tokens
            reason = Finish.LENGTH if done else None
            stream.put(OutputDelta(stream.request.request_id, [token], text_of(token), reason, stream.prompt_tokens))
            if done:
                self._end(stream, Finish.LENGTH.value)
        self._steps += 1
        self._decode += decode
        step = Step(tokens, decode, generated=len(running))
        for observe in self._observers:
            observe(step)
