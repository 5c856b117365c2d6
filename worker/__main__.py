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
import importlib.util  # noqa: E402

from client.errors import RedisUnavailable  # noqa: E402

# The `worker` extra's modules (pyproject.toml): when one is missing the command says what to install. A tuple,
# looked up in this order every run: what a run asks the import system for does not depend on string hashing.
EXTRA = ("accelerate", "gguf", "prometheus_client", "pydantic_settings", "structlog", "torch", "transformers")
ABOUT = (
    "Run one worker: it reads generation requests from a Redis queue, as many as its engine has free slots, and "
    "streams their tokens back. Start as many as you like on one Redis."
)
MISSING = "llmq-worker: the worker needs the 'worker' extra: pip install 'llmq-redis[worker]'"
EXITS = (
    "Exit status: 0 after a drain (SIGTERM) or for --help and --version; 1 when Redis cannot be used, the model "
    "does not load or the 'worker' extra is not installed; 2 for a bad flag or setting, or an engine sizing that "
    "does not fit in memory."
)


def extra_missing() -> bool:
    """Whether a module of the `worker` extra is not installed, found without importing it: the engine (torch,
    seconds) is imported only once Redis answers (worker.process). Every module is looked up, none skipped."""
    missing = [name for name in EXTRA if not _installed(name)]
    return bool(missing)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a finder that refuses it outright
        return False


def main(argv: list[str] | None = None) -> None:
    # The flags first, then the engine (torch), so `--help` and `--version` stay fast; without the extra, one line
    # says what to install instead of a traceback.
    try:
        from serverlog.cli import parse
        from worker.config import Settings

        settings = parse(Settings, sys.argv[1:] if argv is None else argv, description=ABOUT, exits=EXITS)
        from worker.process import CannotStart, serve
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in EXTRA:
            raise
        sys.exit(MISSING)
    if extra_missing():
        sys.exit(MISSING)
    try:
        asyncio.run(serve(settings))
    except RedisUnavailable as error:
        sys.exit(f"llmq-worker: {error}")
    except CannotStart as error:
        print(f"llmq-worker: {error}", file=sys.stderr)
        sys.exit(error.status)


if __name__ == "__main__":
    main()
