"""How a worker's helper loops wait: on the worker's `finished` flag, never by cancellation (a redis-py call
cancelled mid-reply can surface as another error, and leaves its connection out of step)."""

from __future__ import annotations

import asyncio
import contextlib


async def pause(finished: asyncio.Event, seconds: float) -> bool:
    """Sleeps, but wakes when the worker finishes; True while the loop should go on."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await finished.wait()
    return not finished.is_set()
