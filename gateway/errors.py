"""Every error the gateway answers, in OpenAI's JSON shape (`{"error": {message, type, param, code}}`), and the
one table from the client's typed errors (`client.errors`) and wire codes (`ErrorCode`) to HTTP statuses."""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.responses import JSONResponse

from client.errors import (
    Cancelled,
    InvalidRequest,
    LimitExceeded,
    QueueFull,
    RedisUnavailable,
    RequestFailed,
    ResultTimeout,
)
from client.openai_format import FieldError
from client.protocol import ErrorCode

# A limit of `RequestLimits` under the OpenAI field that carries it.
_LIMIT_FIELDS = {"max_new_tokens": "max_tokens", "max_stop": "stop", "max_stop_bytes": "stop"}
# A failed request's wire code -> (HTTP status, OpenAI error type). Codes not here: 503 if retryable, else 500.
_FAILURES: dict[str, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.EXPIRED: (408, "timeout_error"),
    ErrorCode.ENGINE_FAILED: (503, "server_error"),
    ErrorCode.DELIVERY_LIMIT: (503, "server_error"),
    ErrorCode.POISON_REQUEST: (500, "server_error"),
    ErrorCode.UNSUPPORTED_VERSION: (500, "server_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}


class APIError(Exception):
    """An answer other than 200: raised anywhere in a handler, rendered by `response`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,  # every answer names one: clients branch on it, not on the message
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unknown_model(model: str, served: list[str]) -> APIError:
    listed = ", ".join(served) or "none (no worker is alive)"
    return APIError(
        404, f"The model {model!r} does not exist. Served: {listed}.", code="model_not_found", param="model"
    )


def from_exception(error: BaseException, *, retry_after_s: int, source: str = "prompt") -> APIError:
    """The HTTP answer to an error raised by the client library (or by Redis under it); `source` is the
    field that carries the input (`messages` or `prompt`), named by a prompt-size error."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, FieldError):
        return APIError(400, str(error), code="invalid_request", param=error.field)
    if isinstance(error, LimitExceeded):
        return APIError(400, str(error), code="invalid_request", param=_LIMIT_FIELDS.get(error.limit, source))
    if isinstance(error, InvalidRequest):
        return APIError(400, str(error), code="invalid_request")
    if isinstance(error, QueueFull):
        return APIError(
            429,
            "The queue is full; retry later.",
            kind="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry_after_s)},
        )
    if isinstance(error, RequestFailed):
        status, kind = _FAILURES.get(error.code, (503, "server_error") if error.retryable else (500, "server_error"))
        return APIError(status, str(error), kind=kind, code=error.code)
    if isinstance(error, ResultTimeout):
        return APIError(408, f"{error} (the request was cancelled)", kind="timeout_error", code="timeout")
    if isinstance(error, Cancelled):
        return APIError(409, str(error), kind="invalid_request_error", code="cancelled")
    if isinstance(error, RedisUnavailable | RedisConnectionError | RedisTimeoutError):
        return APIError(503, "The queue is unreachable; retry later.", kind="server_error", code="unavailable")
    return APIError(500, "Internal error in the gateway.", kind="server_error", code="internal")
