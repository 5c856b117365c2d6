"""The Starlette app: routes, middleware and the one `AsyncClient` (opened by the lifespan, shared by every
request). `create_app()` with no argument reads `LLMQ_GATEWAY_*`, so `uvicorn --factory gateway.app:create_app`
works as well as `llmq-gateway`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from client import AsyncClient
from client.connection import open_async
from client.store import Keys
from client.tracing import configure_from_env
from gateway.auth import APIKeyMiddleware
from gateway.batch_driver import BatchDriver
from gateway.batch_store import BatchStore
from gateway.batches import cancel_batch, create_batch, get_batch, list_batches
from gateway.completions import chat_completions, completions
from gateway.errors import APIError, from_exception, unknown_model
from gateway.files import create_file, delete_file, file_content, get_file, list_files
from gateway.metrics import CONTENT_TYPE, GatewayMetrics, MetricsMiddleware
from gateway.models import ModelDirectory, ServedModel
from gateway.request_ids import RequestIdMiddleware
from gateway.settings import GatewaySettings
from gateway.state import Gateway
from gateway.tracing import TracingMiddleware
from serverlog import get_logger


def _model_object(model: ServedModel) -> dict[str, object]:
    return {
        "id": model.id,
        "object": "model",
        "created": model.created,
        "owned_by": "llmq",
        "queue": model.queue,
        "workers": model.workers,
    }


async def list_models(request: Request) -> Response:
    """The models of the live workers on the configured queues (from their heartbeats)."""
    gateway: Gateway = request.app.state.gateway
    try:
        served = await gateway.models.served()
    except Exception as error:
        return _directory_failed(gateway, request, error)
    return JSONResponse({"object": "list", "data": [_model_object(m) for m in served.values()]})


async def get_model(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    name = request.path_params["model"]
    try:
        served = await gateway.models.served()
    except Exception as error:
        return _directory_failed(gateway, request, error)
    if name not in served:
        return unknown_model(name, sorted(served)).response()
    return JSONResponse(_model_object(served[name]))


def _directory_failed(gateway: Gateway, request: Request, error: Exception) -> Response:
    """The answer when the model directory cannot be read: an outage is a 503; anything else, a 500, is logged."""
    answer = from_exception(error, retry_after_s=gateway.settings.retry_after_for(error))
    if answer.code == "internal":
        gateway.log.error("models_failed", route=request.url.path, error=repr(error))
    return answer.response()


async def health(request: Request) -> Response:
    """200 while Redis answers (read through the model directory, so at most every `models_refresh_s`)."""
    gateway: Gateway = request.app.state.gateway
    try:
        served = await gateway.models.served()
    except Exception as error:
        gateway.log.warning("health_failed", error=repr(error))
        return JSONResponse({"status": "unavailable", "error": type(error).__name__}, status_code=503)
    return JSONResponse({"status": "ok", "models": sorted(served)})


async def metrics(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's own answers (unknown path, wrong method) in OpenAI's error shape."""
    status = error.status_code if isinstance(error, HTTPException) else 500
    detail = error.detail if isinstance(error, HTTPException) else "Internal error."
    headers = dict(error.headers or {}) if isinstance(error, HTTPException) else None
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "internal" if status >= 500 else "invalid_request")
    return APIError(status, f"{request.method} {request.url.path}: {detail}", code=code, headers=headers).response()


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/files", create_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]


def create_app(settings: GatewaySettings | None = None, *, client: AsyncClient | None = None) -> Starlette:
    """The gateway for `settings` (default: from the environment). `client` replaces the one built from the
    settings (tests, embedding); it is not closed with the app."""
    settings = settings or GatewaySettings()
    gateway_metrics = GatewayMetrics()
    log = get_logger("llmq.gateway")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        configure_from_env("llmq-gateway").report(log, "tracing_on", "tracing_not_configured")
        queue_client = client or AsyncClient(
            settings.redis_url.get_secret_value(),
            queue=settings.queue_names[0],
            prefix=settings.prefix,
            max_queue_len=settings.max_queue_len,
            result_ttl=settings.result_ttl_s,
            limits=settings.limits,
            ssl_ca_certs=str(settings.redis_ca_file) if settings.redis_ca_file else None,
            max_connections=settings.redis_max_connections,
            failover_timeout=settings.redis_failover_timeout_s,
            wait_replicas=settings.redis_wait_replicas,
            partitions=settings.queue_partitions,
        )
        models = ModelDirectory(
            queue_client, settings.queue_names, stale_s=settings.worker_stale_s, refresh_s=settings.models_refresh_s
        )
        store_redis = open_async(
            settings.redis_url.get_secret_value(),
            ssl_ca_certs=str(settings.redis_ca_file) if settings.redis_ca_file else None,
            max_connections=settings.redis_max_connections,
        )
        await _write_tenants(store_redis, settings, log)
        store = BatchStore(store_redis, settings.prefix, settings.batch_ttl_s)
        app.state.gateway = Gateway(settings, queue_client, models, gateway_metrics, log, store)
        driver = asyncio.create_task(BatchDriver(store, queue_client, models, settings, log).run_forever())
        log.info("gateway_started", queues=settings.queue_names, api_keys=len(settings.keys))
        try:
            yield
        finally:
            driver.cancel()  # lets go of its batches' leases, so another gateway takes them over at once
            await _within(asyncio.wait({driver}), "the batch driver", log)
            await _within(store_redis.aclose(), "the batch store's connections", log)
            if client is None:
                await _within(queue_client.aclose(), "the queue client", log)

    routes = frozenset(route.path for route in ROUTES if "{" not in route.path)
    return Starlette(
        routes=ROUTES,
        middleware=[
            Middleware(TracingMiddleware, routes=routes),  # outermost: the span covers the others too
            Middleware(RequestIdMiddleware),  # every answer gets an X-Request-Id, 401s included
            Middleware(MetricsMiddleware, metrics=gateway_metrics, routes=routes),
            Middleware(APIKeyMiddleware, keys=settings.key_tenants),
        ],
        exception_handlers={HTTPException: _http_error},
        lifespan=lifespan,
    )


STOP_STEP_S = 5.0  # each step of the lifespan's stop: however a step hangs, the gateway exits


async def _within(step: Any, what: str, log: Any) -> None:
    """Awaits one step of the stop, at most `STOP_STEP_S`: a step that hangs is logged and left behind."""
    try:
        await asyncio.wait_for(step, STOP_STEP_S)
    except TimeoutError:
        log.error("gateway_stop_step_timed_out", step=what, timeout_s=STOP_STEP_S)


async def _write_tenants(redis: Any, settings: GatewaySettings, log: Any) -> None:
    """The tenants file's weights and quotas into every served queue's partitions, where the scripts read them
    (`llmq tenants set` writes the same keys). A Redis away at start-up costs them until the next start, not the
    start."""
    tenants = settings.tenants
    weights = {tenant: repr(weight) for tenant, weight in tenants.weights.items()}
    limits = {tenant: quotas.pack() for tenant, quotas in tenants.limits.items() if not quotas.unlimited}
    if not weights and not limits:
        return
    try:
        for name in settings.queue_names:
            for part in Keys(name, settings.prefix).partitioned(settings.queue_partitions):
                if tenants.weights:
                    weights = {tenant: repr(weight) for tenant, weight in tenants.weights.items()}
                    await redis.hset(part.tenant_weights, mapping=weights)
                if tenants.limits:
                    limits = {
                        tenant: limits.pack() for tenant, limits in tenants.limits.items() if not limits.unlimited
                    }
                    await redis.hset(part.tenant_limits, mapping=limits) if limits else None
    except RedisError as error:
        log.warning("tenant_settings_not_written", error=str(error))
        return
    log.info("tenant_settings_written", tenants=len(tenants.weights | tenants.limits), queues=settings.queue_names)
