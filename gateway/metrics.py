"""Prometheus metrics of one gateway, named like the workers' (`llmq:`), labelled by route and status only
(nothing unbounded: no models from callers, no request ids). Each app has its own registry, so several apps
in one process (tests) do not collide."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CLIENT_CLOSED", "CONTENT_TYPE", "GatewayMetrics", "MetricsMiddleware"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A status for requests whose client went away before the answer (nginx's convention).
CLIENT_CLOSED = 499


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmq:gateway_requests", "HTTP requests answered.", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "llmq:gateway_request_duration_seconds",
            "Time from a request's arrival to its last byte.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llmq:gateway_time_to_first_token_seconds",
            "Streams: time from a request's arrival to its first generated text being ready to send.",
            ["route"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "llmq:gateway_requests_in_flight", "Requests being answered now.", ["route"], registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every HTTP answer by route and status, times it to its last byte, and holds the in-flight gauge.
    A response that never sent its last byte (its client went away mid-stream) counts as 499."""

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
        in_flight = self.metrics.in_flight.labels(route)
        in_flight.inc()
        try:
            await self.app(scope, receive, observed)
        finally:
            in_flight.dec()
            self.metrics.latency.labels(route).observe(time.monotonic() - started)
            self.metrics.requests.labels(route, str(status if complete else CLIENT_CLOSED)).inc()
