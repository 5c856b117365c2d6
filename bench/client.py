"""One client awaiting many jobs: the multiplexed reader (one `AsyncClient`, at most 4 connections) against
the previous design (one blocking XREAD, so one connection, per awaited job), side by side in one run, on
scripted-engine workers (`testing/scripted_engine.py`), so the client and Redis are what is measured.

    python -m bench.client [--quick] [--jobs 10000] [--baseline-jobs 2000] [--tokens 8]

Delivery lag is the time from the worker's write (the entry id's milliseconds, Redis' clock) to the client
yielding the delta (this host's clock; same machine). Targets: completed == jobs, connections_max <= 4,
ratio_events >= 1.0, delivery_lag_p99_ms <= 50. The longest pause of Python's cyclic garbage collector in
the bench process is printed too (`gc_pause_max_ms`): with 10,000 jobs awaited, a full collection walks
every live task, and the lag's tail is mostly those pauses; so the 10,000 jobs run again with `gc.freeze()`
once they are followed (`delivery_lag_p99_ms_gc_frozen`), as a long-running service freezes its start-up heap.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis

from bench.fabric import with_workers
from bench.workload import percentile, print_json
from client import AsyncClient
from client._core import ResultReader
from client._mux import parse_id
from client.protocol import ms_now
from client.store import Keys
from worker.embedded_redis import RedisServer

KEYS = Keys("default")
STEP_S = 0.02
WORKERS, SLOTS = 2, 64


class GcPauses:
    """The longest pause of the cyclic garbage collector (any generation) while installed."""

    def __init__(self) -> None:
        self.longest_ms, self._started = 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.longest_ms = max(self.longest_ms, (time.perf_counter() - self._started) * 1000)


class Sampler:
    """The most connections named `name` that `CLIENT LIST` showed while the phase ran."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name, self.most = url, name, 0

    async def run(self, stop: asyncio.Event) -> None:
        async with Redis.from_url(self.url) as redis:
            while not stop.is_set():
                clients = await redis.client_list()
                self.most = max(self.most, sum(1 for c in clients if c.get("name") == self.name))
                await asyncio.sleep(0.05)


async def phase(
    url: str, root: Path, jobs: int, tokens: int, multiplexed: bool, freeze: bool = False
) -> dict[str, Any]:
    """Submits `jobs` jobs and starts reading every one of them, then starts the workers: all jobs are awaited
    at once. Events per second count from the workers' start to the last job's end. `freeze`: `gc.freeze()`
    once every job is followed, as a service does after its start-up, so collections skip that heap."""
    name = "bench-mux" if multiplexed else "bench-per-job"
    lags: list[float] = []  # per delivered delta; its first one starts the clock (workers start slowly)
    first: list[float] = []
    stop = asyncio.Event()
    sampler = Sampler(url, name)
    sampling = asyncio.create_task(sampler.run(stop))
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    async with AsyncClient(url, max_queue_len=0, client_name=name) as client:
        submitted = [await client.submit(input_ids=[1 + i % 300], max_new_tokens=tokens) for i in range(jobs)]
        if multiplexed:

            async def read(job: Any) -> int:
                count = 0
                async for _ in job.stream(timeout=600):
                    if not first:
                        first.append(time.perf_counter())
                    lags.append(ms_now() - parse_id(job._reader.last_id)[0])
                    count += 1
                return count + 1  # the terminal event

            readers = [asyncio.create_task(read(job)) for job in submitted]
            counts = await run_workers(url, root, readers, freeze)
        else:
            pool = BlockingConnectionPool.from_url(url, max_connections=jobs + 16, timeout=600, client_name=name)
            async with Redis.from_pool(pool) as per_job:
                readers = [asyncio.create_task(read_alone(per_job, job.id, lags, first)) for job in submitted]
                counts = await run_workers(url, root, readers)
    elapsed = time.perf_counter() - first[0]
    gc.callbacks.remove(pauses)
    gc.unfreeze()
    stop.set()
    await sampling
    events = sum(counts)
    return {
        "completed": sum(1 for c in counts if c > 0),
        "events": events,
        "seconds": elapsed,
        "events_per_s": events / elapsed,
        "connections_max": sampler.most,
        "lag_p50_ms": percentile(lags, 0.5),
        "lag_p99_ms": percentile(lags, 0.99),
        "gc_pause_max_ms": pauses.longest_ms,
    }


async def run_workers(url: str, root: Path, readers: list[asyncio.Task[int]], freeze: bool = False) -> list[int]:
    """Starts the workers once every reader follows its job; returns each reader's event count."""
    await asyncio.sleep(0.5)  # every reader has made its first read (the work is queued, nothing is published)
    if freeze:
        gc.freeze()

    async def finish() -> list[int]:
        return list(await asyncio.gather(*readers))

    return await with_workers(url, WORKERS, STEP_S, SLOTS, root, finish)


async def read_alone(redis: Redis, request_id: str, lags: list[float], first: list[float]) -> int:
    """The previous design: this job's own blocking XREAD loop (and so its own connection)."""
    reader = ResultReader(request_id, KEYS.result(request_id))
    count = 0
    while not reader.builder.finished:
        reply = await redis.xread({reader.key: reader.last_id}, block=2000)
        for _key, entries in reply or ():
            for entry_id, fields in entries:
                if reader.consume(entry_id, fields) is not None:
                    if not first:
                        first.append(time.perf_counter())
                    lags.append(ms_now() - parse_id(entry_id)[0])
                count += 1
    return count


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="llmq-bench-client-"))
    server = RedisServer(root / "redis", "--maxclients", str(args.jobs + 1000)).start()
    try:
        mux = await phase(server.url, root, args.jobs, args.tokens, multiplexed=True)
        async with Redis.from_url(server.url) as redis:
            await redis.flushall()
        frozen = await phase(server.url, root, args.jobs, args.tokens, multiplexed=True, freeze=True)
        # The previous design cannot hold 10,000 connections here ("Timeout connecting to server"): the ratio
        # compares both designs at the size it survives.
        async with Redis.from_url(server.url) as redis:
            await redis.flushall()
        small = await phase(server.url, root, args.baseline_jobs, args.tokens, multiplexed=True)
        async with Redis.from_url(server.url) as redis:
            await redis.flushall()
        alone = await phase(server.url, root, args.baseline_jobs, args.tokens, multiplexed=False)
    finally:
        server.stop()
    for label, figures in (
        ("multiplexed", mux),
        ("multiplexed, gc.freeze() after following", frozen),
        ("multiplexed, baseline size", small),
        ("one connection per job", alone),
    ):
        print(
            f"{label}: {figures['completed']} jobs, {figures['events']} events in "
            f"{figures['seconds']:.1f} s = {figures['events_per_s']:,.0f} events/s, "
            f"at most {figures['connections_max']} connections, "
            f"delivery lag P50 {figures['lag_p50_ms']:.0f} ms, P99 {figures['lag_p99_ms']:.0f} ms, "
            f"longest GC pause {figures['gc_pause_max_ms']:.0f} ms"
        )
    return {
        "jobs": args.jobs,
        "completed": mux["completed"],
        "connections_max": mux["connections_max"],
        "events_per_s": round(mux["events_per_s"]),
        "delivery_lag_p50_ms": mux["lag_p50_ms"],
        "delivery_lag_p99_ms": mux["lag_p99_ms"],
        "gc_pause_max_ms": round(mux["gc_pause_max_ms"]),
        "delivery_lag_p99_ms_gc_frozen": frozen["lag_p99_ms"],
        "baseline_jobs": args.baseline_jobs,
        "baseline_completed": alone["completed"],
        "baseline_connections_max": alone["connections_max"],
        "baseline_events_per_s": round(alone["events_per_s"]),
        "baseline_delivery_lag_p99_ms": alone["lag_p99_ms"],
        "ratio_events": round(small["events_per_s"] / alone["events_per_s"], 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,000 jobs")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per job")
    parser.add_argument("--baseline-jobs", type=int, default=2000, help="jobs of the side-by-side comparison")
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.baseline_jobs = 1000, 500
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
