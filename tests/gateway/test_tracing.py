"""A traced HTTP request end to end (the gateway under uvicorn, an in-process worker, a real Redis): the gateway's
SERVER span, the client's submit under it, and the worker's request span with its phases under that, all in one
trace, which continues the caller's when its headers carry one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.polling import wait_until

pytest.importorskip("opentelemetry.sdk", reason="the 'tracing' extra is not installed")

from opentelemetry.sdk.trace import ReadableSpan  # after the skip: the suite runs without the extra
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.client import test_tracing as client_tracing

spans = client_tracing.spans  # the fixture, shared
HI = [{"role": "user", "content": "hi"}]
WORKER_PHASES = ["llmq.queue_wait", "llmq.prefill", "llmq.decode", "llmq.publish"]


def servers(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.kind is SpanKind.SERVER]


def child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    context = parent.get_span_context()
    return (
        span.parent is not None
        and span.parent.span_id == context.span_id
        and span.get_span_context().trace_id == context.trace_id
    )


async def serving(gateway: Any, start_worker: Any, exporter: InMemorySpanExporter) -> tuple[Any, str]:
    """A gateway in front of a worker, and the worker's model once listed (the listing's spans dropped)."""
    await start_worker()
    served = await gateway()
    model = await served.model()
    exporter.clear()
    return served, model


async def traced_request(exporter: InMemorySpanExporter, request_id: str) -> dict[str, ReadableSpan]:
    """A request's spans by name, the gateway's too, once the worker's have all ended."""
    await wait_until(lambda: "llmq.request" in client_tracing.spans_of(exporter, request_id))
    [server] = servers(exporter)
    return {**client_tracing.spans_of(exporter, request_id), "server": server}


async def test_a_traced_http_request_is_one_trace_from_the_gateway_to_the_worker(
    gateway: Any, start_worker: Any, spans: InMemorySpanExporter
) -> None:
    served, model = await serving(gateway, start_worker, spans)
    answer = await served.sdk().chat.completions.create(model=model, messages=HI, max_tokens=3)
    by_name = await traced_request(spans, answer.id)
    assert sorted(by_name) == sorted(["server", "llmq.submit", "llmq.request", *WORKER_PHASES])
    server, submit, request = by_name["server"], by_name["llmq.submit"], by_name["llmq.request"]
    assert server.name == "POST /v1/chat/completions" and server.parent is None  # no traceparent came with it
    assert server.status.status_code is StatusCode.UNSET
    attributes = dict(server.attributes or {})
    assert attributes["http.request.method"] == "POST" and attributes["http.route"] == "/v1/chat/completions"
    assert attributes["url.path"] == "/v1/chat/completions" and attributes["http.response.status_code"] == 200
    assert submit.kind is SpanKind.PRODUCER and child_of(submit, server)
    assert request.kind is SpanKind.CONSUMER and child_of(request, submit)
    assert all(child_of(by_name[phase], request) for phase in WORKER_PHASES)
    assert {span.get_span_context().trace_id for span in by_name.values()} == {server.get_span_context().trace_id}
    assert (request.attributes or {})["gen_ai.usage.output_tokens"] == 3


async def test_a_streamed_request_continues_the_callers_trace_and_its_span_ends_with_the_stream(
    gateway: Any, start_worker: Any, spans: InMemorySpanExporter
) -> None:
    served, model = await serving(gateway, start_worker, spans)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with served.http() as http:
        body = {"model": model, "messages": HI, "max_tokens": 4, "stream": True}
        headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=kept"}
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer:
            lines = [line async for line in answer.aiter_lines() if line.startswith("data: {")]
    request_id = json.loads(lines[0].removeprefix("data: "))["id"]
    by_name = await traced_request(spans, request_id)
    server = by_name["server"]
    assert server.parent is not None and f"{server.parent.span_id:016x}" == parent_id and server.parent.is_remote
    assert f"{server.get_span_context().trace_id:032x}" == trace_id
    assert server.get_span_context().trace_state.get("vendor") == "kept"
    assert {f"{span.get_span_context().trace_id:032x}" for span in by_name.values()} == {trace_id}
    assert child_of(by_name["llmq.submit"], server) and child_of(by_name["llmq.request"], by_name["llmq.submit"])
    # The stream's last chunk follows the engine's finish: the server span lasts past the decode.
    assert server.end_time is not None and server.end_time >= by_name["llmq.decode"].end_time  # type: ignore[operator]


async def test_answers_without_a_route_or_with_an_error_are_spans_too(
    gateway: Any, spans: InMemorySpanExporter
) -> None:
    served = await gateway(redis_url="redis://127.0.0.1:1/0", redis_failover_timeout_s=0.2)
    async with served.http() as http:
        missing = await http.get("/nope")
        unavailable = await http.get("/v1/models/some/model")
    assert (missing.status_code, unavailable.status_code) == (404, 503)
    by_path = {(span.attributes or {})["url.path"]: span for span in servers(spans)}
    assert by_path["/nope"].name == "GET" and "http.route" not in (by_path["/nope"].attributes or {})
    assert by_path["/nope"].status.status_code is StatusCode.UNSET  # a 4xx is the caller's error, not ours
    model = by_path["/v1/models/some/model"]
    assert model.name == "GET /v1/models/{model}" and (model.attributes or {})["http.response.status_code"] == 503
    assert model.status.status_code is StatusCode.ERROR
