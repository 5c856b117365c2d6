"""A worker's heartbeat: its stats in `{<queue>}:workers` for `llmq status`, the health file, the queue gauges,
and pruning of heartbeats left by workers gone for long. Runs until the worker finishes, draining included."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

from redis.asyncio import Redis
from structlog.typing import FilteringBoundLogger

from client.protocol import PrefixCacheInfo, WorkerInfo, encode, ms_now
from client.store import Keys, queue_status_commands, status_from_replies
from worker.config import Settings
from worker.engine import GenerationEngine
from worker.logging import redact
from worker.metrics import Metrics
from worker.pausing import pause

_STALE_WORKER_S = 10 * 60  # heartbeats older than this are pruned from the workers hash


class Heartbeat:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        settings: Settings,
        engine: GenerationEngine,
        metrics: Metrics,
        tokens_generated: Callable[[], int],
        log: FilteringBoundLogger,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._settings = settings
        self._engine = engine
        self._metrics = metrics
        self._tokens_generated = tokens_generated
        self._log = log
        self.started_ms = ms_now()
        self._seen: dict[str, tuple[int, int]] = {}  # worker id -> (tokens generated, heartbeat ms) last seen
        self._rates: dict[str, float] = {}  # worker id -> tokens/s between its last two heartbeats, smoothed

    async def run(self, finished: asyncio.Event) -> None:
        while not finished.is_set():
            try:
                await self._redis.hset(self._keys.workers, self._settings.worker_id, encode(self.info()))
                cache = self.prefix_cache()
                if cache is not None:
                    await self._redis.hset(self._keys.prefix_caches, self._settings.worker_id, encode(cache))
                if self._engine.alive:  # the container health check reads this file's age
                    self._settings.health_file.write_text(str(ms_now()))
                await self._report_queue()
            except Exception as error:
                self._log.warning("heartbeat failed", error=redact(str(error)))
            await pause(finished, self._settings.heartbeat_s)

    async def _report_queue(self) -> None:
        """Queue gauges for the metrics, and pruning: heartbeats of workers gone for long leave the hash."""
        pipe = self._redis.pipeline(transaction=False)
        queue_status_commands(pipe, self._keys, self._settings.queue_partitions)
        replies = await pipe.execute(raise_on_error=False)
        status = status_from_replies(self._keys.queue, replies, stale_after_s=_STALE_WORKER_S)
        self._metrics.set_queue(status)
        if status.stale_workers:
            await self._redis.hdel(self._keys.workers, *status.stale_workers)
            await self._redis.hdel(self._keys.prefix_caches, *status.stale_workers)
        rate = self._measure_fleet_rate(status.workers)
        if rate is not None:
            ttl = max(10, int(5 * self._settings.heartbeat_s))
            await self._redis.set(self._keys.fleet_rate, f"{rate:.3f}", ex=ttl)
        await self._bound_tenants()

    async def _bound_tenants(self) -> None:
        """The bound on tenants (`LLMQ_MAX_TENANTS`) where the submit script reads it, in every partition, for as
        long as workers beat: the last worker to write wins, so set it the same on every worker."""
        ttl = max(30, int(10 * self._settings.heartbeat_s))
        for keys in self._keys.partitioned(self._settings.queue_partitions):
            await self._redis.set(keys.tenants_max, self._settings.max_tenants, ex=ttl)

    def _measure_fleet_rate(self, workers: list[WorkerInfo]) -> float | None:
        """The live workers' tokens per second (each between its last two heartbeats we saw, smoothed), summed;
        the backlog gauges divide by it. Every worker measures the same fleet: the last to write wins."""
        recent = ms_now() - int(3 * self._settings.heartbeat_s * 1000)
        seen, rates = {}, {}  # only the workers in this status: restarted workers' ids do not pile up
        for worker in workers:
            before, last = self._seen.get(worker.id), self._rates.get(worker.id)
            if before is not None and worker.heartbeat > before[1]:
                rate = 1000 * max(0, worker.tokens_generated - before[0]) / (worker.heartbeat - before[1])
                last = rate if last is None else 0.5 * last + 0.5 * rate
            if last is not None:
                rates[worker.id] = last
            seen[worker.id] = (worker.tokens_generated, worker.heartbeat)
        self._seen, self._rates = seen, rates
        live = [rates[w.id] for w in workers if w.heartbeat >= recent and w.id in rates]
        return sum(live) if live else None

    def prefix_cache(self) -> PrefixCacheInfo | None:
        """Its prefix cache's counters (None where it has none), beside the heartbeat (`PrefixCacheInfo`)."""
        stats = self._engine.stats()
        if stats.prefix_cache_queries is None:
            return None
        return PrefixCacheInfo(queries=stats.prefix_cache_queries, hits=stats.prefix_cache_hits or 0)

    def info(self) -> WorkerInfo:
        stats = self._engine.stats()
        return WorkerInfo(
            id=self._settings.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            queue=self._settings.queue,
            model=self._settings.model,
            running=stats.running,
            waiting=stats.waiting,
            kv_used_blocks=stats.kv_blocks_used,
            kv_total_blocks=stats.kv_blocks_total,
            tokens_generated=self._tokens_generated(),
            started=self.started_ms,
            heartbeat=ms_now(),
        )
