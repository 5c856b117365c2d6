"""OpenTelemetry for the gateway: a SERVER span per HTTP request, continuing the caller's trace when its headers
carry one (W3C `traceparent` and `baggage`, through the configured propagators), and current while the request is
served, so the client's `llmq.submit` span (and through the queue, the worker's spans) nest under it.

Named and attributed as OpenTelemetry's HTTP server conventions say (`POST /v1/chat/completions`, with
`http.request.method`, `http.route`, `url.path`, `http.response.status_code`; a 5xx answer marks it failed). It ends
with the response's last byte: for a stream, after the final chunk. Without OpenTelemetry, or with no tracer
provider, it costs one check per request (`client.tracing.configure_from_env` installs the provider).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from client.tracing import otel_context, propagate, trace, tracer

TRACER_NAME = "llmq.gateway"


def route_of(path: str, routes: frozenset[str]) -> str | None:
    """The route template a path matched (`http.route`), or None for a path the gateway does not serve."""
    if path in routes:
        return path
    if path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
        return "/v1/models/{model}"
    return None


class TracingMiddleware:
    def __init__(self, app: ASGIApp, routes: frozenset[str]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = tracer(TRACER_NAME) if scope["type"] == "http" else None
        if found is None:
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:  # a header sent twice is one list (tracestate may be)
            name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]},{value}" if name in headers else value
        method, route = scope["method"], route_of(scope["path"], self.routes)
        attributes = {
            "http.request.method": method,
            "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
        }
        if route is not None:
            attributes["http.route"] = route
        if "user-agent" in headers:
            attributes["user_agent.original"] = headers["user-agent"]
        # The caller's whole context is made current, not only passed as the span's parent: its baggage then
        # rides on with the span into the submit's entry (and on to the worker) beside the traceparent.
        token = otel_context.attach(propagate.extract(headers))
        try:
            with found.start_as_current_span(
                f"{method} {route}" if route else method, kind=trace.SpanKind.SERVER, attributes=attributes
            ) as span:

                async def observed(message: Message) -> None:
                    if message["type"] == "http.response.start":
                        status = message["status"]
                        span.set_attribute("http.response.status_code", status)
                        if status >= 500:
                            span.set_status(trace.Status(trace.StatusCode.ERROR))
                    await send(message)

                await self.app(scope, receive, observed)
        finally:
            otel_context.detach(token)
