"""Reading a request's body under a size limit: refused (413) from its declared length when that is over, else
while it streams in, so an oversized body is never held whole. Shared by the JSON endpoints and `/v1/files`."""

from __future__ import annotations

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
