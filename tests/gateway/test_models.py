"""The gateway's model directory (which model is served on which queue) shares one refresh among the requests
that need it: concurrent callers make one status round trip and get one answer, or one error, at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from client.protocol import WorkerInfo
from gateway.models import ModelDirectory


class SlowStatus:
    """A client whose status call takes `delay_s` and then answers one live worker, or raises `error`."""

    def __init__(self, delay_s: float, error: Exception | None = None) -> None:
        self.delay_s, self.error, self.calls, self.live = delay_s, error, 0, True

    async def status(self, *, queue: str, stale_after_s: float) -> Any:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        workers = [WorkerInfo.model_construct(model="tiny", started=5_000)] if self.live else []
        return type("Status", (), {"workers": workers})()


def directory(client: SlowStatus) -> ModelDirectory:
    return ModelDirectory(client, ["default"], stale_s=15.0, refresh_s=60.0)  # type: ignore[arg-type]


async def test_concurrent_callers_share_one_refresh() -> None:
    client = SlowStatus(0.2)
    models = directory(client)
    answers = await asyncio.gather(*(models.served() for _ in range(5)))
    assert client.calls == 1
    assert all(answer == answers[0] for answer in answers) and answers[0]["tiny"].queue == "default"
    assert await models.queue_of("tiny") == "default" and client.calls == 1  # fresh: no new round trip


async def test_a_failed_refresh_reaches_every_waiting_caller_at_once_and_the_next_one_retries() -> None:
    client = SlowStatus(0.2, ConnectionError("Redis is away"))
    models = directory(client)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(*(models.served() for _ in range(3)), return_exceptions=True)
    assert all(isinstance(result, ConnectionError) for result in results)
    assert loop.time() - started < 0.2 * 2  # one window for all of them, not one after another
    client.error = None
    assert "tiny" in await models.served() and client.calls == 2


async def test_a_caller_that_goes_away_leaves_the_refresh_to_the_others() -> None:
    client = SlowStatus(0.2)
    models = directory(client)
    leaving = asyncio.ensure_future(models.served())
    staying = asyncio.ensure_future(models.served())
    await asyncio.sleep(0.05)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert "tiny" in await staying and client.calls == 1


async def test_no_live_worker_is_not_kept_so_the_first_worker_is_listed_at_once() -> None:
    """A gateway started before its workers (or asked between two of them) would otherwise answer 'no such
    model' for `refresh_s` after the first worker's heartbeat: an empty map is read again on the next request."""
    client = SlowStatus(0.0)
    client.live = False
    models = directory(client)
    assert await models.served() == {} and await models.queue_of("tiny") is None
    assert client.calls == 2  # not kept: each request read again
    client.live = True
    assert await models.queue_of("tiny") == "default" and client.calls == 3
    assert await models.queue_of("tiny") == "default" and client.calls == 3  # a live map is kept
