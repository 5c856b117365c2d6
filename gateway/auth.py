"""Optional bearer API keys (`LLMQ_GATEWAY_API_KEYS`, `LLMQ_GATEWAY_TENANTS_FILE`): every `/v1/` request needs one
when any is set, and a key of the tenants file acts for its tenant (`tenant_of`).

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


def authorized(header: str | None, keys: list[tuple[bytes, str | None]]) -> tuple[bool, str | None]:
    """Whether the header's key is one of `keys`, and the tenant that key acts for (None: the default)."""
    given = bearer_token(header)
    if given is None:
        return False, None
    token = given.encode()
    matched, tenant = False, None
    for key, owner in keys:
        same = hmac.compare_digest(token, key)
        matched |= same
        tenant = owner if same else tenant
    return matched, tenant


def tenant_of(scope: Scope) -> str | None:
    """The tenant the request's API key acts for (None: the client's default tenant), as `APIKeyMiddleware` set it:
    never from the body or a header, so a key cannot act for another tenant."""
    tenant: str | None = scope.get("state", {}).get("tenant")
    return tenant


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: list[tuple[bytes, str | None]]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {}).pop("tenant", None)  # whatever an outer layer put there is no key's
        if self.keys and scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            matched, tenant = authorized(header, self.keys)
            scope["state"]["tenant"] = tenant
            if not matched:
                answer = APIError(
                    401,
                    "Incorrect or missing API key: send Authorization: Bearer <key>.",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await answer.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
