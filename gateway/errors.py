"""Every error the gateway answers, in OpenAI's JSON shape (`{"error": {message, type, param, code}}`), and the
one table from the client's typed errors (`client.errors`) and wire codes (`ErrorCode`) to HTTP statuses.

Each answer also says whether a retry is safe (`x-should-retry`, which the OpenAI SDKs obey before their own
rules: they would retry every 408, 409, 429 and 5xx). A retry is safe when it cannot start a second generation
of the same call: nothing was queued (a full queue, Redis away before the submit), or the request ended with a
failure worth retrying. A cancelled or timed-out request, a refused one or a bug is not retried."""

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
    TenantQuotaExceeded,
)
from client.openai_format import FieldError, openai_param
from client.protocol import ErrorCode

SHOULD_RETRY = "x-should-retry"

# A limit of `RequestLimits` -> the wire field it measures, for a client library that does not name it.
_LIMIT_FIELDS = {"max_new_tokens": "params.max_new_tokens", "max_stop": "params.stop", "max_stop_bytes": "params.stop"}
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
        retry: bool = False,  # whether a retry of the same call is safe (`x-should-retry`)
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.retry = retry

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        """The answer; `request_id` (the generation's, once one was submitted) becomes its `X-Request-Id`."""
        headers = {**self.headers, SHOULD_RETRY: "true" if self.retry else "false"}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def unknown_model(model: str, served: list[str]) -> APIError:
    listed = ", ".join(served) or "none (no worker is alive)"
    return APIError(
        404, f"The model {model!r} does not exist. Served: {listed}.", code="model_not_found", param="model"
    )


def from_exception(
    error: BaseException, *, retry_after_s: int, url: str | None = None, max_tokens_field: str = "max_tokens"
) -> APIError:
    """The HTTP answer to an error raised by the client library (or by Redis under it). `url` (the endpoint) and
    `max_tokens_field` (the field that carried the token budget) let an error name the field the caller sent:
    `messages` or `prompt` for the input, `max_tokens` or `max_completion_tokens` for the budget."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, FieldError):
        return APIError(400, str(error), code="invalid_request", param=error.field)
    if isinstance(error, InvalidRequest):  # the client library's own checks, `LimitExceeded` among them
        param = _openai_param(error, url, max_tokens_field)
        return APIError(400, str(error), code="invalid_request", param=param)
    if isinstance(error, QueueFull):  # nothing was queued; at a tenant's quota, other tenants' requests still are
        message, code = (
            ("Your tenant's queued requests are at its quota; retry later.", "tenant_quota_exceeded")
            if isinstance(error, TenantQuotaExceeded)
            else ("The queue is full; retry later.", "queue_full")
        )
        headers = {"Retry-After": str(retry_after_s)}
        return APIError(429, message, kind="rate_limit_error", code=code, headers=headers, retry=True)
    if isinstance(error, RequestFailed):
        status, kind = _FAILURES.get(error.code, (503, "server_error") if error.retryable else (500, "server_error"))
        param = _openai_param(error, url, max_tokens_field)
        retry = error.retryable and status == 503  # it has ended: a retry is one new generation, not a second
        return APIError(status, str(error), kind=kind, code=error.code, param=param, retry=retry)
    if isinstance(error, ResultTimeout):
        return APIError(408, f"{error} (the request was cancelled)", kind="timeout_error", code="timeout")
    if isinstance(error, Cancelled):
        return APIError(409, str(error), kind="invalid_request_error", code="cancelled")
    if isinstance(error, RedisUnavailable | RedisConnectionError | RedisTimeoutError):
        message = "The queue is unreachable; retry later."
        return APIError(503, message, kind="server_error", code="unavailable", retry=True)
    return APIError(500, "Internal error in the gateway.", kind="server_error", code="internal")


def _openai_param(error: InvalidRequest | RequestFailed, url: str | None, max_tokens_field: str) -> str | None:
    """The OpenAI field an error blames: the wire field it names (`param`, read with getattr so that errors from
    a client library or worker older than the field still work), or the field a `LimitExceeded` measures."""
    wire = getattr(error, "param", None)
    if wire is None and isinstance(error, LimitExceeded):
        wire = _LIMIT_FIELDS.get(error.limit, "prompt")  # the prompt limits: max_prompt_bytes, max_input_ids
    return None if wire is None else openai_param(wire, url or "", max_tokens_field)


def once_submitted(answer: APIError, *, idempotent: bool) -> APIError:
    """`answer` to a call whose generation may have been queued: whether a retry is safe now depends on what a
    retry does. With an `Idempotency-Key` it follows the same generation, so it helps only while that generation
    may still answer (Redis was away: `unavailable`); after a final error it would only repeat it. Without one it
    starts a new generation: safe once the first has ended (a retryable failure), never while it may still run."""
    if answer.code == "unavailable":
        answer.retry = idempotent
    elif idempotent and answer.code != "queue_full":  # a full queue added nothing, not even the id
        answer.retry = False
    return answer
