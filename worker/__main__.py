"""`llmq-worker` / `python -m worker`: one worker from `LLMQ_*` settings and command-line flags."""

from __future__ import annotations

import faulthandler
import signal
import sys

# `kill -USR1 <pid>` prints every thread's stack to stderr: how to see where a stuck worker is stuck.
faulthandler.register(signal.SIGUSR1, all_threads=True)

# Until the service installs its draining handler, a SIGTERM (say, compose scaling down a worker that is
# still importing torch) has nothing in flight to lose: leave at once, successfully.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

import asyncio  # noqa: E402 - after the handler, so a SIGTERM during these slow imports is caught

from worker.config import Settings  # noqa: E402
from worker.process import RedisUnavailable, serve  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=sys.argv[1:] if argv is None else argv)  # type: ignore[call-arg]
    try:
        asyncio.run(serve(settings))
    except RedisUnavailable as error:
        sys.exit(f"llmq-worker: {error}")


if __name__ == "__main__":
    main()
