"""structlog setup shared by the two server processes, the worker and the gateway: one line per event, JSON
for machines or console for people, request ids bound by the caller (`bind_contextvars`), and no secrets: URLs
of any scheme in any field have their passwords replaced, read as `client.connection` reads them.

A package of its own so that neither server imports the other: it imports structlog and the client's URL
reading, nothing of the worker's (no torch) or the gateway's (no Starlette). structlog comes with the `worker`
and `gateway` extras; the client never imports this package, so the base install does not need it."""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

from client.connection import redact_text as redact  # one reading of URLs for messages and logs alike

__all__ = ["configure", "get_logger", "redact"]


def _redact_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
    return {key: redact(value) if isinstance(value, str) else value for key, value in event.items()}


def configure(log_format: str = "console", level: str = "info") -> None:
    renderer: Any = structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redact_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str, **bound: Any) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name).bind(**bound)
