"""`llmq`'s exit codes, defined once, and the one line each failure prints: scripts branch on the code, people read
the line. The table in docs/cli.md lists the same codes (a test compares them)."""

from __future__ import annotations

import re
from enum import IntEnum, unique
from urllib.parse import unquote, urlsplit

from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
)

from client.connection import explain, redact_url, secrets_of
from client.errors import (
    Cancelled,
    InvalidRequest,
    LLMQError,
    ProtocolError,
    QueueFull,
    RedisUnavailable,
    RequestFailed,
    ResultTimeout,
)


@unique
class Exit(IntEnum):
    """Small numbers after the two every tool shares (1: it failed, 2: argparse's usage error), and 130 for Ctrl-C
    (128 + SIGINT, what a shell reports for a command it interrupted)."""

    OK = 0
    FAILED = 1  # the worker answered with an error (any `ErrorCode`, `expired` too); a batch file had failed lines
    USAGE = 2  # bad flags, or a request refused before it was sent (out of bounds, a bad id or URL)
    TIMEOUT = 3  # no result within --timeout; the request may still run (`llmq attach ID`)
    UNAVAILABLE = 4  # Redis unreachable, refusing the credentials or the commands, or without a primary
    CANCELLED = 5  # the request ended as cancelled (by `llmq cancel`, another client, or its worker's drain)
    NOT_FOUND = 6  # no such request id on the queue, or no such dead letter
    QUEUE_FULL = 7  # the lane's backlog is at its limit: retry later
    INTERRUPTED = 130  # Ctrl-C: the request it was following is cancelled first


# redis-py's prefix for an error inside a pipeline: it names the command with its keys, which the reason does not need
_PIPELINE_PREFIX = re.compile(r"^Command # \d+ \(.*?\) of pipeline caused error: ")


class NotFound(LLMQError):
    """A request id or dead letter the queue does not hold."""


def failure(error: BaseException, url: str) -> tuple[Exit, str]:
    """The exit code and the one line (no password in it) for an error that ended a command."""
    return _code(error), _scrub(_message(error, url), url)


def _code(error: BaseException) -> Exit:
    kinds: list[tuple[type[BaseException] | tuple[type[BaseException], ...], Exit]] = [
        (ResultTimeout, Exit.TIMEOUT),
        ((RedisUnavailable, RedisError, RedisClusterException), Exit.UNAVAILABLE),
        (Cancelled, Exit.CANCELLED),
        (RequestFailed, Exit.FAILED),
        (NotFound, Exit.NOT_FOUND),
        (QueueFull, Exit.QUEUE_FULL),
        (InvalidRequest, Exit.USAGE),
        (ProtocolError, Exit.FAILED),  # an unreadable entry or event: not the caller's input
        ((ValueError, TypeError), Exit.USAGE),
    ]
    return next((code for kind, code in kinds if isinstance(error, kind)), Exit.FAILED)


def _message(error: BaseException, url: str) -> str:
    refusal = _refusal(error)
    if refusal is not None:
        return _refused(refusal, url)
    if isinstance(error, ResultTimeout):
        rid = error.request_id
        return f"{error}; it may still run: `llmq attach {rid}` follows it, `llmq cancel {rid}` stops it"
    if isinstance(error, RedisError | RedisClusterException):  # raised past the client's own wrapping
        return f"Redis at {redact_url(url)}: {explain(error, url)}"
    return str(error)


def _refusal(error: BaseException) -> RedisError | None:
    """redis-py's refusal of the credentials or of a command (ACL), where `error` is one or was caused by one."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, AuthenticationError | AuthorizationError | NoPermissionError):
            return seen
        seen = seen.__cause__
    return None


def _refused(refusal: RedisError, url: str) -> str:
    where = f"Redis at {redact_url(url)}"
    reason = _PIPELINE_PREFIX.sub("", str(refusal)).rstrip(".") or type(refusal).__name__
    if isinstance(refusal, AuthenticationError):
        if not secrets_of(url):  # redis-py then says "HELLO must be called with the client already authenticated"
            return f"{where} requires a password and the URL has none: redis://[USER]:PASSWORD@HOST:PORT/DB"
        return f"{where} refused the credentials: {reason}"
    user = _user(url)
    return f"{where} refused a command to {f'user {user!r}' if user else 'the default user'}: {reason}"


def _user(url: str) -> str | None:
    try:
        user = urlsplit(url).username
    except ValueError:  # a netloc urllib cannot read: the message just names no user
        return None
    return unquote(user) if user else None


def _scrub(message: str, url: str) -> str:
    """Never print a password, even if a library echoes the URL."""
    for secret in secrets_of(url):
        message = message.replace(secret, "***")
    return message
