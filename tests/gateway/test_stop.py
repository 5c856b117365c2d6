"""The gateway's stop is bounded: a step of its lifespan's stop that hangs is logged and left behind, so a SIGTERM
ends the process however a batch task or a connection misbehaves."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway import app as gateway_app
from gateway.app import create_app
from gateway.settings import GatewaySettings


async def test_a_batch_driver_that_will_not_stop_holds_the_stop_no_longer_than_a_step(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def stubborn(self: Any) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # a task that swallows its cancellation

    monkeypatch.setattr(gateway_app.BatchDriver, "run_forever", stubborn)
    monkeypatch.setattr(gateway_app, "STOP_STEP_S", 0.5)
    app = create_app(GatewaySettings(_env_file=None, redis_url=redis_url))  # type: ignore[call-arg]
    async with app.router.lifespan_context(app):
        started = time.monotonic()
    assert time.monotonic() - started < 3  # a step's bound, then the connections closed
