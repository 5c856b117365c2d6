"""Server-sent events, and noticing a client that went away: the gateway's only ASGI-level code.

Written by hand (about fifty lines) rather than with sse-starlette: OpenAI's streams are plain `data:` lines
ending with `data: [DONE]`, and what matters here is the disconnect, which must cancel the queued request.
uvicorn does not cancel a handler whose client left; it answers `receive()` with `http.disconnect`, so every
wait on the queue (`unless_disconnected`) races a task that watches for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each event on at once
]


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


# Characters that Python's str.splitlines (httpx's iter_lines, many SSE readers) takes for line breaks and JSON
# leaves raw: escaped, so a model that writes one cannot split an event in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(data: dict[str, Any]) -> bytes:
    """One SSE event carrying `data` as compact JSON, on one line for any reader."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS)
    return b"data: " + text.encode() + b"\n\n"


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, awaitable: Awaitable[T]) -> T:
    """`awaitable`'s result, unless the client disconnects first: then it is cancelled and `ClientGone` raised."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({work})
        gone.cancel()
    if work.cancelled():
        raise ClientGone
    return work.result()


class EventStream(Response):
    """An ASGI response sending `events` as they come. When the client disconnects (or a send fails), the
    iterator is closed, so the `finally` of the generator that produced it runs its cleanup (cancelling the
    request); the response then ends without its final empty body, which the metrics count as 499."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        self.status_code = 200  # Response.__init__ is not called: it would render a body
        self.background = None
        self.events = events
        self.sse_headers = HEADERS + [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.sse_headers})

        async def pump() -> None:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await unless_disconnected(receive, pump())
        except (ClientGone, OSError):
            pass
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
