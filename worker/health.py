"""Container health check: `python -m worker.health` exits 0 while the worker is healthy.

The worker touches its health file after each heartbeat that reached Redis, and only while its engine
thread runs; a file older than three heartbeats means Redis is unreachable, the engine is dead, or the
event loop is stuck.
"""

from __future__ import annotations

import sys
import time

from worker.config import Settings


def check(settings: Settings) -> str | None:
    """The reason the worker is unhealthy, or None."""
    try:
        last_ms = int(settings.health_file.read_text())
    except (OSError, ValueError):
        return f"no heartbeat recorded in {settings.health_file}"
    age_s = time.time() - last_ms / 1000
    limit_s = max(3 * settings.heartbeat_s, 5.0)
    if age_s > limit_s:
        return f"last healthy heartbeat {age_s:.0f} s ago (limit {limit_s:.0f} s): Redis or the engine is down"
    return None


def main() -> None:
    problem = check(Settings(_cli_parse_args=False))  # type: ignore[call-arg]  # pydantic-settings' init options
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
