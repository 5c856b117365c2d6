"""One running request in a worker: its engine deltas become result events, `seq` continuing after a resume."""

from __future__ import annotations

from collections.abc import Callable

from structlog.typing import FilteringBoundLogger

from client.protocol import DoneEvent, ErrorEvent, TokensEvent, ms_now
from client.scripts import PublishOutcome
from client.store import Keys
from worker.adapter import error_event
from worker.engine import DeltaStream, EngineClosed, EngineError, EngineFailed, OutputDelta, TokenLogprob
from worker.intake import Ready, done_event, target_of
from worker.metrics import Metrics
from worker.publisher import Publisher
from worker.tracing import RequestTrace


def _wire_logprob(logprob: TokenLogprob) -> tuple[float, str, list[tuple[int, float, str]]]:
    alternatives = zip(logprob.top, logprob.top_text, strict=True)
    return logprob.logprob, logprob.text, [(token, value, text) for (token, value), text in alternatives]


class Relay:
    """Publishes one running request's output under its attempt number until it ends or is fenced
    (`worker.runs.Run` adds its partition, lease and task), observing its latencies and tracing its phases
    (`worker.tracing`; `keys`: its partition's, named in the spans)."""

    def __init__(
        self,
        ready: Ready,
        publisher: Publisher,
        log: FilteringBoundLogger,
        metrics: Metrics,
        keys: Keys | None = None,
    ) -> None:
        self.ready = ready
        self.request = ready.accepted.request
        self.entry_id = ready.accepted.entry_id
        self.lane = ready.accepted.lane
        self.preemptions = ready.preemptions
        # When the request first started, on any worker (epoch s): a resumed request has done that attempt's work
        # before, so preemption (`pick_victim`) leaves it alone rather than moving it again and again.
        self.started = (ready.first_started_ms or ms_now()) / 1000
        self.target = target_of(ready)
        self.fenced = False  # write nothing more (set only by `Runs.stop`)
        self.tokens = len(ready.delivered_ids)
        self._texts, self._ids = [ready.delivered_text], list(ready.delivered_ids)  # the whole output, for reply_to
        self._publisher = publisher
        self._log = log
        self._metrics = metrics
        self.trace = RequestTrace(ready, keys)

    @property
    def output(self) -> tuple[str, list[int]]:
        """The whole output so far (kept only for a `reply_to` request), earlier attempts' included."""
        return "".join(self._texts), self._ids

    async def run(self, stream: DeltaStream) -> EngineFailed | None:
        """Publishes the stream until it ends. Returns the engine failure it ended with, if any: the worker
        hands such a request back rather than answering it."""
        started_ms, first_ms, last_ms = ms_now(), None, None
        self._metrics.queue_time.observe(max(0.0, (started_ms - self.request.submitted) / 1000))
        self.trace.admitted()
        try:
            async for delta in stream:
                if self.fenced:
                    self.trace.abandon("fenced")
                    return None
                if delta.token_ids:
                    now = ms_now()
                    if first_ms is None:
                        first_ms = now
                        self.trace.first_token()
                        self._metrics.time_to_first_token.observe(max(0.0, (now - self.request.submitted) / 1000))
                    elif last_ms is not None:
                        for _ in delta.token_ids:  # a merged delta: its tokens shared the interval
                            self._metrics.inter_token_latency.observe((now - last_ms) / 1000 / len(delta.token_ids))
                    last_ms = now
                    self._publish_tokens(delta)
                if delta.finish_reason is not None:
                    reason, syntax = delta.finish_reason.value, delta.tool_syntax
                    self._finish(reason, stream.prompt_tokens, started_ms, first_ms, syntax)
        except EngineClosed:
            self._log.info("stopped by shutdown", request_id=self.request.id)
            self.trace.abandon("shutdown")
        except EngineFailed as error:
            self._log.warning(
                "engine failed under request", request_id=self.request.id, implicated=error.implicated, error=str(error)
            )
            self.trace.abandon("engine failure", error=str(error))
            return error
        except EngineError as error:
            self.fail(error)
        finally:
            self.trace.abandon("stopped")  # a no-op for an attempt that ended or stopped above
        return None

    def _finish(
        self, reason: str, prompt_tokens: int, started_ms: int, first_ms: int | None, tool_syntax: str | None = None
    ) -> None:
        """The engine finished the request: its `done` event, its per-request histograms, its publish span."""
        event = done_event(
            self.request,
            self.ready,
            reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=self.tokens,
            started_ms=started_ms,
            first_ms=first_ms,
        )
        event.tool_syntax = tool_syntax
        finished_ms = ms_now()
        metrics = self._metrics
        metrics.e2e_latency.observe(max(0.0, (event.timings.total_ms or 0) / 1000))
        metrics.request_prompt_tokens.observe(prompt_tokens)
        metrics.request_generation_tokens.observe(self.tokens)
        metrics.request_inference_time.observe(max(0, finished_ms - started_ms) / 1000)
        if first_ms is not None:  # this attempt's own phases: admission -> first token -> finish
            metrics.request_prefill_time.observe(max(0, first_ms - started_ms) / 1000)
            metrics.request_decode_time.observe(max(0, finished_ms - first_ms) / 1000)
        self._send_final(event, self.trace.finished(reason, prompt_tokens=prompt_tokens, completion_tokens=self.tokens))
        self._log.info("finished", request_id=self.request.id, reason=reason, tokens=self.tokens)

    def _publish_tokens(self, delta: OutputDelta) -> None:
        logprobs = None if delta.logprobs is None else [_wire_logprob(lp) for lp in delta.logprobs]
        event = TokensEvent(
            seq=self.tokens, ids=delta.token_ids, text=delta.text, logprobs=logprobs, tool_syntax=delta.tool_syntax
        )
        self._publisher.tokens(self.target, event)
        self.tokens += len(delta.token_ids)
        if self.target.reply_to is not None:
            self._texts.append(delta.text)
            self._ids.extend(delta.token_ids)

    def fail(self, error: EngineError) -> None:
        """Ends the request with the wire error its engine error maps to, naming the field a rejection blames."""
        event = error_event(error)
        self._send_final(event, self.trace.failed(str(event.code), str(error)))

    def _send_final(
        self, event: DoneEvent | ErrorEvent, written: Callable[[PublishOutcome | str], None] | None
    ) -> None:
        """The terminal event to the publisher; `written` (the trace's publish span, when it records) hears it
        written. Untraced, the call is the publisher's plain one (as a test's fake publisher takes it)."""
        if written is None:
            self._publisher.finish(self.target, event, seq=self.tokens, output=self.output)
        else:
            self._publisher.finish(self.target, event, seq=self.tokens, output=self.output, on_written=written)
