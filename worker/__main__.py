"""`llmq-worker` / `python -m worker`: one worker from `LLMQ_*` settings and command-line flags."""

from __future__ import annotations

import asyncio
import sys

from worker.config import Settings
from worker.service import RedisUnavailable, serve


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    try:
        asyncio.run(serve(settings))
    except RedisUnavailable as error:
        sys.exit(f"llmq-worker: {error}")


if __name__ == "__main__":
    main()
