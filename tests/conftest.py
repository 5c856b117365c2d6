from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_topologies import RedisClusterSet, SentinelSet
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


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterSet]:
    """A real Redis Cluster of its own (3 masters, 3 replicas, node timeout 1 s), for one test: faults change it."""
    with RedisClusterSet(tmp_path / "cluster") as cluster:
        yield cluster


@pytest.fixture
def sentinel_set(tmp_path: Path) -> Iterator[SentinelSet]:
    """A real master, replica and 3 sentinels of their own, for one test, with passwords on both."""
    with SentinelSet(tmp_path / "sentinel", password="data secret", sentinel_password="watch:secret") as sentinels:
        yield sentinels
