"""Fixtures running each client case on both twins (see `twins.py`) against the session's redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.client.twins import Twin, TwinFactory


@pytest.fixture(params=["async", "sync"])
async def make_twin(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[TwinFactory]:
    """Builds clients of the parametrized kind against the session's redis; closes them afterwards."""
    made: list[Twin] = []

    def make(**kwargs: Any) -> Twin:
        made.append(Twin(request.param, redis_url, **kwargs))
        return made[-1]

    yield make
    for twin in made:
        await twin.close()


@pytest.fixture
def twin(make_twin: TwinFactory) -> Twin:
    return make_twin()


@pytest.fixture
async def server(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """The test's own connection, for playing the worker and inspecting keys."""
    conn = aioredis.Redis.from_url(redis_url)
    yield conn
    await conn.aclose()
