"""OpenTelemetry for the worker: each attempt of a request is a CONSUMER span that continues the submitter's trace
(the entry's `TRACE_FIELD`), with one child span per phase, back to back:

    llmq.request (CONSUMER)   submit time (first attempt) or admission (a resumed one) -> final event written
      llmq.queue_wait         submit time -> admission to the engine   (first attempt only)
      llmq.prefill            admission -> first token
      llmq.decode             first token -> finish
      llmq.publish            finish -> the flush that wrote the final event

A resumed attempt (the fence's attempt > 1: claimed after a crash, a lease lapse, a hand-back) is in the same
trace, with a Link to the submitted context that carries its attempt number. Spans go to whatever tracer provider
the process has (`client.tracing.configure_from_env`); with none, or without OpenTelemetry installed, every call
here is a no-op. Timestamps are explicit (epoch ns): the submit time comes from the request, the rest from the
relay (`worker.relay`) as it sees each phase begin.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from client.scripts import PublishOutcome
from client.tracing import MESSAGING_SYSTEM, propagate, request_attributes, trace, tracer

if TYPE_CHECKING:
    from collections.abc import Callable

    from client.store import Keys
    from worker.intake import Ready

TRACER_NAME = "llmq.worker"
REQUEST_SPAN = "llmq.request"
QUEUE_WAIT_SPAN = "llmq.queue_wait"
PREFILL_SPAN = "llmq.prefill"
DECODE_SPAN = "llmq.decode"
PUBLISH_SPAN = "llmq.publish"


class RequestTrace:
    """The spans of one attempt of one request, in the order the relay calls: `admitted`, `first_token`, then
    `finished` or `failed` (whose callback ends the publish span when the publisher has written the final event),
    or `abandon` for an attempt that stops without an end of its own."""

    def __init__(self, ready: Ready, keys: Keys | None = None) -> None:
        self._ready = ready
        self._keys = keys
        self._begun = False
        self._request: Any = None  # the CONSUMER span, while it records (None: untraced, or sampled out)
        self._tracer: Any = None
        self._phase: Any = None  # the phase span now open
        self._publishing = False  # the final event is with the publisher: the publish span ends the trace

    def admitted(self) -> None:
        """The engine took the request: the CONSUMER span starts (at the submit time, for a first attempt), the
        queue wait ends, prefill begins."""
        if self._begun:
            return
        self._begun = True
        found = tracer(TRACER_NAME)
        if found is None:
            return
        now = time.time_ns()
        ready, accepted = self._ready, self._ready.accepted
        request = accepted.request
        parent = propagate.extract(dict(accepted.trace)) if accepted.trace else None
        submitted = min(request.submitted * 1_000_000, now)  # a submitter's clock ahead of ours: not in the future
        attributes = {
            **request_attributes(request),
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.type": "process",
            "messaging.message.id": request.id,
            "llmq.lane": accepted.lane,
            "llmq.partition": accepted.partition,
            "llmq.attempt": ready.attempt,
        }
        if self._keys is not None:
            attributes["llmq.queue"] = self._keys.queue
            attributes["messaging.destination.name"] = self._keys.lane(accepted.lane)
        links = []
        if ready.attempt > 1:
            attributes["llmq.resumed_tokens"] = len(ready.delivered_ids)
            submitter = trace.get_current_span(parent).get_span_context() if parent is not None else None
            if submitter is not None and submitter.is_valid:
                links.append(trace.Link(submitter, {"llmq.attempt": ready.attempt}))
        span = found.start_span(
            REQUEST_SPAN,
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
            start_time=submitted if ready.attempt == 1 else now,
        )
        if not span.is_recording():  # sampled out: nothing would keep it, nor its children; the rest is a no-op
            return
        self._request, self._tracer = span, found
        if ready.attempt == 1:
            self._child(QUEUE_WAIT_SPAN, submitted).end(end_time=now)
        self._phase = self._child(PREFILL_SPAN, now)

    def first_token(self) -> None:
        """Prefill ends, decode begins."""
        if self._phase is not None and not self._publishing:
            now = time.time_ns()
            self._phase.end(end_time=now)
            self._phase = self._child(DECODE_SPAN, now)

    def finished(
        self, reason: str, *, prompt_tokens: int, completion_tokens: int
    ) -> Callable[[PublishOutcome | str], None] | None:
        """The engine finished it: the phase ends, and the publish span starts; the callback (for
        `Publisher.finish`) ends it and the CONSUMER span. `prompt_tokens` is the request's prompt (its usage);
        the attempt's input adds what a resumed attempt prefilled beyond it, the tokens already published."""
        if self._request is None:
            return None
        resumed = len(self._ready.delivered_ids) if self._ready.attempt > 1 else 0
        self._request.set_attributes(
            {
                "gen_ai.response.finish_reasons": [reason],
                "gen_ai.usage.input_tokens": prompt_tokens + resumed,
                "gen_ai.usage.output_tokens": completion_tokens,
                "llmq.finish_reason": reason,
            }
        )
        return self._publish()

    def failed(self, code: str, message: str) -> Callable[[PublishOutcome | str], None] | None:
        """It ends with an `error` event (`code`): as `finished`, the CONSUMER span marked failed. A request the
        engine refused at once has no span yet: it starts here."""
        self.admitted()
        if self._request is None:
            return None
        self._request.set_attribute("llmq.error.code", code)
        self._request.set_status(trace.Status(trace.StatusCode.ERROR, message))
        return self._publish()

    def abandon(self, reason: str, error: str | None = None) -> None:
        """The attempt stops without an end of its own (`reason`: fenced, shutdown, engine failure): whoever claims
        the request next continues in a new attempt. A no-op once the final event is with the publisher."""
        if self._request is None or self._publishing:
            return
        self._publishing = True
        now = time.time_ns()
        if self._phase is not None:
            self._phase.end(end_time=now)
        self._request.set_attribute("llmq.stopped", reason)
        if error is not None:
            self._request.set_status(trace.Status(trace.StatusCode.ERROR, error))
        self._request.end(end_time=now)

    def _publish(self) -> Callable[[PublishOutcome | str], None] | None:
        if self._publishing:
            return None
        self._publishing = True
        now = time.time_ns()
        if self._phase is not None:
            self._phase.end(end_time=now)
        self._phase = self._child(PUBLISH_SPAN, now)
        return self._written

    def _written(self, outcome: PublishOutcome | str) -> None:
        """The publisher's answer for the final event (this runs in its flusher: it must not raise)."""
        now = time.time_ns()
        name = outcome if isinstance(outcome, str) else outcome.name.lower()
        self._phase.set_attribute("llmq.publish.outcome", name)
        if outcome != PublishOutcome.WRITTEN:
            failure = trace.Status(trace.StatusCode.ERROR, f"the final event was not written: {name}")
            self._phase.set_status(failure)
            self._request.set_status(failure)
        self._phase.end(end_time=now)
        self._request.end(end_time=now)

    def _child(self, name: str, start_ns: int) -> Any:
        return self._tracer.start_span(
            name,
            context=trace.set_span_in_context(self._request),
            attributes={"llmq.request.id": self._ready.accepted.request.id},
            start_time=start_ns,
        )
