"""One running request in a worker: its engine deltas become result events, `seq` continuing after a resume."""

from __future__ import annotations

import asyncio

from structlog.typing import FilteringBoundLogger

from client.protocol import DoneEvent, ErrorEvent, GenerateRequest, Timings, TokensEvent, Usage, ms_now
from worker.adapter import wire_error
from worker.engine import DeltaStream, EngineClosed, EngineError, EngineFailed, OutputDelta, TokenLogprob
from worker.intake import Ready
from worker.metrics import Metrics
from worker.publisher import Publisher, Target


def target_of(ready: Ready) -> Target:
    """Where a ready request's events go, fenced by its attempt."""
    request = ready.accepted.request
    accepted = ready.accepted
    return Target(
        request.id,
        request.result_ttl,
        ready.attempt,
        accepted.entry_id,
        request.reply_to,
        accepted.notify,
        accepted.lane,
    )


def done_event(
    request: GenerateRequest,
    ready: Ready,
    reason: str,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    started_ms: int | None = None,
    first_ms: int | None = None,
) -> DoneEvent:
    """The `done` event. Timings describe the whole request: after a resume, the start and the first token are
    the first attempt's."""
    submitted = request.submitted
    started_ms = ready.first_started_ms or started_ms
    first_ms = ready.first_token_ms or first_ms
    timings = Timings(
        queue_ms=None if started_ms is None else started_ms - submitted,
        ttft_ms=None if first_ms is None else first_ms - submitted,
        total_ms=ms_now() - submitted,
    )
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    return DoneEvent(finish_reason=reason, usage=usage, timings=timings)  # type: ignore[arg-type]


def _wire_logprob(logprob: TokenLogprob) -> tuple[float, str, list[tuple[int, float, str]]]:
    alternatives = zip(logprob.top, logprob.top_text, strict=True)
    return logprob.logprob, logprob.text, [(token, value, text) for (token, value), text in alternatives]


class Relay:
    """Owns one running request: publishes its output under its attempt number until it ends or is fenced."""

    def __init__(self, ready: Ready, publisher: Publisher, log: FilteringBoundLogger, metrics: Metrics) -> None:
        self.ready = ready
        self.request = ready.accepted.request
        self.entry_id = ready.accepted.entry_id
        self.lane = ready.accepted.lane
        self.preemptions = ready.preemptions
        # When the request first started, on any worker (epoch s): a resumed request has done that attempt's work
        # before, so preemption (`pick_victim`) leaves it alone rather than moving it again and again.
        self.started = (ready.first_started_ms or ms_now()) / 1000
        self.target = target_of(ready)
        self.fenced = False  # another worker owns the request now: write nothing more
        self.tokens = len(ready.delivered_ids)
        self._texts, self._ids = [ready.delivered_text], list(ready.delivered_ids)  # the whole output, for reply_to
        self.task: asyncio.Task[EngineFailed | None] | None = None
        self._publisher = publisher
        self._log = log
        self._metrics = metrics

    @property
    def output(self) -> tuple[str, list[int]]:
        """The whole output so far (kept only for a `reply_to` request), earlier attempts' included."""
        return "".join(self._texts), self._ids

    async def run(self, stream: DeltaStream) -> EngineFailed | None:
        """Publishes the stream until it ends. Returns the engine failure it ended with, if any: the worker
        hands such a request back rather than answering it."""
        started_ms, first_ms, last_ms = ms_now(), None, None
        self._metrics.queue_time.observe(max(0.0, (started_ms - self.request.submitted) / 1000))
        try:
            async for delta in stream:
                if self.fenced:
                    return None
                if delta.token_ids:
                    now = ms_now()
                    if first_ms is None:
                        first_ms = now
                        self._metrics.time_to_first_token.observe(max(0.0, (now - self.request.submitted) / 1000))
                    elif last_ms is not None:
                        for _ in delta.token_ids:  # a merged delta: its tokens shared the interval
                            self._metrics.inter_token_latency.observe((now - last_ms) / 1000 / len(delta.token_ids))
                    last_ms = now
                    self._publish_tokens(delta)
                if delta.finish_reason is not None:
                    reason = delta.finish_reason.value
                    event = done_event(
                        self.request,
                        self.ready,
                        reason,
                        prompt_tokens=stream.prompt_tokens,
                        completion_tokens=self.tokens,
                        started_ms=started_ms,
                        first_ms=first_ms,
                    )
                    self._metrics.e2e_latency.observe(max(0.0, (event.timings.total_ms or 0) / 1000))
                    self._publisher.finish(self.target, event, seq=self.tokens, output=self.output)
                    self._log.info("finished", request_id=self.request.id, reason=reason, tokens=self.tokens)
        except EngineClosed:
            self._log.info("stopped by shutdown", request_id=self.request.id)
        except EngineFailed as error:
            self._log.warning(
                "engine failed under request", request_id=self.request.id, implicated=error.implicated, error=str(error)
            )
            return error
        except EngineError as error:
            self.fail(error)
        return None

    def _publish_tokens(self, delta: OutputDelta) -> None:
        logprobs = None if delta.logprobs is None else [_wire_logprob(lp) for lp in delta.logprobs]
        event = TokensEvent(seq=self.tokens, ids=delta.token_ids, text=delta.text, logprobs=logprobs)
        self._publisher.tokens(self.target, event)
        self.tokens += len(delta.token_ids)
        if self.target.reply_to is not None:
            self._texts.append(delta.text)
            self._ids.extend(delta.token_ids)

    def fail(self, error: EngineError) -> None:
        """Ends the request with the wire error its engine error maps to."""
        wire = wire_error(error)
        event = ErrorEvent(code=wire.code, message=str(error), retryable=wire.retryable)
        self._publisher.finish(self.target, event, seq=self.tokens, output=self.output)
