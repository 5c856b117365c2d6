"""The per-request bridge between the engine thread's outputs and the caller's async iteration."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from worker.engine.errors import EngineError
from worker.engine.inputs import PreparedRequest
from worker.engine.outputs import IncrementalDetokenizer, StopStringMatcher
from worker.engine.prompt_scores import PromptScores
from worker.engine.rows import RowState
from worker.engine.types import OutputDelta


class RequestStream(AsyncIterator[OutputDelta]):
    """Async iterator of one request's deltas; ends after the delta that carries the finish reason.

    `put` never blocks: when the reader is behind, deltas are merged (as vLLM's RequestOutputCollector
    does), so a slow reader never stalls the engine and never misses a token.
    """

    def __init__(
        self,
        request: PreparedRequest,
        detokenizer: IncrementalDetokenizer,
        kv_blocks: int,
        carry_text: str = "",
        library_id: str = "",
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.library_id = library_id or request.request_id  # the id transformers' manager knows it by
        self.prompt_tokens = request.prompt_tokens
        self.kv_blocks = kv_blocks
        self.detokenizer = detokenizer
        self.stops = StopStringMatcher(request.params.stop, pending=carry_text)
        self.tokens_seen = 0  # the library's outputs are cumulative: how many generated tokens we already took
        self.prefilled = False  # its prompt's pages are computed (its first output came): others may reuse them
        self.row_state: RowState | None = None  # the sampler's state, for a request with per-row features
        self.prompt_scores: PromptScores | None = None  # its prompt being scored, until its first output
        self.tool_syntax: str | None = None  # the syntax of its calls, on a request that may call tools
        self.closed = False  # no more deltas will be put
        self._pending: OutputDelta | None = None
        self._error: EngineError | None = None
        self._ready = asyncio.Event()
        self._drained = False

    def put(self, delta: OutputDelta) -> None:
        if self.closed:
            return
        if self._pending is None:
            self._pending = delta
        else:  # the reader is behind: one delta carries everything since its last read
            pending = self._pending
            pending.token_ids.extend(delta.token_ids)
            pending.text += delta.text
            pending.finish_reason = delta.finish_reason
            if delta.logprobs is not None:
                pending.logprobs = [*(pending.logprobs or []), *delta.logprobs]
            pending.prompt = pending.prompt or delta.prompt
        self.closed = delta.finished
        self._ready.set()

    def fail(self, error: EngineError) -> None:
        if self.closed:
            return
        self._error = error
        self.closed = True
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> OutputDelta:
        if self._drained:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        if self._pending is not None:
            delta, self._pending = self._pending, None
            self._drained = delta.finished
            if not self._drained and self._error is not None:
                self._ready.set()  # hand out the tokens we have, then the error
            return delta
        self._drained = True
        assert self._error is not None
        raise self._error
