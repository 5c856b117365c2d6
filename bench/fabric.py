"""The queue fabric without the model's cost: client -> Redis -> worker processes -> Redis -> client, with the
scripted engine (`testing/scripted_engine.py`, never a default) that emits one token per running request every
simulated step.

    python -m bench.fabric [--quick] [--step-ms 20]

Reports the token events one worker publishes per second (no step time: the fabric's own ceiling),
requests per second through one Redis (one-token requests), and throughput with 1, 2 and 4 worker
processes at the simulated step time, with scaling efficiency = throughput(N) / (N x throughput(1)).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from tqdm import tqdm

from bench.workload import print_json
from client import AsyncClient
from client.connection import open_async
from client.store import Keys
from worker.embedded_redis import RedisServer

KEYS = Keys("default")


async def run_worker(
    url: str, step_s: float, max_running: int, name: str, affinity_wait_ms: int = 50, idle_tenant_slots: int = 0
) -> None:
    import signal

    # Here, in the worker's process only: the client side of a benchmark must not carry torch's heap (its
    # garbage collections stall the event loop for 100+ ms, which no real client process pays).
    from testing.scripted_engine import ScriptedEngine
    from worker.config import Settings
    from worker.logging import configure
    from worker.service import Worker

    configure("console", "warning")
    settings = Settings(
        _env_file=None,
        redis_url=url,
        worker_id=name,
        max_running=max_running,
        metrics_port=0,
        read_block_ms=20,
        heartbeat_s=0.5,
        model="scripted",
        affinity_wait_ms=affinity_wait_ms,
        idle_tenant_slots=idle_tenant_slots,
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with open_async(url) as redis:  # any Redis URL: bench.failover runs these on a Cluster and a Sentinel set
        await Worker(settings, ScriptedEngine(step_s=step_s, max_running=max_running), redis).run(stop)


async def measure(url: str, requests: int, tokens: int, label: str) -> tuple[float, int]:
    """Submits `requests` requests of `tokens` tokens at once; returns (seconds, token events in Redis)."""
    async with AsyncClient(url, max_queue_len=0) as client:
        progress = tqdm(total=requests, desc=label, unit="req", leave=False)
        start = time.perf_counter()
        jobs = await asyncio.gather(*(client.submit(input_ids=[1], max_new_tokens=tokens) for _ in range(requests)))

        async def one(job: Any) -> None:
            await job.result(timeout=600)
            progress.update(1)

        await asyncio.gather(*(one(job) for job in jobs))
        elapsed = time.perf_counter() - start
        progress.close()
    async with Redis.from_url(url) as redis, redis.pipeline(transaction=False) as pipe:
        for job in jobs:
            pipe.xlen(KEYS.result(job.id))
        events = sum(await pipe.execute()) - len(jobs)  # every entry but each request's `done`
    return elapsed, events


def start_workers(
    url: str,
    count: int,
    step_s: float,
    max_running: int,
    logs: Path,
    affinity_wait_ms: int = 50,
    idle_tenant_slots: int = 0,
) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.fabric",
                "--worker",
                url,
                "--step-ms",
                str(step_s * 1000),
                "--max-running",
                str(max_running),
                "--name",
                f"q{i}",
                "--affinity-wait-ms",
                str(affinity_wait_ms),
                "--idle-tenant-slots",
                str(idle_tenant_slots),
            ],
            stdout=(logs / f"q{i}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for i in range(count)
    ]


async def with_workers(
    url: str,
    count: int,
    step_s: float,
    max_running: int,
    logs: Path,
    work: Any,
    affinity_wait_ms: int = 50,
    idle_tenant_slots: int = 0,
) -> Any:
    workers = start_workers(url, count, step_s, max_running, logs, affinity_wait_ms, idle_tenant_slots)
    try:
        async with AsyncClient(url) as client:
            while len((await client.status()).workers) < count:
                await asyncio.sleep(0.2)
        return await work()
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=60)
        async with open_async(url) as redis:  # clear heartbeats so the next round counts its own workers
            await redis.delete(KEYS.workers)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="llmq-bench-fabric-"))
    server = RedisServer(root / "redis").start()
    scale = 0.25 if args.quick else 1.0
    figures: dict[str, Any] = {"step_ms": args.step_ms}
    try:
        url = server.url
        n, t = int(256 * scale), 200
        seconds, events = await with_workers(url, 1, 0.0, 256, root, lambda: measure(url, n, t, "events, 1 worker"))
        figures["events_per_s_one_worker"] = round(events / seconds)
        print(f"one worker, no step time: {events} token events in {seconds:.2f} s = {events / seconds:,.0f} events/s")

        n = int(4000 * scale)
        seconds, _ = await with_workers(url, 1, 0.0, 256, root, lambda: measure(url, n, 1, "requests, 1 worker"))
        figures["requests_per_s"] = round(n / seconds, 1)
        print(f"one-token requests through one Redis: {n} in {seconds:.2f} s = {n / seconds:,.0f} requests/s")

        step_s, per_worker = args.step_ms / 1000, 32
        throughput = {}
        for count in (1, 2, 4):
            requests = int(count * per_worker * 4 * scale) or count * per_worker
            seconds, events = await with_workers(
                url,
                count,
                step_s,
                per_worker,
                root,
                lambda r=requests, c=count: measure(url, r, 50, f"{c} worker(s), {args.step_ms:g} ms step"),
            )
            throughput[count] = events / seconds
            ideal = count * per_worker / step_s
            print(
                f"{count} worker(s): {throughput[count]:,.0f} tokens/s (ideal {ideal:,.0f} at {args.step_ms:g} ms/step)"
            )
        for count in (2, 4):
            figures[f"scaling_efficiency_{count}"] = round(throughput[count] / (count * throughput[1]), 3)
        figures["tokens_per_s"] = {str(k): round(v) for k, v in throughput.items()}
        efficiency = (figures["scaling_efficiency_2"], figures["scaling_efficiency_4"])
        print(f"scaling efficiency: 2 workers {efficiency[0]}, 4 workers {efficiency[1]}")
    finally:
        server.stop()
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a quarter of the load")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--max-running", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--name", default="q", help=argparse.SUPPRESS)
    parser.add_argument("--affinity-wait-ms", type=int, default=50, help=argparse.SUPPRESS)
    parser.add_argument("--idle-tenant-slots", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        step_s = args.step_ms / 1000
        asyncio.run(
            run_worker(args.worker, step_s, args.max_running, args.name, args.affinity_wait_ms, args.idle_tenant_slots)
        )
        return
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
