"""The Prometheus registry both servers start from: a private one (each app its own, so several in one process
do not collide), carrying prometheus_client's process (`process_*`: CPU, RSS, open fds, start time), platform
(`python_info`) and GC (`python_gc_*`) collectors, which a private registry lacks by default, and no `_created`
series (they double the series count and no dashboard reads them)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)


def server_registry() -> CollectorRegistry:
    """A new registry with the process, platform and GC collectors; turns `_created` series off process-wide
    (one process serves one set of metrics)."""
    disable_created_metrics()
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
