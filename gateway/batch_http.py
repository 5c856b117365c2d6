"""What the `/v1/files` and `/v1/batches` handlers share: who the caller is (the owner of what it creates), their
errors in OpenAI's shape, and listing pages."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.batch_store import Kind, owner_of
from gateway.errors import APIError, from_exception
from gateway.state import Gateway

Handler = Callable[[Request], Awaitable[Response]]


def answered(handler: Handler) -> Handler:
    """`handler` with every error answered in OpenAI's shape (Redis away: 503, retry safe); bugs are logged."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        try:
            return await handler(request)
        except Exception as error:
            answer = from_exception(error, retry_after_s=gateway.settings.retry_after_s)
            if answer.code == "internal":
                gateway.log.exception("batch_api_failed", route=request.url.path)
            return answer.response()

    return wrapped


def owner(request: Request) -> str:
    gateway: Gateway = request.app.state.gateway
    return owner_of(request.headers.get("authorization"), bool(gateway.settings.keys))


def not_found(kind: str, object_id: str) -> APIError:
    """The answer for an id that does not exist and for another owner's alike: neither is told apart."""
    return APIError(404, f"No such {kind}: {object_id!r}.", code="not_found", param="id")


async def owned(request: Request, kind: Literal["file", "batch"]) -> dict[str, Any]:
    """The caller's file or batch that the path names (`{file_id}`, `{batch_id}`), or a 404."""
    gateway: Gateway = request.app.state.gateway
    object_id = request.path_params[f"{kind}_id"]
    read = gateway.batches.file if kind == "file" else gateway.batches.batch
    record = await read(owner(request), object_id)
    if record is None:
        raise not_found(kind, object_id)
    return record


async def listing(
    request: Request, kind: Kind, *, default_limit: int, most: int, keep: Callable[[dict[str, Any]], bool] = bool
) -> Response:
    """A page of the caller's files or batches (those `keep` keeps), newest first, in OpenAI's cursor shape
    (`after`, `limit`)."""
    gateway: Gateway = request.app.state.gateway
    raw = request.query_params.get("limit", str(default_limit))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise APIError(400, f"limit must be an integer from 1 to {most}.", code="invalid_request", param="limit")
    after = request.query_params.get("after")
    records, more = await gateway.batches.listed(owner(request), kind, after, int(raw), keep)
    data = [await gateway.batches.shown(record) for record in records]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return JSONResponse({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})
