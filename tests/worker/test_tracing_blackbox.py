"""Black-box checks of OpenTelemetry tracing (issue 29, item 5) against docs/operations/tracing.md and the `t`
field of docs/protocol.md, configured as a user configures it:

- the worker and the gateway as processes (`python -m worker` on a tiny model, `python -m gateway`, or the
  worker service on the scripted engine in a process of its own), set up from OTEL_* variables only and
  exporting over OTLP/HTTP to a small collector written here (http.server + opentelemetry-proto);
- in-process clients, workers and gateways recording into the SDK's `InMemorySpanExporter`, through the
  switchable provider of tests/client/test_tracing.py (one tracer provider per process);
- request entries written by hand (msgpack, as the protocol page describes) with hostile `t` fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import redis
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Client, Job, RedisUnavailable
from client.store import Keys
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until
from worker.embedded_redis import RedisServer, free_port

pytest.importorskip("opentelemetry.sdk", reason="the 'tracing' extra is not installed")

from opentelemetry import trace  # after the skip: the suite runs without the extra
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.client import test_tracing as client_tracing
from tests.gateway import conftest as gateway_conftest

gateway = gateway_conftest.gateway  # the in-process gateway fixture
spans = client_tracing.spans  # the switchable in-memory provider's fixture, shared with the other tracing tests

ROOT = Path(__file__).parent.parent.parent
PYTHON = sys.executable
KEYS = Keys("default")
PHASES = ["llmq.queue_wait", "llmq.prefill", "llmq.decode", "llmq.publish"]
WORKER_SPANS = ["llmq.request", *PHASES]
CHAT = "POST /v1/chat/completions"
# OTLP's enums
SERVER, PRODUCER, CONSUMER = 2, 4, 5
UNSET, ERROR = 0, 2


# ------------------------------------------------------------------------------------------ an OTLP collector


@dataclass(frozen=True)
class Exported:
    """One span as it reached the collector."""

    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    start: int
    end: int
    attributes: dict[str, Any]
    status: int
    status_message: str
    links: list[tuple[str, str, dict[str, Any]]]
    trace_state: str
    resource: dict[str, Any]
    path: str

    @property
    def service(self) -> str:
        return str(self.resource.get("service.name"))


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class Collector:
    """An OTLP/HTTP (protobuf) trace receiver on a free local port: every span any process exports to it."""

    def __init__(self) -> None:
        self.spans: list[Exported] = []
        self.posts: list[str] = []  # the paths posted to
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.receive(self.path, body)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def receive(self, path: str, body: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        found = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        Exported(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            start=span.start_time_unix_nano,
                            end=span.end_time_unix_nano,
                            attributes=_attributes(span.attributes),
                            status=span.status.code,
                            status_message=span.status.message,
                            links=[
                                (link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                                for link in span.links
                            ],
                            trace_state=span.trace_state,
                            resource=resource,
                            path=path,
                        )
                    )
        with self.lock:
            self.posts.append(path)
            self.spans.extend(found)

    def all(self) -> list[Exported]:
        with self.lock:
            return list(self.spans)

    def of(self, request_id: str) -> list[Exported]:
        return [span for span in self.all() if span.attributes.get("llmq.request.id") == request_id]

    def named(self, request_id: str, name: str) -> list[Exported]:
        return [span for span in self.of(request_id) if span.name == name]

    def in_trace(self, trace_id: str) -> list[Exported]:
        return [span for span in self.all() if span.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    receiver = Collector()
    try:
        yield receiver
    finally:
        receiver.close()


def poll(predicate: Callable[[], Any], within_s: float = 30.0, what: str = "a condition") -> Any:
    """Polls a sync `predicate` until it is truthy (and returns it); fails after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def back_to_back(request: Any, phases: list[Any]) -> None:
    """The phases are children of `request`, in its trace, each starting where the one before ends, and the
    request spans them exactly (works for `Exported` and for the SDK's `ReadableSpan` through `_ids`)."""
    request_trace, request_span, _ = _ids(request)
    for phase in phases:
        trace_id, _, parent = _ids(phase)
        assert (trace_id, parent) == (request_trace, request_span), _name(phase)
        assert _start(phase) <= _end(phase), _name(phase)
    for before, after in itertools.pairwise(phases):
        assert _end(before) == _start(after), (_name(before), _name(after))
    assert _start(request) == _start(phases[0]) and _end(request) == _end(phases[-1])


def _ids(span: Any) -> tuple[str, str, str]:
    """(trace id, span id, parent span id) as hex, "" for no parent."""
    if isinstance(span, Exported):
        return span.trace_id, span.span_id, span.parent_id
    context = span.get_span_context()
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else ""
    return f"{context.trace_id:032x}", f"{context.span_id:016x}", parent


def _start(span: Any) -> int:
    return int(span.start if isinstance(span, Exported) else span.start_time)


def _end(span: Any) -> int:
    return int(span.end if isinstance(span, Exported) else span.end_time)


def _name(span: Any) -> str:
    return str(span.name)


# ------------------------------------------------------------------------------------------ processes


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any OTEL_* or LLMQ_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMQ_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env | extra


def traced_env(collector: Collector, **extra: str) -> dict[str, str]:
    """What a user sets to send a process's spans to the collector, batches leaving within 50 ms."""
    return clean_env(**({"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"} | extra))


BLOCKER = """\
import sys


class _NoOpenTelemetry:
    # a meta-path finder in front of all others: opentelemetry looks uninstalled
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoOpenTelemetry())
"""


def without_opentelemetry(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` for a Python process in which opentelemetry is not installed (a sitecustomize blocks it)."""
    site = folder / "no-otel-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    return env | {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))}


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def out(self) -> str:
        return self.stdout.read_text(errors="replace")

    def err(self) -> str:
        return self.stderr.read_text(errors="replace")

    def tail(self) -> str:
        return f"--- {self.name} stdout\n{self.out()[-3000:]}\n--- stderr\n{self.err()[-3000:]}"

    def signal(self, signum: int) -> None:
        if self.alive():
            self.popen.send_signal(signum)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (a drain), then its exit status; killed after `timeout`."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            raise AssertionError(f"{self.name} did not stop on SIGTERM\n{self.tail()}") from None


class Processes:
    """Processes a test started; each is stopped (by its own pid) after the test."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[Process] = []

    def spawn(self, name: str, args: list[str], env: dict[str, str]) -> Process:
        stdout, stderr = self.folder / f"{name}.out", self.folder / f"{name}.err"
        with stdout.open("wb") as out, stderr.open("wb") as err:
            popen = subprocess.Popen(args, stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True)
        process = Process(name, popen, stdout, stderr)
        self.started.append(process)
        return process

    def scripted_worker(
        self, name: str, redis_url: str, env: dict[str, str], step_s: float = 0.01, **settings: Any
    ) -> Process:
        """The worker service on the scripted engine, in a process of its own."""
        values = {
            "redis_url": redis_url,
            "model": "scripted",
            "worker_id": name,
            "read_block_ms": 50,
            "heartbeat_s": 0.2,
            "metrics_port": 0,
            "model_cache_dir": str(self.folder / "cache"),
            "health_file": str(self.folder / f"{name}.health"),
            **settings,
        }
        return self.spawn(name, [PYTHON, "-c", SCRIPTED_WORKER, json.dumps(values), str(step_s)], env)

    def real_worker(self, name: str, redis_url: str, model_dir: Path, env: dict[str, str], *extra: str) -> Process:
        """`python -m worker` on the tiny model."""
        args = [
            PYTHON, "-m", "worker", "--redis-url", redis_url, "--model", str(model_dir),
            "--model-cache-dir", str(self.folder / "model-cache"), "--worker-id", name,
            "--kv-cache-tokens", "4096", "--page-size", "16", "--max-batch-tokens", "128", "--max-running", "8",
            "--read-block-ms", "50", "--heartbeat-s", "0.2", "--metrics-port", "0",
            "--health-file", str(self.folder / f"{name}.health"), *extra,
        ]  # fmt: skip
        return self.spawn(name, args, env)

    def gateway(self, name: str, redis_url: str, env: dict[str, str]) -> tuple[Process, str]:
        """`python -m gateway` on a free port, and its URL."""
        port = free_port()
        args = [
            PYTHON, "-m", "gateway", "--redis-url", redis_url, "--host", "127.0.0.1", "--port", str(port),
            "--models-refresh-s", "0", "--log-level", "info",
        ]  # fmt: skip
        return self.spawn(name, args, env), f"http://127.0.0.1:{port}"

    def stop_all(self) -> None:
        for process in self.started:
            with contextlib.suppress(Exception):
                process.signal(signal.SIGCONT)
                process.signal(signal.SIGKILL)
                process.popen.wait(10)


SCRIPTED_WORKER = """
import asyncio, json, signal, sys
from redis.asyncio import Redis
from testing.scripted_engine import ScriptedEngine
from worker.config import Settings
from worker.service import Worker

async def main():
    settings = Settings(_env_file=None, **json.loads(sys.argv[1]))
    engine = ScriptedEngine(step_s=float(sys.argv[2]), max_running=8,
                            kv_cache_tokens=4096, page_size=16, max_batch_tokens=512)
    connection = Redis.from_url(settings.redis_url.get_secret_value())
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, lambda: (hurry if stop.is_set() else stop).set())
    try:
        await Worker(settings, engine, connection).run(stop, hurry)
    finally:
        await engine.close()
        await connection.aclose()

asyncio.run(main())
"""


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    started = Processes(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


def wait_listed(url: str, *processes: Process, within_s: float = 120.0) -> str:
    """The gateway at `url` answers /health and lists a model (a worker's heartbeat is in): that model's id."""

    def listed() -> str:
        for process in processes:
            if not process.alive():
                raise AssertionError(f"{process.name} exited\n{process.tail()}")
        with contextlib.suppress(httpx.HTTPError), httpx.Client(base_url=url, timeout=5) as http:
            health = http.get("/health")
            if health.status_code == 200 and health.json().get("models"):
                return str(health.json()["models"][0])
        return ""

    return str(poll(listed, within_s, what=f"the gateway at {url} to list a model"))


def chat(url: str, content: str, max_tokens: int = 5, **extra: Any) -> httpx.Response:
    body = {"model": extra.pop("model", "default"), "messages": [{"role": "user", "content": content}]}
    headers = extra.pop("headers", {})
    with httpx.Client(base_url=url, timeout=60) as http:
        return http.post("/v1/chat/completions", json=body | {"max_tokens": max_tokens, **extra}, headers=headers)


# ------------------------------------------------------------------------------------------ the stack as processes


@dataclass
class Stack:
    """`python -m worker` (tiny model) and `python -m gateway` on a Redis of their own, both exporting to one
    collector from the OTEL_* variables alone."""

    collector: Collector
    redis_url: str
    worker: Process
    gateway: Process
    url: str
    model: str
    keys: Keys = field(default_factory=lambda: Keys("default"))

    def alive(self) -> None:
        for process in (self.worker, self.gateway):
            assert process.alive(), process.tail()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from testing.tiny_models import save_tiny_model

    folder = tmp_path_factory.mktemp("tracing-stack")
    server = RedisServer(folder / "redis").start()
    model_dir = save_tiny_model(folder / "model", "llama", max_positions=512)
    receiver = Collector()
    started = Processes(folder)
    env = traced_env(receiver, OTEL_RESOURCE_ATTRIBUTES="deployment.environment=blackbox")
    try:
        worker = started.real_worker("worker", server.url, model_dir, env)
        gateway_process, url = started.gateway("gateway", server.url, env)
        model = wait_listed(url, worker, gateway_process)
        yield Stack(receiver, server.url, worker, gateway_process, url, model)
    finally:
        started.stop_all()
        receiver.close()
        server.stop()


def traced_request(collector: Collector, request_id: str, server: bool = True) -> dict[str, Exported]:
    """A request's exported spans by name (each once), the gateway's SERVER span too, once all have arrived."""

    def arrived() -> dict[str, Exported]:
        found = collector.of(request_id)
        names = {span.name for span in found}
        if not set(WORKER_SPANS) <= names or "llmq.submit" not in names:
            return {}
        trace_id = found[0].trace_id
        servers = [span for span in collector.in_trace(trace_id) if span.kind == SERVER]
        if server and not servers:
            return {}
        by_name = {span.name: span for span in found}
        assert len(by_name) == len(found), sorted(span.name for span in found)
        return by_name | ({"server": servers[0]} if servers else {})

    return dict(poll(arrived, 60, what=f"the spans of {request_id}"))


def child_of(span: Exported, parent: Exported) -> bool:
    return span.trace_id == parent.trace_id and span.parent_id == parent.span_id


def test_a_gateway_request_is_one_trace_from_the_http_request_to_the_final_event(stack: Stack) -> None:
    secret = "the prompt must never be in a span"
    answer = chat(stack.url, secret, max_tokens=5, model=stack.model, temperature=0)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    request_id = body["id"]
    by_name = traced_request(stack.collector, request_id)
    server, submit, request = by_name["server"], by_name["llmq.submit"], by_name["llmq.request"]
    everything = stack.collector.in_trace(server.trace_id)
    assert sorted(span.name for span in everything) == sorted([CHAT, "llmq.submit", *WORKER_SPANS])
    # the links: SERVER -> PRODUCER -> CONSUMER -> the four phases, one trace id
    assert server.name == CHAT and server.kind == SERVER and server.parent_id == ""
    assert submit.kind == PRODUCER and child_of(submit, server)
    assert request.kind == CONSUMER and child_of(request, submit) and not request.links
    back_to_back(request, [by_name[name] for name in PHASES])
    # who exported what: each process under its default service name, with the resource attributes asked for
    assert {server.service, submit.service} == {"llmq-gateway"}
    assert {by_name[name].service for name in WORKER_SPANS} == {"llmq-worker"}
    assert {span.resource.get("deployment.environment") for span in everything} == {"blackbox"}
    # attributes
    for name in ["llmq.submit", *WORKER_SPANS]:
        assert by_name[name].attributes["llmq.request.id"] == request_id, name
    for span in (submit, request):
        attributes = span.attributes
        assert (attributes["llmq.queue"], attributes["llmq.lane"], attributes["llmq.partition"]) == (
            "default",
            "default",
            0,
        )
        assert attributes["messaging.system"] == "llmq" and attributes["messaging.message.id"] == request_id
        assert attributes["messaging.destination.name"] == stack.keys.lane("default")
        assert attributes["gen_ai.request.max_tokens"] == 5
        assert attributes["gen_ai.request.temperature"] == 0
    assert submit.attributes["messaging.operation.type"] == "send"
    assert submit.attributes["llmq.submit.outcome"] == "added"
    assert request.attributes["messaging.operation.type"] == "process" and request.attributes["llmq.attempt"] == 1
    usage = body["usage"]
    assert request.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert request.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    finish = request.attributes["llmq.finish_reason"]
    assert request.attributes["gen_ai.response.finish_reasons"] == (finish,)
    assert {"stop": "stop", "eos": "stop", "length": "length"}[finish] == body["choices"][0]["finish_reason"]
    assert by_name["llmq.publish"].attributes["llmq.publish.outcome"] == "written"
    server_attributes = server.attributes
    assert server_attributes["http.request.method"] == "POST" and server_attributes["http.route"] == CHAT[5:]
    assert server_attributes["url.path"] == "/v1/chat/completions" and server_attributes["url.scheme"] == "http"
    assert server_attributes["http.response.status_code"] == 200
    assert server_attributes["user_agent.original"].startswith("python-httpx")
    assert all(span.status == UNSET for span in everything)
    # time: the submit inside the HTTP request; the queue wait from the submit time (the client's, in ms)
    assert server.start <= submit.start <= submit.end <= server.end
    assert server.start - 1_000_000 <= by_name["llmq.queue_wait"].start <= submit.end
    # no prompt, no generated text in any attribute
    text = body["choices"][0]["message"]["content"] or ""
    for span in everything:
        for value in span.attributes.values():
            assert secret not in str(value), (span.name, value)
            if len(text) >= 8:
                assert text not in str(value), (span.name, value)
    stack.alive()


def test_a_streamed_request_continues_the_callers_traceparent_and_ends_with_its_last_chunk(stack: Stack) -> None:
    trace_id, parent_id = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=kept"}
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": "stream me"}],
        "max_tokens": 6,
        "stream": True,
    }
    with (
        httpx.Client(base_url=stack.url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer,
    ):
        assert answer.status_code == 200
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    request_id = json.loads(lines[0].removeprefix("data: "))["id"]
    by_name = traced_request(stack.collector, request_id)
    server = by_name["server"]
    assert server.trace_id == trace_id and server.parent_id == parent_id
    assert "vendor=kept" in server.trace_state
    assert {span.trace_id for span in by_name.values()} == {trace_id}
    assert child_of(by_name["llmq.submit"], server) and child_of(by_name["llmq.request"], by_name["llmq.submit"])
    back_to_back(by_name["llmq.request"], [by_name[name] for name in PHASES])
    assert server.end >= by_name["llmq.decode"].end  # the final chunk follows the finish
    stack.alive()


def test_an_unsampled_caller_is_followed_by_the_gateway_and_the_worker(stack: Stack) -> None:
    """parentbased_always_on: a traceparent whose sampled flag is off is not recorded anywhere."""
    unsampled = "6bf92f3577b34da6a3ce929d0e0e4738"
    answer = chat(
        stack.url,
        "not sampled",
        model=stack.model,
        headers={"traceparent": f"00-{unsampled}-20f067aa0ba902b9-00"},
    )
    assert answer.status_code == 200, answer.text
    quiet_id = answer.json()["id"]
    # a sampled request after it: once its spans are all in, the first one's would be too
    after = chat(stack.url, "sampled", model=stack.model)
    assert after.status_code == 200
    traced_request(stack.collector, after.json()["id"])
    assert stack.collector.in_trace(unsampled) == []
    assert stack.collector.of(quiet_id) == []
    stack.alive()


# ------------------------------------------------------------------------------------------ off unless configured


class Monitor:
    """Redis MONITOR on a raw socket, in a thread: every command any client or script runs, as Redis prints it
    (the fields of each XADD included)."""

    def __init__(self, redis_url: str) -> None:
        import socket

        port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"MONITOR\r\n")
        self.seen = bytearray()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        poll(lambda: b"+OK" in self.seen, 10, what="MONITOR to start")

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while chunk := self.sock.recv(65536):
                self.seen.extend(chunk)

    def text(self) -> str:
        return bytes(self.seen).decode(errors="replace")

    def close(self) -> None:
        import socket

        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)


CALLER_TRACE = "7bf92f3577b34da6a3ce929d0e0e4739"
CALLER = {"traceparent": f"00-{CALLER_TRACE}-30f067aa0ba902ba-01"}


@pytest.mark.parametrize(
    ("variables", "traced"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "{collector}"}, False),
        (
            {
                "OTEL_SDK_DISABLED": "true",
                "OTEL_TRACES_EXPORTER": "otlp,console",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "{collector}",
            },
            False,
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "{collector}"}, True),
    ],
    ids=["no-variables", "exporter-none", "sdk-disabled", "endpoint-alone"],
)
def test_tracing_is_off_unless_the_otel_variables_turn_it_on(
    variables: dict[str, str], traced: bool, redis_url: str, collector: Collector, processes: Processes
) -> None:
    """A caller that sends a traceparent, a gateway and a worker as processes: off, no entry carries a trace field
    and nothing reaches the collector, even after both exit (their last batches flushed); on, both."""
    env = clean_env(**{k: v.format(collector=collector.endpoint) for k, v in variables.items()})
    worker = processes.scripted_worker("worker", redis_url, env)
    gateway_process, url = processes.gateway("gateway", redis_url, env)
    model = wait_listed(url, worker, gateway_process)
    monitor = Monitor(redis_url)
    try:
        answer = chat(url, "hello", model=model, headers=CALLER)
    finally:
        monitor.close()
    assert answer.status_code == 200, answer.text
    request_id = answer.json()["id"]
    assert request_id in monitor.text()  # MONITOR saw the submit
    full = sorted([CHAT, "llmq.submit", *WORKER_SPANS])
    if traced:  # the gateway's exit loses its last batch (see below): wait for it first
        poll(lambda: sorted(span.name for span in collector.in_trace(CALLER_TRACE)) == full, what="the trace")
    assert worker.stop() == 0
    gateway_process.stop()  # its exit status: see the flush test below
    outputs = worker.out() + worker.err() + gateway_process.out() + gateway_process.err()
    if traced:
        assert "traceparent" in monitor.text() and CALLER_TRACE in monitor.text()
        assert sorted(span.name for span in collector.in_trace(CALLER_TRACE)) == full
        assert set(collector.posts) == {"/v1/traces"}
        assert "tracing on" in worker.out() + worker.err()
        assert "tracing_on" in gateway_process.out() + gateway_process.err()
    else:
        assert "traceparent" not in monitor.text() and CALLER_TRACE not in monitor.text()
        assert collector.all() == [] and collector.posts == []
        assert "tracing on" not in outputs and "tracing_on" not in outputs
        assert '"trace_id"' not in outputs


def test_a_traces_endpoint_or_the_console_exporter_is_where_spans_go(
    redis_url: str, collector: Collector, processes: Processes
) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is the full URL (nothing appended); OTEL_TRACES_EXPORTER=console prints
    each span as JSON on the process's stdout."""
    worker_env = clean_env(OTEL_TRACES_EXPORTER="console")
    gateway_env = clean_env(
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{collector.endpoint}/custom/traces", OTEL_BSP_SCHEDULE_DELAY="50"
    )
    worker = processes.scripted_worker("worker", redis_url, worker_env)
    gateway_process, url = processes.gateway("gateway", redis_url, gateway_env)
    model = wait_listed(url, worker, gateway_process)
    answer = chat(url, "hello", model=model)
    assert answer.status_code == 200, answer.text
    request_id = answer.json()["id"]
    [submit] = poll(lambda: collector.named(request_id, "llmq.submit"), what="the gateway's submit span")
    poll(lambda: [s for s in collector.in_trace(submit.trace_id) if s.name == CHAT], what="the gateway's span")
    assert worker.stop() == 0
    gateway_process.stop()
    assert set(collector.posts) == {"/custom/traces"}
    traced = sorted(span.name for span in collector.in_trace(submit.trace_id))
    assert traced == sorted([CHAT, "llmq.submit"])  # the worker's went to its console
    decoder, text, printed = json.JSONDecoder(), worker.out(), []
    index = text.find("{")
    while index != -1:
        try:
            value, end = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            index = text.find("{", index + 1)
            continue
        if isinstance(value, dict) and "context" in value and "name" in value:
            printed.append(value)
        index = text.find("{", end)
    mine = [span for span in printed if span.get("attributes", {}).get("llmq.request.id") == request_id]
    assert sorted(span["name"] for span in mine) == sorted(WORKER_SPANS)
    assert {span["context"]["trace_id"] for span in mine} == {"0x" + submit.trace_id}
    [request] = [span for span in mine if span["name"] == "llmq.request"]
    assert request["parent_id"] == "0x" + submit.span_id


@pytest.mark.parametrize(
    ("propagators", "baggage"),
    [
        pytest.param(None, True, id="default"),
        pytest.param("tracecontext", False, id="tracecontext-only"),
    ],
)
def test_otel_propagators_decide_what_the_entry_carries_and_service_name_names_the_gateway(
    propagators: str | None, baggage: bool, redis_url: str, collector: Collector, processes: Processes
) -> None:
    """The default `tracecontext,baggage` puts the caller's baggage in the entry's `t` beside its traceparent."""
    extra = {"OTEL_SERVICE_NAME": "edge"} | ({"OTEL_PROPAGATORS": propagators} if propagators else {})
    worker = processes.scripted_worker("worker", redis_url, traced_env(collector))
    gateway_process, url = processes.gateway("gateway", redis_url, traced_env(collector, **extra))
    model = wait_listed(url, worker, gateway_process)
    monitor = Monitor(redis_url)
    try:
        answer = chat(url, "hello", model=model, headers=CALLER | {"baggage": "tenant=alice-in-chains"})
    finally:
        monitor.close()
    assert answer.status_code == 200, answer.text
    seen = monitor.text()
    assert "traceparent" in seen and CALLER_TRACE in seen
    assert ("alice-in-chains" in seen) is baggage
    by_name = traced_request(collector, answer.json()["id"])
    assert {by_name["server"].service, by_name["llmq.submit"].service} == {"edge"}
    assert by_name["llmq.request"].service == "llmq-worker" and by_name["server"].trace_id == CALLER_TRACE


def test_a_worker_sampler_decides_only_for_entries_that_come_without_a_context(
    redis_url: str, spans: InMemorySpanExporter, collector: Collector, processes: Processes
) -> None:
    """parentbased_traceidratio at 0 on the worker: a sampled submit is still traced there; a context-less entry
    (an older or untraced client) is not."""
    env = traced_env(collector, OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="0")
    worker = processes.scripted_worker("worker", redis_url, env)
    with redis.Redis.from_url(redis_url) as raw:
        raw.xadd(KEYS.requests, {"m": entry("no-context", [5, 1])})
    with Client(redis_url) as llmq:
        Job.attach(llmq, "no-context").result(timeout=60)
        with trace.get_tracer("caller").start_as_current_span("caller"):
            job = llmq.submit(input_ids=[5, 2], max_new_tokens=3)
        job.result(timeout=60)
    [submit] = finished(spans, job.id, "llmq.submit")
    poll(lambda: len(collector.of(job.id)) == len(WORKER_SPANS), what="the traced request's worker spans")
    assert {span.trace_id for span in collector.of(job.id)} == {hex_ids(submit)[0]}
    assert collector.of("no-context") == []
    assert worker.alive()


def test_a_workers_spans_still_batched_are_flushed_when_it_exits_after_its_drain(
    redis_url: str, model_dir: Path, collector: Collector, processes: Processes
) -> None:
    """`python -m worker` with a schedule delay of ten minutes: nothing leaves before the SIGTERM, all after."""
    worker = processes.real_worker(
        "worker", redis_url, model_dir, traced_env(collector, OTEL_BSP_SCHEDULE_DELAY="600000")
    )
    with Client(redis_url) as llmq:
        job = llmq.submit(input_ids=[5, 6, 7], max_new_tokens=3, temperature=0)
        result = job.result(timeout=120)
    assert result.finish_reason in ("length", "eos", "stop")
    assert collector.all() == []  # still batched
    assert worker.stop() == 0
    by_name = {span.name: span for span in collector.of(job.id)}
    assert sorted(by_name) == sorted(WORKER_SPANS)
    back_to_back(by_name["llmq.request"], [by_name[name] for name in PHASES])


def test_a_gateways_spans_still_batched_are_flushed_when_it_exits(
    redis_url: str, collector: Collector, processes: Processes
) -> None:
    gateway_process, url = processes.gateway(
        "gateway", redis_url, traced_env(collector, OTEL_BSP_SCHEDULE_DELAY="600000")
    )
    answer = poll(lambda: _get(url, "/nope"), 60, what="the gateway to answer")
    assert answer.status_code == 404
    assert collector.all() == []  # still batched
    assert gateway_process.stop() == 0  # docs: a clean stop on SIGTERM exits 0
    assert not gateway_process.alive()
    assert [span.attributes.get("url.path") for span in collector.all() if span.kind == SERVER] == ["/nope"]


def _get(url: str, path: str) -> httpx.Response | None:
    try:
        with httpx.Client(base_url=url, timeout=5) as http:
            return http.get(path)
    except httpx.HTTPError:
        return None


# ------------------------------------------------------------------------------------------ in process: spans that end

from client.errors import Cancelled, RequestFailed  # noqa: E402


class OpenSpans(SpanProcessor):
    """Spans started and not (yet) ended, on the shared in-memory provider."""

    def __init__(self) -> None:
        self.open: dict[tuple[int, int], Span] = {}
        self.lock = threading.Lock()

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        with self.lock:
            self.open[(span.context.trace_id, span.context.span_id)] = span

    def on_end(self, span: ReadableSpan) -> None:
        with self.lock:
            self.open.pop((span.context.trace_id, span.context.span_id), None)

    def of(self, request_id: str | None = None, trace_id: int | None = None) -> list[str]:
        with self.lock:
            found = list(self.open.values())
        return sorted(
            span.name
            for span in found
            if (request_id is None or (span.attributes or {}).get("llmq.request.id") == request_id)
            and (trace_id is None or span.context.trace_id == trace_id)
        )


_OPEN: list[OpenSpans] = []


@pytest.fixture
def open_spans(spans: InMemorySpanExporter) -> OpenSpans:
    """Tracks the spans left open, on the provider `spans` installed (the processor is added once)."""
    if not _OPEN:
        provider, _ = client_tracing._STORE[0]
        tracker = OpenSpans()
        provider.add_span_processor(tracker)
        _OPEN.append(tracker)
    _OPEN[0].open.clear()
    return _OPEN[0]


def finished(exporter: InMemorySpanExporter, request_id: str, name: str | None = None) -> list[ReadableSpan]:
    return [
        span
        for span in exporter.get_finished_spans()
        if (span.attributes or {}).get("llmq.request.id") == request_id and (name is None or span.name == name)
    ]


def by_name_of(exporter: InMemorySpanExporter, request_id: str) -> dict[str, ReadableSpan]:
    found = finished(exporter, request_id)
    named = {span.name: span for span in found}
    assert len(named) == len(found), sorted(span.name for span in found)
    return named


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def entry(request_id: str, input_ids: list[int], max_new_tokens: int = 3, submitted: int | None = None) -> bytes:
    """A request's `m` as the protocol page describes it: a msgpack map starting with `v`."""
    return msgpack.packb(
        {
            "v": 1,
            "id": request_id,
            "input_ids": input_ids,
            "submitted": time.time_ns() // 1_000_000 if submitted is None else submitted,
            "params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        }
    )


FOREIGN_TRACE, FOREIGN_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
VALID = f"00-{FOREIGN_TRACE}-{FOREIGN_SPAN}-01"
HOSTILE: dict[str, bytes] = {
    "empty": b"",
    "not-msgpack": b"\xc1",
    "every-byte": bytes(range(256)),
    "an-int": msgpack.packb(5),
    "a-list": msgpack.packb([VALID]),
    "a-string": msgpack.packb(VALID),
    "nil": msgpack.packb(None),
    "wrong-value-types": msgpack.packb({"traceparent": 5, "tracestate": ["x"], "baggage": {"a": 1}}),
    "garbage-traceparent": msgpack.packb({"traceparent": "garbage"}),
    "zero-ids": msgpack.packb({"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"}),
    "version-ff": msgpack.packb({"traceparent": f"ff-{FOREIGN_TRACE}-{FOREIGN_SPAN}-01"}),
    "nul-in-traceparent": msgpack.packb({"traceparent": VALID + "\x00"}),
    "invalid-utf8": b"\x81\xabtraceparent\xa2\xff\xfe",
    "truncated": msgpack.packb({"traceparent": VALID})[:-7],
    "extra-bytes": msgpack.packb({"traceparent": VALID}) + b"\xc1\xc1",
    "deeply-nested": b"\x91" * 100_000 + b"\xc0",
    "ext-type": msgpack.packb(msgpack.ExtType(42, b"x" * 10)),
    "timestamp-value": msgpack.packb({"traceparent": msgpack.Timestamp(1, 2)}),
    "map-keyed-by-ints": msgpack.packb({1: VALID, 2: {3: 4}}),
    "huge-garbage": b"\xff" * 2_000_000,
    "huge-map": msgpack.packb({f"k{i}": "v" * 10 for i in range(100_000)}),
}
# readable enough that a worker might continue them; only "answered, nothing broken" is promised
DOUBTFUL: dict[str, bytes] = {
    "binary-keys": msgpack.packb({b"traceparent": VALID.encode()}, use_bin_type=True),
    "huge-tracestate": msgpack.packb({"traceparent": VALID, "tracestate": "a=" + "b" * 1_000_000}),
    "huge-valid-carrier": msgpack.packb({"traceparent": VALID, **{f"x-{i}": "y" * 50 for i in range(20_000)}}),
}


async def test_hostile_trace_fields_never_break_the_worker_or_other_requests(
    start_worker: Any,
    client: AsyncClient,
    redis_url: str,
    spans: InMemorySpanExporter,
    open_spans: OpenSpans,
) -> None:
    running = await start_worker()
    hostile = {**HOSTILE, **DOUBTFUL}
    prompts = {name: [3 + index % 50, 7, 11] for index, name in enumerate(hostile)}
    traced: list[AsyncJob] = []
    async with Redis.from_url(redis_url) as raw:
        for index, (name, value) in enumerate(hostile.items()):
            await raw.xadd(KEYS.requests, {"m": entry(name, prompts[name]), "t": value})
            if index % 4 == 0:  # traced requests in between, from a client in a span
                with trace.get_tracer("caller").start_as_current_span("caller"):
                    traced.append(await client.submit(input_ids=[9, 9, index + 1], max_new_tokens=4))
        # the field twice in one entry, once before `m` and once after it
        await raw.execute_command(
            "XADD", KEYS.requests, "*", "t", b"\xc1", "m", entry("twice", [5, 5]), "t", msgpack.packb({"x": 1})
        )
    for name in [*hostile, "twice"]:
        result = await AsyncJob.attach(client, name).result(timeout=60)
        assert result.token_ids == expected_tokens(prompts.get(name, [5, 5]), 3), name
    for index, job in enumerate(traced):
        result = await job.result(timeout=60)
        assert result.token_ids == expected_tokens([9, 9, index * 4 + 1], 4)
    await wait_until(lambda: all(finished(spans, name, "llmq.request") for name in [*hostile, "twice"]), 30)
    for name in [*HOSTILE, "twice"]:  # unreadable: the request runs as a trace of its own
        by_name = by_name_of(spans, name)
        assert sorted(by_name) == sorted(WORKER_SPANS), name
        request = by_name["llmq.request"]
        assert request.parent is None and request.kind is SpanKind.CONSUMER, name
        assert hex_ids(request)[0] != FOREIGN_TRACE, name
        assert request.status.status_code is StatusCode.UNSET, name
        back_to_back(request, [by_name[phase] for phase in PHASES])
    for name in DOUBTFUL:
        assert sorted(by_name_of(spans, name)) == sorted(WORKER_SPANS), name
    for job in traced:  # the traced requests in between are whole, each under its own submit
        await wait_until(lambda job=job: finished(spans, job.id, "llmq.request"))
        by_name = by_name_of(spans, job.id)
        request, submit = by_name["llmq.request"], by_name["llmq.submit"]
        assert request.parent is not None and request.parent.span_id == submit.get_span_context().span_id
        assert hex_ids(request)[0] == hex_ids(submit)[0]
    assert not running.task.done()
    after = await client.submit(input_ids=[1, 2, 3], max_new_tokens=2)
    assert (await after.result(timeout=30)).token_ids == expected_tokens([1, 2, 3], 2)
    for name in [*hostile, "twice"]:
        assert open_spans.of(name) == [], name


async def test_a_trace_context_written_by_hand_is_continued_and_its_sampled_flag_followed(
    start_worker: Any, client: AsyncClient, redis_url: str, spans: InMemorySpanExporter
) -> None:
    """What any other producer following the protocol page writes: `t` = a msgpack map of W3C strings."""
    await start_worker()
    unsampled_trace = "1af7651916cd43dd8448eb211c80319d"
    async with Redis.from_url(redis_url) as raw:
        carrier = {"traceparent": VALID, "tracestate": "vendor=value"}
        await raw.xadd(KEYS.requests, {"m": entry("foreign", [4, 4]), "t": msgpack.packb(carrier)})
        quiet = {"traceparent": f"00-{unsampled_trace}-{FOREIGN_SPAN}-00"}
        await raw.xadd(KEYS.requests, {"m": entry("unsampled", [4, 5]), "t": msgpack.packb(quiet)})
        await raw.xadd(KEYS.requests, {"m": entry("barrier", [4, 6])})
    for name in ("foreign", "unsampled", "barrier"):
        await AsyncJob.attach(client, name).result(timeout=30)
    await wait_until(lambda: finished(spans, "foreign", "llmq.request") and finished(spans, "barrier", "llmq.request"))
    by_name = by_name_of(spans, "foreign")
    request = by_name["llmq.request"]
    assert hex_ids(request)[0] == FOREIGN_TRACE
    assert request.parent is not None and f"{request.parent.span_id:016x}" == FOREIGN_SPAN and request.parent.is_remote
    assert request.get_span_context().trace_state.get("vendor") == "value"
    back_to_back(request, [by_name[phase] for phase in PHASES])
    assert finished(spans, "unsampled") == []  # parentbased: the caller's "not sampled" holds on the worker
    assert [s for s in spans.get_finished_spans() if hex_ids(s)[0] == unsampled_trace] == []


async def test_the_queue_wait_starts_at_the_submit_time_and_never_in_the_future(
    start_worker: Any, client: AsyncClient, redis_url: str, spans: InMemorySpanExporter
) -> None:
    """A submitter's clock ten minutes behind: the wait starts at its `submitted`; one a minute ahead: an empty
    wait at the worker's admission, not a span that starts after it ends."""
    await start_worker()
    now_ms = time.time_ns() // 1_000_000
    behind, ahead = now_ms - 600_000, now_ms + 60_000
    async with Redis.from_url(redis_url) as raw:
        await raw.xadd(KEYS.requests, {"m": entry("behind", [4, 7], submitted=behind)})
        await raw.xadd(KEYS.requests, {"m": entry("ahead", [4, 8], submitted=ahead)})
    for name in ("behind", "ahead"):
        await AsyncJob.attach(client, name).result(timeout=30)
    answered = time.time_ns()
    await wait_until(lambda: finished(spans, "behind", "llmq.request") and finished(spans, "ahead", "llmq.request"))
    late = by_name_of(spans, "behind")
    assert late["llmq.request"].start_time == late["llmq.queue_wait"].start_time == behind * 1_000_000
    back_to_back(late["llmq.request"], [late[phase] for phase in PHASES])
    early = by_name_of(spans, "ahead")
    wait = early["llmq.queue_wait"]
    assert wait.start_time == wait.end_time == early["llmq.prefill"].start_time  # empty
    assert early["llmq.request"].start_time < ahead * 1_000_000 and wait.start_time <= answered  # type: ignore[operator]
    back_to_back(early["llmq.request"], [early[phase] for phase in PHASES])


@pytest.mark.parametrize("lane", ["interactive", "default", "batch"])
async def test_the_lane_and_the_sampling_parameters_given_are_on_the_submit_and_the_request(
    lane: str, start_worker: Any, client: AsyncClient, spans: InMemorySpanExporter
) -> None:
    await start_worker()
    job = await client.submit(
        input_ids=[2, 3, 4, 5], max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=5, seed=11, priority=lane
    )
    result = await job.result(timeout=30)
    await wait_until(lambda: finished(spans, job.id, "llmq.request"))
    by_name = by_name_of(spans, job.id)
    for name in ("llmq.submit", "llmq.request"):
        attributes = dict(by_name[name].attributes or {})
        assert attributes["llmq.lane"] == lane, name
        assert attributes["messaging.destination.name"] == KEYS.lane(lane), name  # type: ignore[arg-type]
        given = [attributes[f"gen_ai.request.{k}"] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed")]
        assert given == [6, 0.7, 0.9, 5, 11], name
    request = dict(by_name["llmq.request"].attributes or {})
    assert request["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens == 4
    assert request["gen_ai.usage.output_tokens"] == result.usage.completion_tokens == len(result.token_ids)
    assert request["llmq.finish_reason"] == result.finish_reason


async def test_an_applications_baggage_rides_in_the_entry_beside_its_traceparent(
    client: AsyncClient, redis_url: str, spans: InMemorySpanExporter
) -> None:
    """The client in an application's span and baggage: the default propagators write both into `t`."""
    from opentelemetry import baggage, context

    token = context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with trace.get_tracer("caller").start_as_current_span("caller"):
            job = await client.submit(input_ids=[1, 2], max_new_tokens=2)  # no worker: the entry stays
    finally:
        context.detach(token)
    async with Redis.from_url(redis_url) as raw:
        [(_, fields)] = await raw.xrange(KEYS.requests)
    carrier = msgpack.unpackb(fields[b"t"])
    [submit] = finished(spans, job.id, "llmq.submit")
    trace_id, span_id = hex_ids(submit)
    version, carried_trace, carried_span, flags = carrier["traceparent"].split("-")
    assert (version, carried_trace, carried_span) == ("00", trace_id, span_id) and int(flags, 16) & 1  # sampled
    assert carrier["baggage"] == "tenant=acme"
    assert len(fields[b"t"]) <= 4096


async def test_a_cancelled_request_ends_its_spans_with_finish_reason_cancelled(
    start_worker: Any, client: AsyncClient, spans: InMemorySpanExporter, open_spans: OpenSpans
) -> None:
    await start_worker(step_s=0.02)
    with trace.get_tracer("caller").start_as_current_span("caller"):
        job = await client.submit(input_ids=[8, 9], max_new_tokens=300, ignore_eos=True, temperature=0)
    seen = 0
    async for delta in job.stream(timeout=30):
        seen += len(delta.token_ids)
        if seen >= 2:
            await job.cancel()
    with pytest.raises(Cancelled) as stopped:
        await job.result(timeout=30)
    result = stopped.value.result
    assert result.finish_reason == "cancelled" and len(result.token_ids) < 300
    await wait_until(lambda: finished(spans, job.id, "llmq.request"))
    by_name = by_name_of(spans, job.id)
    assert sorted(by_name) == sorted(["llmq.submit", *WORKER_SPANS])
    request = by_name["llmq.request"]
    attributes = dict(request.attributes or {})
    assert attributes["llmq.finish_reason"] == "cancelled"
    assert attributes["gen_ai.response.finish_reasons"] == ("cancelled",)
    assert attributes["gen_ai.usage.output_tokens"] == len(result.token_ids)
    assert attributes["gen_ai.usage.input_tokens"] == 2
    back_to_back(request, [by_name[phase] for phase in PHASES])
    assert (by_name["llmq.publish"].attributes or {})["llmq.publish.outcome"] == "written"
    assert open_spans.of(job.id) == []


async def test_requests_answered_without_running_have_no_worker_span_and_leave_none_open(
    start_worker: Any, client: AsyncClient, spans: InMemorySpanExporter, open_spans: OpenSpans
) -> None:
    """Cancelled before it started, expired: answered, a submit span each, no worker span (docs: Not traced)."""
    cancelled = await client.submit(input_ids=[1, 2], max_new_tokens=5)
    await cancelled.cancel()
    expired = await client.submit(input_ids=[1, 3], max_new_tokens=5, deadline=0.01)
    await asyncio.sleep(0.05)  # past its deadline before any worker reads it
    await start_worker()
    with pytest.raises(Cancelled):
        await cancelled.result(timeout=30)
    with pytest.raises(RequestFailed) as failure:
        await expired.result(timeout=30)
    assert failure.value.code == "expired"
    barrier = await client.submit(input_ids=[1, 4], max_new_tokens=2)
    await barrier.result(timeout=30)
    await wait_until(lambda: finished(spans, barrier.id, "llmq.request"))
    for job in (cancelled, expired):
        assert [span.name for span in finished(spans, job.id)] == ["llmq.submit"], job.id
        assert open_spans.of(job.id) == [], job.id


async def test_a_request_the_engine_refuses_ends_every_span_it_started(
    start_worker: Any, client: AsyncClient, spans: InMemorySpanExporter, open_spans: OpenSpans
) -> None:
    """Token ids outside the scripted engine's vocabulary: an `error` event; any worker span ends, as an error."""
    await start_worker()
    job = await client.submit(input_ids=[1, 999], max_new_tokens=3)
    with pytest.raises(RequestFailed) as failure:
        await job.result(timeout=30)
    barrier = await client.submit(input_ids=[1, 5], max_new_tokens=2)
    await barrier.result(timeout=30)
    await wait_until(lambda: finished(spans, barrier.id, "llmq.request"))
    await wait_until(lambda: open_spans.of(job.id) == [])
    by_name = by_name_of(spans, job.id)
    request = by_name["llmq.request"]  # the engine refused it at admission: an attempt that ended with an error
    assert request.status.status_code is StatusCode.ERROR
    assert (request.attributes or {})["llmq.error.code"] == failure.value.code
    assert "llmq.finish_reason" not in (request.attributes or {})
    back_to_back(request, [by_name[phase] for phase in PHASES if phase in by_name])
    assert by_name["llmq.submit"].status.status_code is StatusCode.UNSET  # the submit itself went well


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_submit_to_a_redis_that_is_down_ends_its_span_and_gives_the_callers_context_back(
    kind: str, redis_url: str, spans: InMemorySpanExporter, open_spans: OpenSpans
) -> None:
    down = "redis://127.0.0.1:1/0"
    tracer = trace.get_tracer("caller")

    async def submit(url: str, request_id: str) -> None:
        if kind == "async":
            async with AsyncClient(url, failover_timeout=0) as llmq:
                await llmq.submit("hi", request_id=request_id)
        else:

            def sync() -> None:
                with trace.use_span(caller, end_on_exit=False), Client(url, failover_timeout=0) as llmq:
                    llmq.submit("hi", request_id=request_id)

            await asyncio.to_thread(sync)

    with tracer.start_as_current_span("caller") as caller:
        with pytest.raises(RedisUnavailable):
            await submit(down, "nowhere")
        assert trace.get_current_span() is caller  # the failed submit's span is not left current
        await submit(redis_url, "somewhere")
    failed = by_name_of(spans, "nowhere")["llmq.submit"]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.parent is not None and failed.parent.span_id == caller.get_span_context().span_id
    assert failed.end_time is not None and failed.end_time >= failed.start_time  # type: ignore[operator]
    good = by_name_of(spans, "somewhere")["llmq.submit"]
    assert good.parent is not None and good.parent.span_id == caller.get_span_context().span_id
    assert good.status.status_code is StatusCode.UNSET
    assert open_spans.of(trace_id=caller.get_span_context().trace_id) == []


async def test_a_gateway_request_whose_client_goes_away_ends_all_its_spans(
    gateway: Any, start_worker: Any, spans: InMemorySpanExporter, open_spans: OpenSpans
) -> None:
    await start_worker(step_s=0.02)
    served = await gateway()
    model = await served.model()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}
    async with served.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break  # gone after the first chunk
    await wait_until(lambda: finished(spans, request_id, "llmq.request"), 30)
    by_name = by_name_of(spans, request_id)
    request = by_name["llmq.request"]
    assert (request.attributes or {})["llmq.finish_reason"] == "cancelled"
    trace_id = request.get_span_context().trace_id

    def servers() -> list[ReadableSpan]:
        return [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER and s.context.trace_id == trace_id]

    await wait_until(servers)  # the HTTP request's span ends too
    [server] = servers()
    assert server.name == CHAT
    submit = by_name["llmq.submit"]
    assert submit.parent is not None and submit.parent.span_id == server.get_span_context().span_id
    assert request.parent is not None and request.parent.span_id == submit.get_span_context().span_id
    back_to_back(request, [by_name[phase] for phase in PHASES])
    assert open_spans.of(trace_id=trace_id) == []


async def test_a_gateway_whose_redis_is_down_ends_its_request_span_as_an_error(
    gateway: Any, spans: InMemorySpanExporter, open_spans: OpenSpans
) -> None:
    served = await gateway(redis_url="redis://127.0.0.1:1/0", redis_failover_timeout_s=0.2)
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with served.http() as http:
        answer = await http.post("/v1/chat/completions", json=body)
    assert answer.status_code >= 500
    [server] = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert server.name == CHAT and server.status.status_code is StatusCode.ERROR
    assert (server.attributes or {})["http.response.status_code"] == answer.status_code
    trace_id = server.get_span_context().trace_id
    for span in spans.get_finished_spans():
        if span.context.trace_id == trace_id and span.name == "llmq.submit":
            assert span.status.status_code is StatusCode.ERROR
    assert open_spans.of(trace_id=trace_id) == []


# ------------------------------------------------------------------------------------------ resumed attempts


def lease_settings() -> dict[str, Any]:
    return {"lease_renew_s": 0.2, "lease_timeout_s": 1.0, "claim_interval_s": 0.1}


async def first_tokens(job: AsyncJob) -> int:
    async for delta in job.stream(timeout=60):
        if delta.token_ids:
            return len(delta.token_ids)
    raise AssertionError("the stream ended before its first token")


def assert_resumed_attempt(
    exporter: InMemorySpanExporter, request_id: str, submit: ReadableSpan, prompt: int, total: int
) -> ReadableSpan:
    """The second attempt (in memory): under the submit, linked to it with its attempt number, no queue wait."""
    [second] = finished(exporter, request_id, "llmq.request")
    submit_trace, submit_span = hex_ids(submit)
    assert hex_ids(second)[0] == submit_trace
    assert second.parent is not None and f"{second.parent.span_id:016x}" == submit_span
    attributes = dict(second.attributes or {})
    assert attributes["llmq.attempt"] == 2 and attributes["llmq.request.id"] == request_id
    resumed = attributes["llmq.resumed_tokens"]
    assert 1 <= resumed < total
    # the attempt's input: the prompt plus the tokens already published, which its prefill covers (the request's
    # usage counts the prompt alone)
    assert attributes["gen_ai.usage.input_tokens"] == prompt + resumed
    assert attributes["gen_ai.usage.output_tokens"] == total
    assert attributes["llmq.finish_reason"] == "length" and second.status.status_code is StatusCode.UNSET
    [link] = second.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == (submit_trace, submit_span)
    assert dict(link.attributes or {}) == {"llmq.attempt": 2}
    phases = {span.name: span for span in finished(exporter, request_id) if span.parent == second.get_span_context()}
    assert sorted(phases) == sorted(PHASES[1:])  # a resumed attempt has no queue wait
    back_to_back(second, [phases[name] for name in PHASES[1:]])
    assert finished(exporter, request_id, "llmq.queue_wait") == []
    return second


async def test_a_worker_paused_past_its_lease_and_the_one_that_claims_it_make_one_trace(
    start_worker: Any,
    client: AsyncClient,
    redis_url: str,
    spans: InMemorySpanExporter,
    collector: Collector,
    processes: Processes,
) -> None:
    """The first attempt in a worker process (spans over OTLP) that is stopped (SIGSTOP) past its lease; the
    second in this one (spans in memory). Woken, the first finds itself fenced and ends `llmq.stopped=fenced`."""
    first = processes.scripted_worker("first", redis_url, traced_env(collector), step_s=0.05, **lease_settings())
    with trace.get_tracer("caller").start_as_current_span("caller"):
        job = await client.submit(input_ids=[5, 6, 7], max_new_tokens=40, temperature=0, ignore_eos=True)
    [submit] = finished(spans, job.id, "llmq.submit")
    await first_tokens(job)
    first.signal(signal.SIGSTOP)
    await start_worker(**lease_settings())
    result = await job.result(timeout=60)
    assert result.token_ids == expected_tokens([5, 6, 7], 40)
    await wait_until(lambda: finished(spans, job.id, "llmq.request"), 30)
    second = assert_resumed_attempt(spans, job.id, submit, prompt=3, total=40)
    first.signal(signal.SIGCONT)
    await wait_until(lambda: collector.named(job.id, "llmq.request"), 30)
    [attempt] = collector.named(job.id, "llmq.request")
    submit_trace, submit_span = hex_ids(submit)
    assert (attempt.trace_id, attempt.parent_id) == (submit_trace, submit_span)
    assert attempt.attributes["llmq.attempt"] == 1 and attempt.attributes["llmq.stopped"] == "fenced"
    assert attempt.kind == CONSUMER and not attempt.links and attempt.service == "llmq-worker"
    assert attempt.span_id != hex_ids(second)[1]
    phases = {span.name: span for span in collector.of(job.id) if span.parent_id == attempt.span_id}
    assert {"llmq.queue_wait", "llmq.prefill"} <= set(phases) and "llmq.publish" not in phases
    assert attempt.start == phases["llmq.queue_wait"].start
    assert phases["llmq.queue_wait"].end == phases["llmq.prefill"].start
    assert attempt.end >= max(span.end for span in phases.values())
    assert first.stop() == 0


async def test_a_request_whose_worker_was_killed_is_resumed_in_the_same_trace(
    start_worker: Any,
    client: AsyncClient,
    redis_url: str,
    spans: InMemorySpanExporter,
    collector: Collector,
    processes: Processes,
) -> None:
    """SIGKILL after the first token: the first attempt's CONSUMER span never ends (so never leaves), its ended
    phases have; the claiming worker's attempt 2 continues the submitted trace."""
    first = processes.scripted_worker("first", redis_url, traced_env(collector), step_s=0.05, **lease_settings())
    with trace.get_tracer("caller").start_as_current_span("caller"):
        job = await client.submit(input_ids=[6, 7], max_new_tokens=40, temperature=0, ignore_eos=True)
    [submit] = finished(spans, job.id, "llmq.submit")
    await first_tokens(job)
    await wait_until(lambda: collector.named(job.id, "llmq.prefill"), 30)
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    await start_worker(**lease_settings())
    result = await job.result(timeout=60)
    assert result.token_ids == expected_tokens([6, 7], 40)
    await wait_until(lambda: finished(spans, job.id, "llmq.request"), 30)
    second = assert_resumed_attempt(spans, job.id, submit, prompt=2, total=40)
    submit_trace, submit_span = hex_ids(submit)
    exported = {span.name: span for span in collector.of(job.id)}
    assert "llmq.request" not in exported and {"llmq.queue_wait", "llmq.prefill"} <= set(exported)
    wait, prefill = exported["llmq.queue_wait"], exported["llmq.prefill"]
    assert wait.trace_id == prefill.trace_id == submit_trace
    assert wait.parent_id == prefill.parent_id not in {"", submit_span, hex_ids(second)[1]}  # the lost attempt's
    assert wait.end == prefill.start


async def test_on_the_real_engine_a_resumed_attempts_input_tokens_include_the_tokens_already_published(
    start_worker: Any,
    client: AsyncClient,
    redis_url: str,
    model_dir: Path,
    spans: InMemorySpanExporter,
    collector: Collector,
    processes: Processes,
) -> None:
    """`python -m worker` (tiny model) killed after its first tokens, an in-process worker on the same model claims
    it: "its prefill covers the prompt plus the tokens already published" and input_tokens says so."""
    flags = ["--lease-renew-s", "0.2", "--lease-timeout-s", "1", "--claim-interval-s", "0.1"]
    first = processes.real_worker("first", redis_url, model_dir, traced_env(collector), *flags)
    with trace.get_tracer("caller").start_as_current_span("caller"):
        job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=400, temperature=0, ignore_eos=True)
    [submit] = finished(spans, job.id, "llmq.submit")
    await first_tokens(job)
    first.signal(signal.SIGKILL)
    first.popen.wait(10)
    await start_worker(real_model=True, **lease_settings())
    result = await job.result(timeout=120)
    assert len(result.token_ids) == 400 and result.finish_reason == "length"
    await wait_until(lambda: finished(spans, job.id, "llmq.request"), 30)
    [second] = finished(spans, job.id, "llmq.request")
    attributes = dict(second.attributes or {})
    assert attributes["llmq.attempt"] == 2 and 1 <= attributes["llmq.resumed_tokens"] < 400
    assert second.parent is not None and second.parent.span_id == submit.get_span_context().span_id
    assert attributes["gen_ai.usage.output_tokens"] == 400 and result.usage.prompt_tokens == 3
    assert attributes["gen_ai.usage.input_tokens"] == 3 + attributes["llmq.resumed_tokens"]


# ------------------------------------------------------------------------------------------ without OpenTelemetry

NO_OTEL_CLIENT = """
import asyncio, json, sys
from client import AsyncClient, Client

URL = sys.argv[1]


async def main():
    async with AsyncClient(URL) as llmq:
        job = await llmq.submit(input_ids=[3, 1, 4], max_new_tokens=4, request_id="no-otel-async")
        streamed = [token async for delta in job.stream(timeout=60) for token in delta.token_ids]
        generated = await llmq.generate(input_ids=[3, 1, 5], max_new_tokens=2, request_id="no-otel-generate")
    return streamed, generated.token_ids


streamed, generated = asyncio.run(main())
with Client(URL) as llmq:
    synced = llmq.submit(input_ids=[2, 7], max_new_tokens=3, request_id="no-otel-sync").result(timeout=60)
loaded = sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry")
print(json.dumps({"async": streamed, "generate": generated, "sync": synced.token_ids, "loaded": loaded}))
"""


async def test_a_client_without_opentelemetry_submits_and_reads_and_its_requests_trace_on_their_own(
    start_worker: Any, redis_url: str, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    await start_worker()
    env = without_opentelemetry(clean_env(OTEL_TRACES_EXPORTER="console"), tmp_path)
    process = await asyncio.create_subprocess_exec(
        PYTHON, "-c", NO_OTEL_CLIENT, redis_url, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    shown = json.loads(out.decode().strip().splitlines()[-1])
    assert shown["loaded"] == []  # opentelemetry really was out of reach
    assert shown["async"] == expected_tokens([3, 1, 4], 4)
    assert shown["generate"] == expected_tokens([3, 1, 5], 2)
    assert shown["sync"] == expected_tokens([2, 7], 3)
    ids = ["no-otel-async", "no-otel-generate", "no-otel-sync"]
    await wait_until(lambda: all(finished(spans, rid, "llmq.request") for rid in ids))
    for rid in ids:
        by_name = by_name_of(spans, rid)
        assert sorted(by_name) == sorted(WORKER_SPANS), rid  # no submit span: its client could not trace
        assert by_name["llmq.request"].parent is None, rid
        back_to_back(by_name["llmq.request"], [by_name[phase] for phase in PHASES])


def test_a_worker_and_a_gateway_without_opentelemetry_serve_untraced_whatever_otel_says(
    redis_url: str, collector: Collector, processes: Processes, tmp_path: Path
) -> None:
    env = without_opentelemetry(traced_env(collector, OTEL_TRACES_EXPORTER="otlp,console"), tmp_path)
    worker = processes.scripted_worker("worker", redis_url, env)
    gateway_process, url = processes.gateway("gateway", redis_url, env)
    model = wait_listed(url, worker, gateway_process)
    answer = chat(url, "hello", model=model, headers=CALLER)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 5
    with Client(redis_url) as llmq:
        assert llmq.submit(input_ids=[4, 2], max_new_tokens=2).result(timeout=60).token_ids == expected_tokens(
            [4, 2], 2
        )
    assert worker.stop() == 0
    gateway_process.stop()
    outputs = worker.out() + worker.err() + gateway_process.out() + gateway_process.err()
    assert "Traceback" not in outputs and "tracing on" not in outputs and "tracing_on" not in outputs
    assert collector.all() == [] and '"trace_id"' not in outputs
