"""`llmq-gateway` / `python -m gateway`: the OpenAI-compatible HTTP gateway from `LLMQ_GATEWAY_*` settings and
command-line flags, served by uvicorn (https when `--ssl-certfile` and `--ssl-keyfile` are given)."""

from __future__ import annotations

import signal
import sys
from types import FrameType

# The `gateway` extra's modules (pyproject.toml): when one is missing the command says what to install.
EXTRA = frozenset({"starlette", "uvicorn", "pydantic_settings", "structlog", "prometheus_client"})
MISSING = "llmq-gateway: the gateway needs the 'gateway' extra: pip install 'llmq-redis[gateway]'"
ABOUT = (
    "Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /v1/files, "
    "/v1/batches) in front of the workers' Redis queues."
)
EXITS = (
    "Exit status: 0 after a clean stop (SIGTERM, Ctrl-C) or for --help and --version; 1 when --queues names no "
    "queue or the 'gateway' extra is not installed; 2 for a bad flag or setting."
)


def exit_cleanly(signum: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the SIGTERM or SIGINT it stopped for once it has shut down, under the handler it found
    at start: this one exits through Python (status 0) instead of dying of the signal, so the exit hooks run,
    the tracing SDK's flush of the spans still batched among them."""
    sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    # The flags first, then Starlette and uvicorn, so `--help` and `--version` load neither; without the extra,
    # one line says what to install instead of a traceback.
    try:
        from gateway.settings import GatewaySettings
        from serverlog.cli import parse

        settings = parse(GatewaySettings, sys.argv[1:] if argv is None else argv, description=ABOUT, exits=EXITS)
        import uvicorn

        from gateway.app import create_app
        from serverlog import configure
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in EXTRA:
            raise
        sys.exit(MISSING)
    if not settings.queue_names:
        sys.exit("llmq-gateway: --queues names no queue")
    configure(settings.log_format, settings.log_level)
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, exit_cleanly)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        log_level=settings.log_level,
        access_log=False,  # the gateway logs one line per request itself
        timeout_graceful_shutdown=30,
    )


if __name__ == "__main__":
    main()
