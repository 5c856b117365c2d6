"""OpenTelemetry for the client: a `llmq.submit` PRODUCER span per submit, whose context rides in the request entry
(`client.protocol.TRACE_FIELD`) so that the worker's spans continue the caller's trace.

The client is a library: it uses only the OpenTelemetry *API*, never configures an SDK, and imports without it.
With no `opentelemetry-api` installed, or with no tracer provider configured by the application (the API's
default is a no-op), a submit starts nothing that records and writes no trace field. The spans go wherever the
application's tracer provider sends them (see docs/operations/tracing.md).

The twins' submit runs inside `BaseClient.submitting` (which starts the span, packs its context, and ends it as
failed if the round trip raises) and `check_submitted` ends it with the script's answer; the span in between
waits in a context variable, which is the caller's own for each thread and each asyncio task.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from client.protocol import GenerateRequest, encode_trace

if TYPE_CHECKING:
    from client.store import Keys

# The one optional import of OpenTelemetry (the worker's and the gateway's tracing use these): None without it.
try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # tracing is optional: the `tracing` extra
    otel_context = propagate = trace = None  # type: ignore[assignment]

TRACER_NAME = "llmq.client"
SUBMIT_SPAN = "llmq.submit"
MESSAGING_SYSTEM = "llmq"

# The submit span between `start_submit` and `end_submit`.
_submitting: contextvars.ContextVar[Any] = contextvars.ContextVar("llmq_submitting", default=None)


def enabled() -> bool:
    """Whether the OpenTelemetry API can be imported (spans record only if a provider is configured too)."""
    return trace is not None


def tracer(name: str) -> Any:
    """The tracer called `name`, or None when no span could record: no OpenTelemetry, or no tracer provider
    installed (the API's default), so that untraced work skips even building its spans' attributes."""
    if trace is None or isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None
    found = trace.get_tracer(name)
    return None if isinstance(found, trace.NoOpTracer) else found


def request_attributes(request: GenerateRequest) -> dict[str, Any]:
    """The attributes every span of a request carries (`llmq.*`, and gen_ai names where they fit)."""
    params = request.params
    attributes: dict[str, Any] = {
        "llmq.request.id": request.id,
        "gen_ai.request.max_tokens": params.max_new_tokens,
    }
    for name, value in (
        ("gen_ai.request.temperature", params.temperature),
        ("gen_ai.request.top_p", params.top_p),
        ("gen_ai.request.top_k", params.top_k),
        ("gen_ai.request.seed", params.seed),
    ):
        if value is not None:
            attributes[name] = value
    return attributes


def start_submit(request: GenerateRequest, keys: Keys, lane: str) -> bytes:
    """Starts this submit's PRODUCER span (a child of the caller's current span) and returns its context as the
    entry's trace field (b"": none, as when nothing records)."""
    found = tracer(TRACER_NAME)
    if found is None:
        return b""
    span = found.start_span(
        SUBMIT_SPAN,
        kind=trace.SpanKind.PRODUCER,
        attributes={
            **request_attributes(request),
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.type": "send",
            "messaging.destination.name": keys.lane(lane),
            "messaging.message.id": request.id,
            "llmq.queue": keys.queue,
            "llmq.lane": lane,
            "llmq.partition": keys.partition,
        },
    )
    _submitting.set(span)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return encode_trace(carrier)


def end_submit(outcome: str, error: str | None = None) -> None:
    """Ends the span `start_submit` started in this context: `outcome` is the script's answer (added, duplicate,
    full); `error` marks it failed."""
    span = _submitting.get()
    if span is None:
        return
    span.set_attribute("llmq.submit.outcome", outcome)
    _end(span, error=error)


def _end(span: Any, *, error: str | None) -> None:
    if span is None:
        return
    _submitting.set(None)
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()


# --- for the processes ---------------------------------------------------------------------------------------
# The worker and the gateway are programs, so they set up the SDK themselves, as the standard OTEL_* variables say
# (the client library never calls this).

_OTLP_BY_PROTOCOL = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}


@dataclass(frozen=True)
class TracingSetup:
    """What `configure_from_env` did: the exporters spans go to from this process (`preconfigured`: the program's
    own tracer provider; none: tracing is off, every span is the API's no-op), and what it could not set up."""

    exporters: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    def report(self, log: Any, on: str, failed: str) -> None:
        """Logs it on a structlog-style `log`: `on` with the exporters if any, `failed` for each problem."""
        if self.exporters:
            log.info(on, exporters=list(self.exporters))
        for problem in self.problems:
            log.warning(failed, problem=problem)


_setup: TracingSetup | None = None


def configure_from_env(service_name: str, environ: Mapping[str, str] | None = None) -> TracingSetup:
    """Installs the SDK's tracer provider once per process, as OpenTelemetry's variables describe.

    Off unless `OTEL_TRACES_EXPORTER` names exporters (`otlp`, `console`, or any installed under the SDK's
    `opentelemetry_traces_exporter` entry points; `none`: off) or an OTLP endpoint is set
    (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: then `otlp`); `OTEL_SDK_DISABLED=true`
    turns it off whatever else is set. `otlp` speaks `OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`, http/protobuf by
    default (the OTLP specification's default; the `tracing` extra installs that exporter). The exporters read
    their own variables (endpoint, headers, timeout, TLS), the sampler is `OTEL_TRACES_SAMPLER`, the resource
    `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_SERVICE_NAME` (else `service_name`). A tracer provider the program
    installed already (say `opentelemetry-instrument`) is kept as it is."""
    global _setup
    if trace is None:
        return TracingSetup()
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return TracingSetup(("preconfigured",))
    if _setup is None:
        env = os.environ if environ is None else environ
        names = _exporter_names(env)
        try:
            _setup = _install(service_name, names, env) if names else TracingSetup()
        except ImportError as error:  # the API without the SDK
            _setup = TracingSetup(problems=(f"{error} (install the 'tracing' extra)",))
    return _setup


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    """The exporters the variables ask for ([]: tracing off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = env.get("OTEL_TRACES_EXPORTER", "").strip()
    if not names:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        names = "otlp" if endpoint else ""
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    return [] if [name.lower() for name in chosen] == ["none"] else chosen


def _install(service_name: str, names: list[str], env: Mapping[str, str]) -> TracingSetup:
    from importlib.metadata import entry_points

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    installed, problems = [], []
    for name in names:
        entry = name
        if name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            entry = _OTLP_BY_PROTOCOL.get((protocol or "http/protobuf").strip(), f"otlp ({protocol})")
        found = entry_points(group="opentelemetry_traces_exporter", name=entry)
        if not found:
            problems.append(f"no span exporter {entry!r} is installed (OTEL_TRACES_EXPORTER={name})")
            continue
        try:
            exporter = next(iter(found)).load()()
        except Exception as error:  # a third-party exporter's own failure: the others still export
            problems.append(f"span exporter {entry!r} failed to start: {error!r}")
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
        installed.append(name)
    if installed:
        trace.set_tracer_provider(provider)
    return TracingSetup(tuple(installed), tuple(problems))
