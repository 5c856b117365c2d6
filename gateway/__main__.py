"""`llmq-gateway` / `python -m gateway`: the OpenAI-compatible HTTP gateway from `LLMQ_GATEWAY_*` settings and
command-line flags, served by uvicorn (https when `--ssl-certfile` and `--ssl-keyfile` are given)."""

from __future__ import annotations

import sys

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings
from worker.logging import configure


def main(argv: list[str] | None = None) -> None:
    settings = GatewaySettings(_cli_parse_args=sys.argv[1:] if argv is None else argv)  # type: ignore[call-arg]
    if not settings.queue_names:
        sys.exit("llmq-gateway: --queues names no queue")
    configure(settings.log_format, settings.log_level)
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
