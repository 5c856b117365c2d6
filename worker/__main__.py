"""`llmq-worker` / `python -m worker`: one worker from `LLMQ_*` settings and command-line flags."""

from __future__ import annotations

import asyncio
import sys

from worker.config import Settings
from worker.service import serve


def main(argv: list[str] | None = None) -> None:
    settings = Settings(_cli_parse_args=sys.argv[1:] if argv is None else argv)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
