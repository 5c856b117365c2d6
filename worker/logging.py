"""structlog setup: one line per event, JSON for machines or console for people, request ids bound by the
intake (`bind_contextvars`), and no secrets: URLs in any field have their password replaced. The gateway
uses it too: this module imports nothing of the worker's (no torch)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

_URL_PASSWORD = re.compile(r"((?:rediss?|unix)(?:\+cluster|\+sentinel)?://[^:/@\s]*:)[^@\s]+@")
_SENTINEL_PASSWORD = re.compile(r"(sentinel_password=)[^&\s]+")


def redact(text: str) -> str:
    return _SENTINEL_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


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
    # transformers logs a warning per "useless token" and similar chatter from its engine thread.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def get_logger(name: str = "llmq.worker", **bound: Any) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name).bind(**bound)
