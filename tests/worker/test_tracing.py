"""The worker's spans (an in-process worker on the scripted engine, a real Redis): each attempt continues the
submitter's trace with a CONSUMER span and its phases back to back; an entry without a trace context (an older
client, one without OpenTelemetry) runs as its own trace; a resumed attempt links the submitted context. And the
per-request histograms the relay observes, scraped."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob
from client.protocol import ENTRY_FIELD, PROTOCOL_VERSION, TRACE_FIELD, encode, ms_now, parse_request
from client.scripts import PublishOutcome
from client.store import Keys
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until
from tests.worker.test_metrics import scrape
from worker.embedded_redis import free_port
from worker.intake import Accepted, Ready
from worker.tracing import RequestTrace

pytest.importorskip("opentelemetry.sdk", reason="the 'tracing' extra is not installed")

from opentelemetry import trace  # after the skip: the suite runs without the extra
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.client import test_tracing as client_tracing

KEYS = Keys("default")
spans = client_tracing.spans  # the fixture, shared
spans_of = client_tracing.spans_of
PHASES = ["llmq.queue_wait", "llmq.prefill", "llmq.decode", "llmq.publish"]


def named(exporter: InMemorySpanExporter, request_id: str, name: str) -> list[ReadableSpan]:
    """A request's spans called `name`, in the order they ended."""
    return [
        span
        for span in exporter.get_finished_spans()
        if span.name == name and (span.attributes or {}).get("llmq.request.id") == request_id
    ]


def request_spans(exporter: InMemorySpanExporter, request_id: str) -> list[ReadableSpan]:
    """A request's CONSUMER spans, one per attempt."""
    return named(exporter, request_id, "llmq.request")


def assert_phases_under(request: ReadableSpan, by_name: dict[str, ReadableSpan], phases: list[str]) -> None:
    """Each phase is a child of `request`, in its trace, starting where the one before ends."""
    context = request.get_span_context()
    for name in phases:
        phase = by_name[name]
        assert phase.parent is not None and phase.parent.span_id == context.span_id, name
        assert phase.get_span_context().trace_id == context.trace_id, name
    for before, after in itertools.pairwise(phases):
        assert by_name[before].end_time == by_name[after].start_time, (before, after)
    assert request.start_time == by_name[phases[0]].start_time
    assert request.end_time == by_name[phases[-1]].end_time


async def test_a_submits_context_reaches_the_workers_spans(
    start_worker: Any, client: AsyncClient, spans: InMemorySpanExporter
) -> None:
    await start_worker()
    with trace.get_tracer("test").start_as_current_span("caller"):
        job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=6, temperature=0, ignore_eos=True)
    result = await job.result(timeout=30)
    await wait_until(lambda: request_spans(spans, job.id))  # it ends once the final flush is written
    by_name = spans_of(spans, job.id)
    assert sorted(by_name) == sorted(["llmq.submit", "llmq.request", *PHASES])
    submit, request = by_name["llmq.submit"], by_name["llmq.request"]
    assert request.kind is SpanKind.CONSUMER and request.status.status_code is StatusCode.UNSET
    assert request.parent is not None and request.parent.span_id == submit.get_span_context().span_id
    assert request.get_span_context().trace_id == submit.get_span_context().trace_id and not request.links
    assert_phases_under(request, by_name, PHASES)
    assert by_name["llmq.queue_wait"].start_time <= submit.end_time  # type: ignore[operator] - from the submit time
    attributes = dict(request.attributes or {})
    assert attributes["llmq.request.id"] == job.id and attributes["llmq.attempt"] == 1
    assert [attributes[f"llmq.{name}"] for name in ("queue", "lane", "partition")] == ["default", "default", 0]
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.destination.name"] == KEYS.lane("default")
    assert attributes["gen_ai.usage.input_tokens"] == 3 and attributes["gen_ai.usage.output_tokens"] == 6
    assert attributes["llmq.finish_reason"] == "length" and attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert (by_name["llmq.publish"].attributes or {})["llmq.publish.outcome"] == "written"
    assert result.token_ids == expected_tokens([3, 4, 5], 6)


async def test_an_entry_without_a_trace_context_runs_as_a_trace_of_its_own(
    start_worker: Any, client: AsyncClient, redis_url: str, spans: InMemorySpanExporter
) -> None:
    """What an older client (or one without OpenTelemetry) writes: `m` alone; and a trace field nobody can read."""
    await start_worker()
    now = ms_now()
    async with Redis.from_url(redis_url) as redis:
        for request_id, extra in (("older", {}), ("garbled", {TRACE_FIELD: b"\xc1 not msgpack"})):
            fields = {"v": PROTOCOL_VERSION, "id": request_id, "input_ids": [7, 8], "submitted": now}
            request = parse_request({**fields, "params": {"max_new_tokens": 3, "temperature": 0}})
            await redis.xadd(KEYS.requests, {ENTRY_FIELD: encode(request), **extra})
    for request_id in ("older", "garbled"):
        result = await AsyncJob.attach(client, request_id).result(timeout=30)
        assert result.token_ids == expected_tokens([7, 8], 3)
        await wait_until(lambda request_id=request_id: request_spans(spans, request_id))
        by_name = spans_of(spans, request_id)
        assert sorted(by_name) == sorted(["llmq.request", *PHASES])  # no submit span: nobody traced it
        request = by_name["llmq.request"]
        assert request.parent is None and request.kind is SpanKind.CONSUMER  # a root: a trace of its own
        assert_phases_under(request, by_name, PHASES)
        assert request.start_time == now * 1_000_000  # the queue wait starts at the submit time


async def test_a_resumed_attempt_links_the_submitted_context(
    start_worker: Any, client: AsyncClient, spans: InMemorySpanExporter
) -> None:
    running = await start_worker(lease_timeout_s=5.0, claim_interval_s=0.1, step_s=0.01)
    job = await client.submit(input_ids=[5, 6, 7], max_new_tokens=30, temperature=0)
    async for _ in job.stream(timeout=30):
        running.worker.engine.fail_next_step()  # the engine dies under it after its first token: handed back
        break
    result = await job.result(timeout=60)
    assert result.token_ids == expected_tokens([5, 6, 7], 30)
    await wait_until(lambda: len(request_spans(spans, job.id)) == 2)
    first, second = request_spans(spans, job.id)
    [submit] = named(spans, job.id, "llmq.submit")
    submitted = submit.get_span_context()
    stopped = dict(first.attributes or {})
    assert stopped["llmq.attempt"] == 1 and stopped["llmq.stopped"] == "engine failure"
    assert first.status.status_code is StatusCode.ERROR and not first.links
    attributes = dict(second.attributes or {})
    assert attributes["llmq.attempt"] == 2 and attributes["llmq.resumed_tokens"] >= 1
    assert attributes["llmq.finish_reason"] == "length" and second.status.status_code is StatusCode.UNSET
    [link] = second.links
    assert link.context.span_id == submitted.span_id and link.context.trace_id == submitted.trace_id
    assert dict(link.attributes or {}) == {"llmq.attempt": 2}
    for attempt in (first, second):  # both in the submitter's trace, under its span
        assert attempt.parent is not None and attempt.parent.span_id == submitted.span_id
    [wait] = named(spans, job.id, "llmq.queue_wait")  # the first attempt's: a resumed one has none
    assert wait.parent is not None and wait.parent.span_id == first.get_span_context().span_id
    for phase in ("llmq.prefill", "llmq.decode", "llmq.publish"):
        parents = [span.parent.span_id for span in named(spans, job.id, phase) if span.parent is not None]
        if phase == "llmq.publish":  # the first attempt published no end: the engine failed under it
            assert parents == [second.get_span_context().span_id]
        else:
            assert parents == [first.get_span_context().span_id, second.get_span_context().span_id], phase


async def test_the_per_request_histograms_are_observed_once_per_finished_request(
    start_worker: Any, client: AsyncClient
) -> None:
    port = free_port()
    await start_worker(metrics_port=port, metrics_address="127.0.0.1")
    jobs = [
        await client.submit(input_ids=[3, 4, 5], max_new_tokens=4, temperature=0, ignore_eos=True),
        await client.submit(input_ids=[6, 7], max_new_tokens=9, temperature=0, ignore_eos=True),
    ]
    await asyncio.gather(*(job.result(timeout=30) for job in jobs))

    async def observed() -> bool:
        return (await asyncio.to_thread(scrape, port)).get("llmq:request_inference_time_seconds_count") == 2

    await wait_until(observed)
    metrics = await asyncio.to_thread(scrape, port)
    for name in ("prompt_tokens", "generation_tokens", "prefill_time_seconds", "decode_time_seconds"):
        assert metrics[f"llmq:request_{name}_count"] == 2, name
    assert metrics["llmq:request_prompt_tokens_sum"] == 3 + 2
    assert metrics["llmq:request_generation_tokens_sum"] == 4 + 9
    assert metrics["llmq:request_generation_tokens_bucket{le=5.0}"] == 1  # 4 tokens; the 9 are in le=10
    assert metrics["llmq:request_generation_tokens_bucket{le=10.0}"] == 2
    # Admission -> finish is admission -> first token plus first token -> finish, by the same clock readings.
    inference = metrics["llmq:request_inference_time_seconds_sum"]
    phases = metrics["llmq:request_prefill_time_seconds_sum"] + metrics["llmq:request_decode_time_seconds_sum"]
    assert abs(inference - phases) < 1e-9 and inference > 0


def test_a_final_event_not_written_fails_the_attempt_and_a_clock_ahead_is_no_future(
    spans: InMemorySpanExporter,
) -> None:
    ahead = ms_now() + 60_000  # the submitter's clock a minute ahead of ours
    request = parse_request({"v": PROTOCOL_VERSION, "id": "unit", "input_ids": [1, 2], "submitted": ahead})
    ready = Ready(Accepted(b"1-0", request), 1, False, [], "", False)
    attempt = RequestTrace(ready)
    attempt.admitted()
    attempt.first_token()
    written = attempt.finished("stop", prompt_tokens=2, completion_tokens=1)
    attempt.abandon("fenced")  # too late to stop it: its final event is with the publisher
    assert written is not None and not request_spans(spans, "unit")  # it ends with the publisher's answer
    written(PublishOutcome.FENCED)
    by_name = spans_of(spans, "unit")
    wait, span = by_name["llmq.queue_wait"], by_name["llmq.request"]
    assert span.status.status_code is StatusCode.ERROR and "llmq.stopped" not in (span.attributes or {})
    assert (by_name["llmq.publish"].attributes or {})["llmq.publish.outcome"] == "fenced"
    assert span.start_time == wait.start_time == wait.end_time < ahead * 1_000_000  # an empty wait, not a future one
    assert "llmq.queue" not in (span.attributes or {})  # no keys given: nothing to name
