"""`bench/capacity.py`: its arithmetic, and a `--quick` run end to end (a real redis-server, two worker
processes) whose JSON line must hold sane figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.capacity import SCRIPTED, SHAPES, SHARDS, Usage, capacity_table, fit

ROOT = Path(__file__).resolve().parents[2]


def usage(seconds: float, calls: dict[str, float], cpu_us: float) -> Usage:
    return Usage(seconds, calls, {name: 2 * n for name, n in calls.items()}, cpu_us, cpu_us, cpu_us, 100 * seconds)


def test_fit_is_the_line_through_the_shortest_and_longest_runs() -> None:
    assert fit({1: 25.0, 16: 100.0, 128: 660.0}) == pytest.approx((20.0, 5.0))
    assert fit({128: 660.0, 1: 25.0}) == pytest.approx((20.0, 5.0))


def test_capacity_table_is_one_shard_at_a_full_core_times_the_shards() -> None:
    rows = capacity_table(100.0, 20.0)
    assert [(row["tokens_per_request"], row["shards"]) for row in rows] == [(t, p) for t in SHAPES for p in SHARDS]
    for row in rows:
        per_shard = 1e6 / (100.0 + 20.0 * row["tokens_per_request"])
        assert row["requests_per_s"] == round(row["shards"] * per_shard)
        assert row["tokens_per_s"] == round(row["shards"] * per_shard * row["tokens_per_request"])


def test_the_idle_fleets_share_is_scaled_to_the_window_and_never_below_zero() -> None:
    idle = usage(2.0, {"hset": 10.0, "xautoclaim": 6.0}, 1000.0)
    run = usage(4.0, {"hset": 50.0, "evalsha": 7.0, "xautoclaim": 3.0}, 9000.0).minus(idle)
    assert run.calls == {"hset": 30.0, "evalsha": 7.0, "xautoclaim": 0.0}
    assert run.usec == {"hset": 60.0, "evalsha": 14.0, "xautoclaim": 0.0}
    assert run.cpu_us == 7000.0 and run.seconds == 4.0 and run.net_bytes == 0.0


def test_the_commands_scripts_run_are_found_in_the_scripts() -> None:
    assert {"xadd", "hmget", "xack", "xreadgroup", "xclaim"} <= SCRIPTED
    assert not {"evalsha", "xread", "xautoclaim", "hgetall"} & SCRIPTED


@pytest.mark.slow
@pytest.mark.redis
def test_quick_run_reports_sane_figures() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.capacity", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["complete"] == figures["expected"] > 0
    assert 5 < figures["commands_per_request"] < 100
    assert 1 < figures["commands_per_token"] < 20
    assert figures["redis_cpu_us_per_request"] > 0 and figures["redis_cpu_us_per_token"] > 0
    assert figures["commandstats_usec_per_token"] > 0
    assert figures["shard_tokens_per_s"] > figures["shard_requests_per_s"] > 0
    assert figures["idle_commands_per_s_per_worker"] > 0
    (step,) = figures["by_step"]
    assert {"evalsha", "xadd", "xack"} <= set(step["by_command"])
    longest = step["runs"][-1]
    assert longest["events_per_flush"] > 4  # a flush carries an engine step's events, not one each
    assert 0 < longest["redis_cpu_share"] < 1
    rows = {(row["tokens_per_request"], row["shards"]): row for row in figures["capacity_projection"]}
    for tokens in SHAPES:
        one = rows[tokens, 1]["tokens_per_s"]
        assert one > 0
        assert rows[tokens, SHARDS[-1]]["tokens_per_s"] == pytest.approx(SHARDS[-1] * one, rel=0.01)
