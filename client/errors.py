"""Typed errors raised by the llmq client.

Catch `LLMQError` for everything the library raises itself (Redis' own errors pass through unwrapped).
Terminal `error` events arrive as an `ErrorCode` on the wire and become the class mapped to that code;
a code this client does not know becomes the root `RequestFailed`, so newer workers stay readable.

Our exception hierarchy:

* LLMQError
  + QueueFull                  - the queue's backlog is at `max_queue_len`; retry later.
  + RequestFailed              - the request ended with an `error` event (`.code`, `.retryable`).
  | + RequestExpired           - its deadline passed before a worker got to it.
  + Cancelled                  - it was cancelled; `.result` holds the partial output.
  + ResultTimeout              - (also a `TimeoutError`) no terminal event within the caller's timeout.
  + protocol.ProtocolError     - (also a `ValueError`) bytes or fields that break the wire protocol.
    + protocol.MalformedEntry     - not msgpack, not a map, or no usable `v`/`id`.
    + protocol.UnsupportedVersion - `v` is not this client's `PROTOCOL_VERSION`.
    + protocol.InvalidRequest     - a request that fails validation or `RequestLimits`.
      + protocol.LimitExceeded    - names the limit in `.limit`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from client._core import Result
    from client.protocol import ErrorEvent


class ErrorCode(StrEnum):
    """Why a request failed, as carried by an `error` event (re-exported by `client.protocol`)."""

    INVALID_REQUEST = "invalid_request"
    EXPIRED = "expired"
    UNSUPPORTED_VERSION = "unsupported_version"
    ENGINE_FAILED = "engine_failed"
    POISON_REQUEST = "poison_request"  # implicated in repeated engine failures; quarantined, never run again
    DELIVERY_LIMIT = "delivery_limit"
    INTERNAL = "internal"


class LLMQError(Exception):
    """Root of every error this library raises."""


class QueueFull(LLMQError):
    """The queue already holds `max_queue_len` unfinished requests: back off and retry."""


class RequestFailed(LLMQError):
    """The worker answered with an `error` event; `code` is the wire code (a str, possibly unknown)."""

    def __init__(self, code: str, message: str, retryable: bool = False, request_id: str | None = None) -> None:
        who = f"request {request_id!r}" if request_id else "request"
        super().__init__(f"{who} failed ({code}): {message}")
        self.request_id = request_id
        self.code = str(code)
        self.message = message
        self.retryable = retryable


class RequestExpired(RequestFailed):
    """The deadline passed before a worker started the request."""


class Cancelled(LLMQError):
    """`result()` was asked of a request that finished as `cancelled`; `result` is what was generated."""

    def __init__(self, result: Result) -> None:
        super().__init__(f"request {result.request_id!r} was cancelled after {len(result.token_ids)} tokens")
        self.result = result


class ResultTimeout(LLMQError, TimeoutError):
    """No terminal event arrived within the caller's timeout; the request may still be running."""

    def __init__(self, request_id: str, waited_s: float, tokens_seen: int) -> None:
        awaited = "its first event" if tokens_seen == 0 else f"its 'done' event after {tokens_seen} tokens"
        super().__init__(f"request {request_id!r}: waited {waited_s:.1f} s for {awaited}")
        self.request_id = request_id
        self.waited_s = waited_s
        self.tokens_seen = tokens_seen


_BY_CODE: dict[str, type[RequestFailed]] = {ErrorCode.EXPIRED: RequestExpired}


def error_from_event(event: ErrorEvent, request_id: str | None = None) -> RequestFailed:
    """The exception for a terminal `error` event; unknown codes map to `RequestFailed` itself."""
    cls = _BY_CODE.get(str(event.code), RequestFailed)
    return cls(str(event.code), event.message, event.retryable, request_id)
