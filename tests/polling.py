"""The one way tests wait for something to happen: poll a condition, never sleep a fixed time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def wait_until(predicate: Callable[[], Any], within_s: float = 10.0) -> None:
    """Polls `predicate` (sync, or returning an awaitable) until it is truthy; fails after `within_s`."""
    async with asyncio.timeout(within_s):
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            await asyncio.sleep(0.01)
