from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.embedded_redis import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's own redis-server, emptied before each test."""
    redis_server.flush()
    return redis_server.url
