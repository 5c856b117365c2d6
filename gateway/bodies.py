"""Reading a request's body under a size limit: refused (413) from its declared length when that is over, else
while it streams in, so an oversized body is never held whole. Shared by the JSON endpoints and `/v1/files`."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from gateway.errors import APIError


async def read_body(request: Request, limit: int, too_large: APIError | None = None) -> bytes:
    """The body's bytes, at most `limit` of them; past it `too_large` is raised (by default a 413
    `request_too_large` naming the limit)."""
    refusal = too_large or APIError(413, f"The body is over the limit of {limit} bytes.", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise refusal
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise refusal
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, refusing more than `limit` bytes (413) before reading them all."""
    try:
        body = json.loads(await read_body(request, limit))
    except ValueError:
        raise APIError(400, "The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object.", code="invalid_json")
    return body
