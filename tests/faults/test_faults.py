"""The promise: a request that was accepted is answered, as one stream with no gap and no duplicate,
whatever happens to the worker generating it (and to Redis, restarted with its AOF)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.tenants import TenantLimits
from testing.fault_cluster import Cluster, FaultReport, run_faults
from testing.tiny_models import save_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("faults-model"), "llama", max_positions=512)


@pytest.fixture
def cluster(tmp_path: Path, model_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, model_dir)
    for name in ("w0", "w1", "w2"):
        cluster.start_worker(name)
    yield cluster
    cluster.close()


def assert_nothing_lost(report: FaultReport) -> None:
    assert report.lost == 0 and report.completed == report.requests, report
    assert report.gaps == report.duplicates == report.wrong_outputs == 0, report
    assert report.requests_left == 0 and report.unbounded_keys == 0, report
    assert all(code == 0 for code in report.exit_codes.values()), report.exit_codes


def test_kill_9_workers_while_they_stream(cluster: Cluster) -> None:
    report = asyncio.run(run_faults(cluster, requests=40, faults=["kill", "kill", "kill"], malformed=0, seed=1))
    assert report.kills == 3
    assert_nothing_lost(report)


def test_kill_9_the_holders_of_shared_prompt_starts(cluster: Cluster) -> None:
    """Cache affinity under faults: three prompt starts, one held by each worker, and holders killed mid-burst;
    what waited for a dead holder is taken by another, nothing is lost or answered twice."""
    faults = run_faults(cluster, requests=48, faults=["kill", "kill"], malformed=0, seed=6, shared_starts=3)
    report = asyncio.run(faults)
    assert report.kills == 2
    assert 1 <= report.held_keys <= 3, report
    assert_nothing_lost(report)


@pytest.mark.parametrize("kept", [0, 2], ids=["every slot open", "kept slots"])
def test_kill_9_workers_under_tenant_quotas(tmp_path: Path, model_dir: Path, kept: int) -> None:
    """Tenants under quotas through kill -9s: every request answered once, each counted once in the tenants'
    usage, and no queued or running count left over (a killed worker's requests resume under the same count).
    With kept slots too, whose claims and moves take other paths."""
    cluster = Cluster(tmp_path, model_dir, flags={"--idle-tenant-slots": kept})
    for name in ("w0", "w1", "w2"):
        cluster.start_worker(name)
    try:
        check_tenants_through_kills(cluster)
    finally:
        cluster.close()


def check_tenants_through_kills(cluster: Cluster) -> None:
    tenants = {
        "capped": TenantLimits(max_running=2),
        "rated": TenantLimits(tokens_per_minute=3000),
        "free": TenantLimits(),
    }
    report = asyncio.run(
        run_faults(cluster, requests=36, faults=["kill", "kill"], malformed=0, seed=7, tenants=tenants)
    )
    assert report.kills == 2
    assert_nothing_lost(report)
    assert report.usage_requests == report.requests and report.usage_generated == report.generated > 0, report
    assert report.quota_state_left == {}, report


def test_paused_worker_cannot_write_after_its_lease(cluster: Cluster) -> None:
    report = asyncio.run(run_faults(cluster, requests=30, faults=["stop"], malformed=0, seed=2))
    assert report.stops == 1
    assert_nothing_lost(report)


def test_sigterm_during_load_drains_or_hands_back(cluster: Cluster) -> None:
    report = asyncio.run(run_faults(cluster, requests=30, faults=["term", "term"], malformed=0, seed=3))
    assert report.terms == 2
    assert_nothing_lost(report)


def test_redis_restart_during_load(cluster: Cluster) -> None:
    report = asyncio.run(run_faults(cluster, requests=30, faults=["redis"], malformed=0, seed=4))
    assert report.redis_restarts == 1
    assert_nothing_lost(report)


def test_malformed_entries_among_valid_requests(cluster: Cluster) -> None:
    report = asyncio.run(run_faults(cluster, requests=30, faults=[], malformed=1000, seed=5))
    assert len(cluster.alive()) == 0  # all stopped cleanly at the end (exit codes checked below)
    assert 0 < report.dead_letters <= 10_000
    assert_nothing_lost(report)
