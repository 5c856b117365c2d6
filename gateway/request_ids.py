"""Request ids: the `X-Request-Id` of every answer, and the generation id of a call that carries an
`Idempotency-Key`.

A handler that submitted a generation answers with its id (it is also the `id` of the completion); every other
answer (401, 404, /health, /metrics, an error before the submit) gets a fresh one here, so a caller can always
quote one. A call with an `Idempotency-Key` is submitted under an id derived from its API key and that key, so a
retry of it is the same generation: `AsyncClient.submit` of an id already submitted adds nothing and follows
the first submission (the submit script's idempotency marker, which lives for the result's TTL, as `llmq batch`
relies on for exactly-once lines)."""

from __future__ import annotations

import hashlib
import hmac
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, from_exception

REQUEST_ID = "X-Request-Id"
IDEMPOTENCY_KEY = "Idempotency-Key"
MAX_IDEMPOTENCY_KEY = 255  # characters, as Stripe's (the SDKs' own keys are about 60)
_HEADER = REQUEST_ID.lower().encode()


def new_request_id() -> str:
    """A fresh id, of the client library's own form (`submit` without `request_id`)."""
    return uuid.uuid4().hex


def idempotent_request_id(api_key: str | None, idempotency_key: str, route: str) -> str:
    """The generation id of a call to `route` with `idempotency_key`: a keyed hash (HMAC-SHA256) under the
    caller's API key (None: `anonymous`), so the same key from two API keys, or sent to chat and to completions,
    names two generations (an answer of one endpoint never comes back as the other's), and an id shows none."""
    secret = b"anonymous" if api_key is None else b"key:" + api_key.encode()
    message = f"{route}\n{idempotency_key}".encode()
    return "idem-" + hmac.new(secret, message, hashlib.sha256).hexdigest()[:32]


def request_id_for(headers: Headers, api_key: str | None, route: str) -> tuple[str, bool]:
    """The id to submit a call to `route` under and whether it is idempotent (it carried an `Idempotency-Key`)."""
    key = headers.get(IDEMPOTENCY_KEY)
    if key is None:
        return new_request_id(), False
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY:
        message = f"{IDEMPOTENCY_KEY} must be 1 to {MAX_IDEMPOTENCY_KEY} characters"
        raise APIError(400, message, code="invalid_request", param=IDEMPOTENCY_KEY)
    return idempotent_request_id(api_key, key, route), True


class RequestIdMiddleware:
    """Adds a fresh `X-Request-Id` to every answer that has none; an exception that escapes every handler before
    an answer started becomes the gateway's own 500 (`x-should-retry: false`, an id), then goes on to be logged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        fresh = new_request_id()
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", ()))
                if all(name.lower() != _HEADER for name, _ in headers):
                    message = {**message, "headers": [*headers, (_HEADER, fresh.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as error:
            if not started:
                await from_exception(error, retry_after_s=0).response(fresh)(scope, receive, send)
            raise
