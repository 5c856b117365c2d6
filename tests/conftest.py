from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.redis_topologies import RedisClusterSet, SentinelSet
from worker.embedded_redis import RedisServer

# `make test` runs up to three test processes on two cores, each with engines (in-process or worker processes it
# starts) of two OpenMP threads. libgomp's default wait spins at every barrier, burning the CPU the other processes
# need: tests/engine's Redis/engine tests took 4:30 that way and 2:20 with passive waits (same machine, back to
# back, outputs unchanged: the wait policy changes no sum's order). A worker in production owns its cores and keeps
# the default. Set here, before any test imports torch (libgomp reads it once, as it loads); the test processes and
# the processes they start with the inherited environment (all but a few deploy tests' own) get it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Tiers follow from what a test uses, so no file has to remember its marker: `make test-fast` runs `unit`.
_REDIS_FIXTURES = {"redis_server", "redis_cluster", "sentinel_set"}  # real redis-server processes
_MODEL_FIXTURES = {"tiny_model_dir", "llama_dir", "model_dir", "make_engine", "live"}  # a model on disk, an engine
_NOT_UNIT = ("redis", "model", "slow", "gpu")
# Tests whose timing is the point run after the others, in two groups. The Redis Cluster sets and Sentinel
# failovers (marker `topology`) mostly wait on Redis' timers, about a quarter of two cores: `make test` runs them four
# at a time (one port band each). The kill -9 harnesses of worker processes (marker `harness`) keep both cores busy:
# they run alone.
_TOPOLOGY_FOLDERS = {"topologies"}
_TOPOLOGY_FIXTURES = {"redis_cluster", "sentinel_set"}
_TOPOLOGY_NAMES = {"RedisClusterSet", "SentinelSet"}  # a set started in the test's own body
_HARNESS_FOLDERS = {"faults"}
_HARNESS_FIXTURES = {"cluster"}  # worker processes to kill (e2e)


def _topology(item: pytest.Item, used: set[str]) -> bool:
    if _TOPOLOGY_FOLDERS & set(item.path.parts) or used & _TOPOLOGY_FIXTURES:
        return True
    function = getattr(item, "function", None)
    code = getattr(function, "__code__", None)
    return code is not None and bool(_TOPOLOGY_NAMES & set(code.co_names))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & _REDIS_FIXTURES:
            item.add_marker(pytest.mark.redis)
        if used & _MODEL_FIXTURES:
            item.add_marker(pytest.mark.model)
        if _HARNESS_FOLDERS & set(item.path.parts) or used & _HARNESS_FIXTURES:
            item.add_marker(pytest.mark.harness)
        elif _topology(item, used):
            item.add_marker(pytest.mark.topology)
        if not any(item.get_closest_marker(name) for name in _NOT_UNIT):
            item.add_marker(pytest.mark.unit)


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
