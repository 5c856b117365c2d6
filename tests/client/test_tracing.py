"""The client's tracing: a `llmq.submit` PRODUCER span per submit, its context in the entry's trace field; nothing
(no field, no error) without a tracer provider or without OpenTelemetry at all; the processes' SDK set-up from
the standard OTEL_* variables. Also the span store the worker's and the gateway's tracing tests share (`spans`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis

from client import QueueFull, RedisUnavailable, protocol
from client.protocol import MAX_TRACE_BYTES, TRACE_FIELD, decode_trace, encode_trace
from tests.client.twins import KEYS, Twin, TwinFactory

pytest.importorskip("opentelemetry.sdk", reason="the 'tracing' extra is not installed")

from opentelemetry import trace  # after the skip: the suite runs without the extra
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

ROOT = Path(__file__).parent.parent.parent
TENANCY = {protocol.TENANT_FIELD, protocol.COST_FIELD}  # every entry's tenant and cost, beside its trace context


class SwitchedProvider(TracerProvider):
    """The SDK's provider, recording only while a test asks for `spans`: the rest of the suite runs as a process
    with no provider does (the API allows one provider per process, and the code asks for its tracer each time)."""

    recording = False

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return super().get_tracer(*args, **kwargs) if self.recording else trace.NoOpTracer()


_STORE: list[tuple[SwitchedProvider, InMemorySpanExporter]] = []


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans finished during this test, kept in memory."""
    if not _STORE:
        provider, exporter = SwitchedProvider(), InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _STORE.append((provider, exporter))
    provider, exporter = _STORE[0]
    assert trace.get_tracer_provider() is provider, "another tracer provider was installed in this process"
    exporter.clear()
    provider.recording = True
    try:
        yield exporter
    finally:
        provider.recording = False
        exporter.clear()


def spans_of(exporter: InMemorySpanExporter, request_id: str) -> dict[str, ReadableSpan]:
    """A request's spans by name (each name once: one attempt, one request)."""
    found = [s for s in exporter.get_finished_spans() if (s.attributes or {}).get("llmq.request.id") == request_id]
    named = {span.name: span for span in found}
    assert len(named) == len(found), sorted(span.name for span in found)
    return named


async def entry_fields(server: aioredis.Redis) -> dict[bytes, bytes]:
    [(_, fields)] = await server.xrange(KEYS.requests)
    return fields


# --- the trace field ----------------------------------------------------------------------------------------


def test_trace_field_round_trips_a_carrier_and_ignores_anything_else() -> None:
    carrier = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "tracestate": "a=b"}
    assert decode_trace(encode_trace(carrier)) == carrier
    assert encode_trace({}) == b""  # nothing to carry: no field
    assert encode_trace({"tracestate": "x" * MAX_TRACE_BYTES}) == b""  # no trace context is this big
    assert decode_trace(None) == decode_trace(b"") == decode_trace(b"\xc1") == {}  # \xc1: never valid msgpack
    assert decode_trace(msgpack.packb([1, 2])) == {}
    assert decode_trace(msgpack.packb({"traceparent": 5, "ok": "yes", "list": ["x"]})) == {"ok": "yes"}
    assert decode_trace(msgpack.packb({7: "x"})) == {}


# --- submits ------------------------------------------------------------------------------------------------


async def test_a_submit_is_a_producer_span_under_the_callers_and_its_context_rides_in_the_entry(
    twin: Twin, server: aioredis.Redis, spans: InMemorySpanExporter
) -> None:
    with trace.get_tracer("test").start_as_current_span("caller") as caller:
        job = await twin.submit("hello", max_new_tokens=5, temperature=0.5, seed=3, priority="batch")
    [(_, fields)] = await server.xrange(KEYS.lane("batch"))
    assert set(fields) == {protocol.ENTRY_FIELD, protocol.NOTIFY_FIELD, TRACE_FIELD, protocol.AFFINITY_FIELD, *TENANCY}
    submit = spans_of(spans, job.id)["llmq.submit"]
    assert submit.kind is SpanKind.PRODUCER and submit.status.status_code is StatusCode.UNSET
    assert submit.parent is not None and submit.parent.span_id == caller.get_span_context().span_id
    context = submit.get_span_context()
    version, trace_id, parent_id, flags = decode_trace(fields[TRACE_FIELD])["traceparent"].split("-")
    assert (trace_id, parent_id) == (f"{context.trace_id:032x}", f"{context.span_id:016x}")  # the submit span's
    assert version == "00" and int(flags, 16) & 1  # sampled
    attributes = dict(submit.attributes or {})
    assert attributes["llmq.queue"] == "default" and attributes["llmq.lane"] == "batch"
    assert attributes["messaging.destination.name"] == KEYS.lane("batch") and attributes["llmq.partition"] == 0
    assert attributes["llmq.submit.outcome"] == "added" and attributes["gen_ai.request.max_tokens"] == 5
    assert (attributes["gen_ai.request.temperature"], attributes["gen_ai.request.seed"]) == (0.5, 3)
    assert submit.end_time is not None and submit.start_time is not None and submit.end_time >= submit.start_time


async def test_a_refused_submit_ends_its_span_failed_and_a_duplicate_says_so(
    make_twin: TwinFactory, spans: InMemorySpanExporter
) -> None:
    twin = make_twin(max_queue_len=1)
    await twin.submit("one", request_id="first")
    await twin.submit("one", request_id="first")  # the same id again: nothing added
    with pytest.raises(QueueFull):
        await twin.submit("two", request_id="second")
    first = [s for s in spans.get_finished_spans() if (s.attributes or {}).get("llmq.request.id") == "first"]
    assert [s.attributes["llmq.submit.outcome"] for s in first] == ["added", "duplicate"]  # type: ignore[index]
    refused = spans_of(spans, "second")["llmq.submit"]
    assert refused.status.status_code is StatusCode.ERROR and "QueueFull" in (refused.status.description or "")
    assert (refused.attributes or {})["llmq.submit.outcome"] == "full"


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_submit_that_fails_ends_its_span_failed_at_once(kind: str, spans: InMemorySpanExporter) -> None:
    """No Redis to reach: the submit raises `RedisUnavailable`, and its span is finished (as failed) when it does,
    not left open for a later submit to close."""
    twin = Twin(kind, "redis://127.0.0.1:1/0", failover_timeout=0)
    try:
        with pytest.raises(RedisUnavailable):
            await twin.submit("hello", request_id="nowhere")
        failed = spans_of(spans, "nowhere")["llmq.submit"]
    finally:
        await twin.close()
    assert failed.status.status_code is StatusCode.ERROR and "RedisUnavailable" in (failed.status.description or "")
    assert (failed.attributes or {})["llmq.submit.outcome"] == "failed"


def run_python(code: str, env: dict[str, str] | None = None) -> str:
    """`code` in a fresh interpreter (from the checkout, with this one's packages), its stdout."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | (env or {})
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


BLOCK_OPENTELEMETRY = """
import sys
class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
sys.meta_path.insert(0, NoOpenTelemetry())
"""

SUBMIT_AND_SHOW_FIELDS = """
import sys
import redis
import client.tracing
from client import Client
with Client(URL, queue="untraced") as llmq:
    job = llmq.submit("hello", request_id="plain")
[(_, fields)] = redis.Redis.from_url(URL).xrange(llmq.keys.requests)
print(sorted(k.decode() for k in fields), client.tracing.enabled(), job.id)
print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")[:1])
"""


@pytest.mark.parametrize("blocked", [True, False], ids=["no-opentelemetry", "no-tracer-provider"])
def test_without_opentelemetry_or_a_provider_a_submit_writes_no_trace_field(blocked: bool, redis_url: str) -> None:
    code = (BLOCK_OPENTELEMETRY if blocked else "") + f"URL = {redis_url!r}\n" + SUBMIT_AND_SHOW_FIELDS
    fields, loaded = run_python(code).splitlines()
    assert fields == f"['c', 'k', 'm', 'n', 'o'] {not blocked} plain"  # and no 't'
    assert (loaded == "[]") is blocked  # blocked: not even a module of it was loaded, and the client worked


# --- the processes' SDK set-up ------------------------------------------------------------------------------

SHOW_SETUP = """
import json
from opentelemetry import trace
from client.tracing import configure_from_env
setup = configure_from_env("llmq-test")
provider = trace.get_tracer_provider()
processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", ())
print(json.dumps({
    "exporters": setup.exporters,
    "problems": setup.problems,
    "provider": type(provider).__name__,
    "service": getattr(provider, "resource", None) and provider.resource.attributes.get("service.name"),
    "exporter_classes": [type(p.span_exporter).__name__ for p in processors],
    "again": configure_from_env("other").exporters,
}))
"""


@pytest.mark.parametrize(
    ("env", "exporters", "classes", "service"),
    [
        ({}, [], [], None),  # nothing asked: no provider, every span the API's no-op
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, [], [], None),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}, [], [], None),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"], ["ConsoleSpanExporter"], "llmq-test"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SERVICE_NAME": "mine"},
            ["otlp"],
            ["OTLPSpanExporter"],
            "mine",
        ),
    ],
    ids=["unset", "none", "sdk-disabled", "console", "endpoint"],
)
def test_processes_configure_the_sdk_only_as_the_otel_variables_say(
    env: dict[str, str], exporters: list[str], classes: list[str], service: str | None
) -> None:
    shown = json.loads(run_python(SHOW_SETUP, env))
    assert (shown["exporters"], shown["problems"], shown["exporter_classes"]) == (exporters, [], classes)
    assert shown["provider"] == ("TracerProvider" if exporters else "ProxyTracerProvider")
    assert shown["service"] == service
    assert shown["again"] == (["preconfigured"] if exporters else [])  # once per process


def test_an_exporter_that_is_not_installed_is_a_problem_not_a_failure() -> None:
    env = {"OTEL_TRACES_EXPORTER": "zipkin,console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    shown = json.loads(run_python(SHOW_SETUP, env))
    assert shown["exporters"] == ["console"] and shown["exporter_classes"] == ["ConsoleSpanExporter"]
    assert shown["problems"] == ["no span exporter 'zipkin' is installed (OTEL_TRACES_EXPORTER=zipkin)"]
