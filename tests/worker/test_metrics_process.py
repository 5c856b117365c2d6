"""A worker's registry beyond its own series: the process collectors, no `_created` series, and the backlog
gauge's values where the fleet's rate is unknown."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from client.store import LaneStatus, QueueStatus
from testing.scripted_engine import ScriptedEngine
from worker.metrics import Metrics, backlog_seconds


def sample_names(metrics: Metrics) -> set[str]:
    text = generate_latest(metrics.registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_process_platform_and_gc_collectors_are_served() -> None:
    names = sample_names(Metrics(ScriptedEngine(), "default", "tiny"))
    expected = {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_start_time_seconds"}
    assert expected | {"process_open_fds", "python_info", "python_gc_collections_total"} <= names


def test_no_created_series_for_counters_or_histograms() -> None:
    metrics = Metrics(ScriptedEngine(), "default", "tiny")
    metrics.claims.inc()  # a labelled counter
    metrics.queue_time.observe(0.2)  # a labelled histogram
    metrics.preempted("batch")  # a counter with a lane
    names = sample_names(metrics)
    assert {"llmq:claims_total", "llmq:request_queue_time_seconds_count", "llmq:preemptions_total"} <= names
    assert not [name for name in names if name.endswith("_created")]
    assert "_created" not in generate_latest(metrics.registry).decode()


@pytest.mark.parametrize(
    ("depth", "estimate", "expected"),
    [(0, None, 0.0), (3, None, math.inf), (3, 12.5, 12.5), (0, 0.0, 0.0)],
)
def test_backlog_seconds(depth: int, estimate: float | None, expected: float) -> None:
    assert backlog_seconds(depth, estimate) == expected


def test_backlog_gauge_reads_inf_while_nothing_is_known_to_drain() -> None:
    metrics = Metrics(ScriptedEngine(), "default", "tiny")

    def lane(name: str, depth: int) -> LaneStatus:
        return LaneStatus(name, depth, 0, depth, None, backlog_tokens=40 * depth, backlog_seconds=None)

    metrics.set_queue(QueueStatus("default", 3, 0, 3, 0, lanes=[lane("interactive", 0), lane("batch", 3)]))
    text = generate_latest(metrics.registry).decode()
    values = {
        s.labels["lane"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llmq:backlog_seconds"
    }
    assert values == {"interactive": 0.0, "batch": math.inf}
    assert 'llmq:backlog_seconds{lane="batch",model_name="tiny",queue="default"} +Inf' in text
