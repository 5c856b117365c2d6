"""The worker's logging: the servers' shared structlog setup (`serverlog`: one line per event, request ids
bound by the intake, no secrets), plus quieting the library's chatter from the engine thread."""

from __future__ import annotations

import logging
from typing import Any

import structlog

import serverlog
from serverlog import redact

__all__ = ["configure", "get_logger", "redact"]


def configure(log_format: str = "console", level: str = "info") -> None:
    serverlog.configure(log_format, level)
    # transformers logs a warning per "useless token" and similar chatter from its engine thread.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def get_logger(name: str = "llmq.worker", **bound: Any) -> structlog.typing.FilteringBoundLogger:
    return serverlog.get_logger(name, **bound)
