"""One request in a worker: its engine deltas become result events, `seq` continuing after a resume."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from client.protocol import DoneEvent, ErrorEvent, Timings, TokensEvent, Usage, ms_now
from worker.adapter import wire_error
from worker.engine import EngineClosed, EngineError, EngineFailed, Finish, RequestStream
from worker.intake import Ready
from worker.metrics import Metrics
from worker.publisher import Publisher, Target


class Relay:
    """Owns one running request: publishes its output under its attempt number until it ends or is fenced."""

    def __init__(self, ready: Ready, publisher: Publisher, log: object, metrics: Metrics) -> None:
        self.ready = ready
        self.request = ready.accepted.request
        self.entry_id = ready.accepted.entry_id
        self.target = Target(self.request.id, self.request.result_ttl, ready.attempt, self.entry_id)
        self.fenced = False  # another worker owns the request now: write nothing more
        self.tokens = len(ready.delivered_ids)
        self.task: asyncio.Task[None] | None = None
        self._publisher = publisher
        self._log = log
        self._metrics = metrics

    def done(self, reason: str, prompt_tokens: int, started_ms: int | None = None, first_ms: int | None = None) -> None:
        """Publishes `done`. Timings describe the whole request: after a resume, the start and the first token
        are the first attempt's."""
        submitted = self.request.submitted
        started_ms = self.ready.first_started_ms or started_ms
        first_ms = self.ready.first_token_ms or first_ms
        timings = Timings(
            queue_ms=None if started_ms is None else started_ms - submitted,
            ttft_ms=None if first_ms is None else first_ms - submitted,
            total_ms=ms_now() - submitted,
        )
        self._metrics.e2e_latency.observe(max(0.0, timings.total_ms / 1000))
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=self.tokens)
        event = DoneEvent(finish_reason=reason, usage=usage, timings=timings)  # type: ignore[arg-type]
        self._publisher.finish(self.target, event, seq=self.tokens)

    def error(self, code: str, message: str, retryable: bool = False) -> None:
        event = ErrorEvent(code=code, message=message, retryable=retryable)
        self._publisher.finish(self.target, event, seq=self.tokens)

    def fail(self, error: EngineError) -> None:
        """Ends the request with the wire error its engine error maps to."""
        wire = wire_error(error)
        self.error(wire.code, str(error), wire.retryable)

    async def run(self, stream: RequestStream, on_engine_failure: Callable[[Relay, bool], Awaitable[None]]) -> None:
        started_ms, first_ms, last_ms = ms_now(), None, None
        self._metrics.queue_time.observe(max(0.0, (started_ms - self.request.submitted) / 1000))
        try:
            async for delta in stream:
                if self.fenced:
                    return
                if delta.token_ids:
                    now = ms_now()
                    if first_ms is None:
                        first_ms = now
                        self._metrics.time_to_first_token.observe(max(0.0, (now - self.request.submitted) / 1000))
                    elif last_ms is not None:
                        for _ in delta.token_ids:  # a merged delta: its tokens shared the interval
                            self._metrics.inter_token_latency.observe((now - last_ms) / 1000 / len(delta.token_ids))
                    last_ms = now
                    self._publisher.tokens(
                        self.target, TokensEvent(seq=self.tokens, ids=delta.token_ids, text=delta.text)
                    )
                    self.tokens += len(delta.token_ids)
                if delta.finish_reason is not None:
                    self.done(delta.finish_reason.value, stream.prompt_tokens, started_ms, first_ms)
                    self._log.info(
                        "finished", request_id=self.request.id, reason=delta.finish_reason.value, tokens=self.tokens
                    )
        except EngineClosed:
            self._log.info("stopped by shutdown", request_id=self.request.id)
        except EngineFailed as error:
            # Hand it back: another attempt resumes it; one that keeps killing engines is quarantined.
            self._log.warning(
                "engine failed under request", request_id=self.request.id, implicated=error.implicated, error=str(error)
            )
            await on_engine_failure(self, error.implicated)
        except EngineError as error:
            self.fail(error)


def finish_without_generating(relay: Relay, eos_token_ids: tuple[int, ...]) -> str | None:
    """The finish reason of a request whose earlier attempts already produced everything, else None."""
    request, delivered = relay.request, relay.ready.delivered_ids
    if relay.ready.cancelled:
        return Finish.CANCELLED.value
    if delivered and not request.params.ignore_eos and delivered[-1] in eos_token_ids:
        return Finish.EOS.value
    if len(delivered) >= request.params.max_new_tokens:
        return Finish.LENGTH.value
    return None
