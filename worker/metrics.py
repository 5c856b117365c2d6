"""Prometheus metrics of one worker, named in vLLM's style (`llmq:` for `vllm:`), labelled by queue and model
only (nothing unbounded: no request ids). `docs/operations/metrics.md` lists each with its meaning.

Engine gauges and counters are read from `Engine.stats()` at scrape time (a custom collector), so they are
never stale; latencies are observed as requests progress; batch fill and tokens per step are observed by the
engine thread after every step; queue depth, pending and lag are refreshed with each heartbeat. The registry also
carries prometheus_client's process, platform and GC collectors (`process_*`, `python_*`), and no `_created`
series.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from client.store import QueueStatus
from serverlog.metrics import server_registry
from worker.engine.interface import GenerationEngine
from worker.engine.types import Step
from worker.publisher import PublisherStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_FILL_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# vLLM's request_latency_buckets (prefill, decode and inference time per request)
_REQUEST_TIME_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
# vLLM's build_1_2_5_buckets, here up to 100k tokens (vLLM stops at max_model_len, which a worker's metrics
# do not know before the model loads)
_REQUEST_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5) if m * 10**e <= 100_000)
# vLLM's iteration_tokens_total buckets (tokens per engine step)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector(Collector):
    """Engine state at scrape time."""

    def __init__(self, engine: GenerationEngine, labels: dict[str, str]) -> None:
        self._engine = engine
        self._labels = labels

    def collect(self) -> Iterator[Any]:
        stats = self._engine.stats()
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("llmq:num_requests_running", "Requests in the engine's batch.", stats.running)
        yield gauge("llmq:num_requests_waiting", "Requests accepted but waiting for KV blocks.", stats.waiting)
        yield gauge("llmq:kv_cache_usage_perc", "KV cache blocks in use, 0 to 1.", stats.kv_usage)
        yield gauge("llmq:kv_cache_blocks_total", "KV cache size in blocks.", stats.kv_blocks_total)
        yield gauge(
            "llmq:kv_cache_blocks_reserved",
            "KV blocks reserved for admitted requests' worst case.",
            stats.kv_blocks_reserved,
        )
        yield counter("llmq:prompt_tokens", "Prompt tokens run through a forward pass.", stats.prefill_tokens)
        yield counter(
            "llmq:generation_tokens",
            "Tokens generated, every one (a request's first comes from its prefill step).",
            stats.generation_tokens,
        )
        if stats.prefix_cache_queries is not None:  # only where prefix sharing is on: no made-up zeros
            yield counter(
                "llmq:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
            )
            yield counter(
                "llmq:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits or 0
            )
        yield counter("llmq:engine_steps", "Forward steps run.", stats.steps)
        yield counter("llmq:engine_restarts", "Times the engine thread died and was restarted.", stats.restarts)
        finished = CounterMetricFamily(
            "llmq:request_success",
            "Requests finished in the engine, by finish reason.",
            labels=[*names, "finished_reason"],
        )
        for reason, count in sorted(stats.requests_finished.items()):
            finished.add_metric([*values, reason], count)
        yield finished
        if stats.paths:
            paths = GaugeMetricFamily(
                "llmq:engine_path",
                "1 for the implementation that runs each part of an engine step (kernel: compiled or fallback for "
                "the native CPU kernels).",
                labels=[*names, "component", "kernel"],
            )
            for component, kernel in sorted(stats.paths.items()):
                paths.add_metric([*values, component, kernel], 1)
            yield paths


class _PublisherCollector(Collector):
    """The publisher's counters at scrape time."""

    def __init__(self, stats: PublisherStats, labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Any]:
        stats, names, values = self._stats, list(self._labels), list(self._labels.values())
        for name, doc, value in (
            ("llmq:result_flushes", "Script calls that wrote result events (one per flush).", stats.flushes),
            ("llmq:result_events", "Result events written (token chunks and terminal events).", stats.events),
            ("llmq:result_write_failures", "Flushes Redis failed as a whole (retried).", stats.failures),
            ("llmq:fenced_writes", "Requests whose writes were refused: another attempt owns them.", stats.fenced),
            ("llmq:refused_requests", "Requests whose result keys Redis refused (dead-lettered).", stats.refused),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        requests = CounterMetricFamily(
            "llmq:tenant_requests",
            "Requests this worker ended, by tenant and outcome (a finish reason, or error:<code>); `llmq usage` "
            "counts the fleet's exactly, in Redis.",
            labels=[*names, "tenant", "outcome"],
        )
        for (tenant, outcome), count in sorted(stats.tenant_requests.items()):
            requests.add_metric([*values, tenant, outcome], count)
        yield requests
        tokens = CounterMetricFamily(
            "llmq:tenant_tokens",
            "Prompt and generated tokens of the requests this worker ended, by tenant and kind.",
            labels=[*names, "tenant", "kind"],
        )
        for (tenant, kind), count in sorted(stats.tenant_tokens.items()):
            tokens.add_metric([*values, tenant, kind], count)
        yield tokens


class _AffinityCollector(Collector):
    """Cache affinity's moves at scrape time, summed over the partitions' intakes (`Intake.routed`)."""

    def __init__(self, counts: Callable[[], Mapping[str, int]], labels: dict[str, str]) -> None:
        self._counts = counts
        self._labels = labels

    def collect(self) -> Iterator[Any]:
        counts, names, values = self._counts(), list(self._labels), list(self._labels.values())
        family = CounterMetricFamily(
            "llmq:affinity_entries",
            "Entries moved by cache affinity: assigned (read here, given to the worker that holds its prefix), taken "
            "(given to this worker), stolen (given to another that did not take it within the wait) or overflow (run "
            "here although another worker holds its prefix: that worker's queue was full).",
            labels=[*names, "outcome"],
        )
        for outcome in ("assigned", "taken", "stolen", "overflow"):
            family.add_metric([*values, outcome], counts.get(outcome, 0))
        yield family


class Metrics:
    """A worker's metrics in a registry of its own (several workers can share a process in tests)."""

    def __init__(self, engine: GenerationEngine, queue: str, model: str) -> None:
        self.registry = server_registry()
        labels = {"queue": queue, "model_name": model}
        names = list(labels)
        self._labels = labels

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        self.time_to_first_token = histogram(
            "llmq:time_to_first_token_seconds", "From submission to the first token published.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "llmq:inter_token_latency_seconds", "Time between consecutive tokens of a request.", _TOKEN_LATENCY_BUCKETS
        )
        self.e2e_latency = histogram(
            "llmq:e2e_request_latency_seconds", "From submission to the final event.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "llmq:request_queue_time_seconds", "From submission to the start of generation.", _LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "llmq:request_prompt_tokens", "Prompt tokens of each finished request.", _REQUEST_TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "llmq:request_generation_tokens", "Tokens generated by each finished request.", _REQUEST_TOKEN_BUCKETS
        )
        self.request_prefill_time = histogram(
            "llmq:request_prefill_time_seconds",
            "From a request's admission to the engine to its first token.",
            _REQUEST_TIME_BUCKETS,
        )
        self.request_decode_time = histogram(
            "llmq:request_decode_time_seconds", "From a request's first token to its finish.", _REQUEST_TIME_BUCKETS
        )
        self.request_inference_time = histogram(
            "llmq:request_inference_time_seconds",
            "From a request's admission to the engine to its finish (prefill + decode).",
            _REQUEST_TIME_BUCKETS,
        )
        self.batch_fill = histogram(
            "llmq:batch_fill_ratio", "Tokens per engine step over max_batch_tokens.", _FILL_BUCKETS
        )
        self.iteration_tokens = histogram(
            "llmq:iteration_tokens_total",
            "Tokens per engine step: the prompt tokens it ran plus the tokens it generated (vLLM's meaning).",
            _ITERATION_TOKEN_BUCKETS,
        )
        self.claims = counter("llmq:claims", "Requests claimed from workers that died or handed them back.")
        self.dead_letters = counter("llmq:dead_letters", "Entries moved to the dead-letter stream.")
        self.quarantined = counter(
            "llmq:requests_quarantined", "Requests quarantined after repeated engine failures (poison_request)."
        )

        def per_lane(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, [*names, "lane"], registry=self.registry)

        self.queue_depth = per_lane("llmq:queue_depth", "Entries in the lane's request stream (unfinished work).")
        self.queue_pending = per_lane("llmq:queue_pending", "Entries delivered to a worker and not yet acknowledged.")
        self.queue_lag = per_lane("llmq:queue_lag", "Entries not yet delivered to any worker.")
        self.oldest_pending = per_lane("llmq:queue_oldest_pending_seconds", "Age of the oldest delivered request.")
        self.backlog_requests = per_lane("llmq:backlog_requests", "Requests waiting or running in the lane.")
        self.backlog_tokens = per_lane(
            "llmq:backlog_tokens", "Prompt + max_new_tokens of the lane's requests (estimated from a sample)."
        )
        self.backlog_seconds = per_lane(
            "llmq:backlog_seconds",
            "The lane's backlog tokens over the fleet's measured tokens/s (0: no backlog; +Inf: backlog, no rate).",
        )
        self.preemptions = Counter(
            "llmq:preemptions",
            "Requests handed back to make room for interactive ones.",
            [*names, "lane"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine, labels))
        max_batch_tokens = engine.stats().max_batch_tokens

        def observe_step(step: Step) -> None:
            self.batch_fill.observe(step.tokens / max_batch_tokens)
            self.iteration_tokens.observe(step.iteration_tokens)

        engine.observe_steps(observe_step)

    def watch_publisher(self, stats: PublisherStats) -> None:
        self.registry.register(_PublisherCollector(stats, self._labels))

    def watch_affinity(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(_AffinityCollector(counts, self._labels))

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serves `/metrics` over HTTP from a daemon thread."""
        start_http_server(port, addr=address, registry=self.registry)

    def preempted(self, lane: str) -> None:
        self.preemptions.labels(**self._labels, lane=lane).inc()

    def set_queue(self, status: QueueStatus) -> None:
        for lane in status.lanes:
            labels = {**self._labels, "lane": lane.lane}
            self.queue_depth.labels(**labels).set(lane.depth)
            self.queue_pending.labels(**labels).set(lane.pending or 0)
            self.queue_lag.labels(**labels).set(lane.lag or 0)
            self.oldest_pending.labels(**labels).set(lane.oldest_pending_age_s or 0)
            self.backlog_requests.labels(**labels).set(lane.depth)
            self.backlog_tokens.labels(**labels).set(lane.backlog_tokens)
            self.backlog_seconds.labels(**labels).set(backlog_seconds(lane.depth, lane.backlog_seconds))


def backlog_seconds(depth: int, seconds: float | None) -> float:
    """The gauge's value: the estimate where the fleet's rate is known, else 0 for an empty lane and +Inf for one
    with requests that nothing is known to drain (so an alert on `> threshold` fires)."""
    if seconds is not None:
        return seconds
    return 0.0 if depth == 0 else math.inf
