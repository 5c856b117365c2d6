"""Every exception the llmq client raises, in one place (wire error codes are `client.protocol.ErrorCode`).

Catch `LLMQError` for everything the library raises: no redis-py exception crosses its public surface. A
failover's replies (MOVED, ASK, CLUSTERDOWN, READONLY, a dropped connection) are retried while a primary is being
replaced; what outlasts that becomes `RedisUnavailable`, with redis-py's exception as its `__cause__`.
Terminal `error` events arrive as an `ErrorCode` on the wire and become the class mapped to that code
(`client.protocol.error_from_event`); a code this client does not know becomes the root `RequestFailed`, so
newer workers stay readable.

Our exception hierarchy:

* LLMQError
  + QueueFull                  - the queue's backlog is at `max_queue_len`; retry later.
  | + TenantQuotaExceeded      - the tenant's queued requests or tokens are at its quota (`.tenant`).
  + RequestFailed              - the request ended with an `error` event (`.code`, `.retryable`, `.param`).
  | + RequestExpired           - its deadline passed before a worker got to it.
  + Cancelled                  - it was cancelled; `.result` holds the partial output.
  + ResultTimeout              - (also a `TimeoutError`) no terminal event within the caller's timeout.
  + ClientClosed               - the client was closed: no more calls; jobs still waiting stop waiting.
  + RedisUnavailable           - (also a `ConnectionError`) Redis did not serve a call, even after retries.
  + ProtocolError              - (also a `ValueError`) bytes or fields that break the wire protocol.
    + MalformedEntry           - not msgpack, not a map, or no usable `v`/`id`.
    + UnsupportedVersion       - `v` is not this client's `PROTOCOL_VERSION`.
    + InvalidRequest           - a request that fails validation or `RequestLimits` (`.param`: which field).
      + LimitExceeded          - names the limit in `.limit`.

This module imports nothing from the package, so every other module can import it.
"""

from __future__ import annotations

from typing import Any, Protocol


class LLMQError(Exception):
    """Root of every error this library raises."""


class QueueFull(LLMQError):
    """The queue already holds `max_queue_len` unfinished requests: back off and retry."""


class TenantQuotaExceeded(QueueFull):
    """The tenant's requests waiting for fair share are at its `max_queued` or `max_queued_tokens` quota
    (`client.tenants.TenantLimits`), or the tenant is new and the queue serves its most tenants (the workers'
    `LLMQ_MAX_TENANTS`): nothing was queued. Other tenants still submit; back off and retry."""

    def __init__(self, message: str, tenant: str) -> None:
        super().__init__(message)
        self.tenant = tenant


class RequestFailed(LLMQError):
    """The worker answered with an `error` event; `code` is the wire code (a str, possibly unknown). `param` names
    the request field it refused, by its wire name (`params.max_new_tokens`, `input_ids`...), when one field was
    the reason (None otherwise, and from workers older than the field)."""

    def __init__(
        self,
        code: str,
        message: str,
        retryable: bool = False,
        request_id: str | None = None,
        param: str | None = None,
    ) -> None:
        who = f"request {request_id!r}" if request_id else "request"
        super().__init__(f"{who} failed ({code}): {message}")
        self.request_id = request_id
        self.code = str(code)
        self.message = message
        self.retryable = retryable
        self.param = param


class RequestExpired(RequestFailed):
    """The deadline passed before a worker started the request."""


class _PartialResult(Protocol):
    request_id: str
    token_ids: list[int]


class Cancelled(LLMQError):
    """`result()` was asked of a request that finished as `cancelled`; `result` is what was generated."""

    def __init__(self, result: Any) -> None:
        partial: _PartialResult = result
        super().__init__(f"request {partial.request_id!r} was cancelled after {len(partial.token_ids)} tokens")
        self.result = result


class ResultTimeout(LLMQError, TimeoutError):
    """No terminal event arrived within the caller's timeout; the request may still be running."""

    def __init__(self, request_id: str, waited_s: float, tokens_seen: int) -> None:
        awaited = "its first event" if tokens_seen == 0 else f"its 'done' event after {tokens_seen} tokens"
        super().__init__(f"request {request_id!r}: waited {waited_s:.1f} s for {awaited}")
        self.request_id = request_id
        self.waited_s = waited_s
        self.tokens_seen = tokens_seen


class ClientClosed(LLMQError):
    """The client was closed: it submits nothing more, and jobs still awaiting their results through it stop
    waiting with this error (the requests themselves go on; another client can `attach` to them)."""


class RedisUnavailable(LLMQError, ConnectionError):
    """Redis did not serve a call: unreachable, refusing the credentials, or still without a primary after the
    retries a failover needs. The message names no password; `__cause__` is redis-py's exception."""


class ProtocolError(LLMQError, ValueError):
    """Bytes or fields that break the protocol; `request_id` is set when the entry named a valid one."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class MalformedEntry(ProtocolError):
    """Not msgpack, not a map, no usable `v`, a string that is not UTF-8, or no valid `id`. A request whose id
    could still be read is raised as `InvalidRequest` instead, so its reader gets an answer."""


class UnsupportedVersion(ProtocolError):
    """`v` is not `PROTOCOL_VERSION`."""


class InvalidRequest(ProtocolError):
    """A request that fails schema validation (types, ranges, unknown fields) or `RequestLimits`; `param` is the
    wire name of the field at fault (`params.stop`, `messages`...) when one field is."""

    def __init__(self, message: str, request_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message, request_id)
        self.param = param


class LimitExceeded(InvalidRequest):
    """A request over one of `RequestLimits`; `limit` is the limit's name, e.g. `max_prompt_bytes`, and `param` the
    field it measures."""

    def __init__(self, limit: str, message: str, request_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message, request_id, param)
        self.limit = limit
