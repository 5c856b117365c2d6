"""Optional bearer API keys (`LLMQ_GATEWAY_API_KEYS`): every `/v1/` request needs one when any is set.

Keys are compared with `hmac.compare_digest` against every configured key (no early exit), so neither a key's
content nor which key matched shows in the response time. `/health` and `/metrics` stay open, for load
balancers and Prometheus (keep them on a private network)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

PROTECTED = "/v1/"


def bearer_token(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (None for none, or for another scheme)."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None
    return given.strip()


def authorized(header: str | None, keys: list[bytes]) -> bool:
    given = bearer_token(header)
    if given is None:
        return False
    token = given.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: list[bytes]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys and scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not authorized(header, self.keys):
                answer = APIError(
                    401,
                    "Incorrect or missing API key: send Authorization: Bearer <key>.",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await answer.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
