"""Prometheus metrics of one gateway, named like the workers' (`llmq:`), labelled by route, status and model
(nothing unbounded: `model` is a served model's name, set only once the request named one a worker serves, else
empty, which Prometheus shows as no label; no request ids). Each app has its own registry, so several apps in
one process (tests) do not collide; it also carries prometheus_client's process, platform and GC collectors, and
no `_created` series."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serverlog.metrics import server_registry

__all__ = ["CLIENT_CLOSED", "CONTENT_TYPE", "GatewayMetrics", "MetricsMiddleware", "label_model"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A status for requests whose client went away before the answer (nginx's convention).
CLIENT_CLOSED = 499
_SCOPE_KEY = "llmq.metrics"  # the ASGI scope's entry holding a request's `_Labels`


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = server_registry()
        self.requests = Counter(
            "llmq:gateway_requests", "HTTP requests answered.", ["route", "status", "model"], registry=self.registry
        )
        self.latency = Histogram(
            "llmq:gateway_request_duration_seconds",
            "Time from a request's arrival to its last byte.",
            ["route", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llmq:gateway_time_to_first_token_seconds",
            "Streams: time from a request's arrival to its first generated text being ready to send.",
            ["route", "model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "llmq:gateway_requests_in_flight",
            "Requests being answered now.",
            ["route", "model"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Labels:
    """One request's labels: its route, and its model once the handler knows it is served (`label_model`)."""

    __slots__ = ("metrics", "model", "route")

    def __init__(self, metrics: GatewayMetrics, route: str) -> None:
        self.metrics, self.route, self.model = metrics, route, ""


def label_model(scope: Scope, model: str) -> None:
    """Labels the request of `scope` with `model` (a served model's name: never an unchecked one from the body), its
    in-flight count moved to it; a no-op for a request the middleware does not see (an app without it)."""
    labels = scope.get(_SCOPE_KEY)
    if not isinstance(labels, _Labels) or labels.model == model:
        return
    labels.metrics.in_flight.labels(labels.route, labels.model).dec()
    labels.metrics.in_flight.labels(labels.route, model).inc()
    labels.model = model


class MetricsMiddleware:
    """Counts every HTTP answer by route, status and model, times it to its last byte, and holds the in-flight
    gauge. A response that never sent its last byte (its client went away mid-stream) counts as 499. The handler
    names the model (`label_model`) through the request's scope."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        status, complete = CLIENT_CLOSED, False

        async def observed(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        started = time.monotonic()
        labels = scope[_SCOPE_KEY] = _Labels(self.metrics, route)
        self.metrics.in_flight.labels(route, "").inc()
        try:
            await self.app(scope, receive, observed)
        finally:
            model = labels.model
            self.metrics.in_flight.labels(route, model).dec()
            self.metrics.latency.labels(route, model).observe(time.monotonic() - started)
            self.metrics.requests.labels(route, str(status if complete else CLIENT_CLOSED), model).inc()
