"""Traffic classes on one fleet: interactive requests beside a saturating batch load, against the same
interactive arrivals on an idle fleet and the same batch load alone, in one run, two worker processes.

    python -m bench.lanes [--quick] [--batch 96] [--interactive 32]

Phases, after a warm-up that runs every prompt once: (1) Poisson `interactive` arrivals on the idle fleet;
(2) the batch load alone (its greedy outputs are the reference, its tokens/s the baseline); (3) the same
batch load again, the same interactive arrivals started once every slot is busy. Reported: interactive TTFT
P50/P99 loaded and unloaded (`ttft_p99_ratio`), batch requests completed, lost and mismatched against the
reference, preemptions (the fence field `p` of the batch requests), batch tokens/s loaded over alone
(`batch_throughput_ratio`). Targets: `ttft_p99_ratio <= 2.0`, `batch_lost == 0`, `batch_mismatched == 0`,
`batch_throughput_ratio >= 0.85`.

Each worker computes on one thread (`OMP_NUM_THREADS=1`): the two workers stand for two machines, so that on a
2-core host "loaded" means a full engine, not also two workers fighting over the cores an idle one had alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from bench.workload import Job, make_workload, percentile, print_json
from client import AsyncClient
from client.store import Fence
from worker.embedded_redis import RedisServer

WORKERS = 2
MAX_RUNNING = 8  # per worker: 16 slots in the fleet


def start_worker(
    url: str, model: str, name: str, log: Path, **settings: str | int | float | bool
) -> subprocess.Popen[bytes]:
    """A worker process on one core; `settings` add or override flags (`metrics_port=9401` is `--metrics-port`)."""
    flags = {
        "--redis-url": url,
        "--model": model,
        "--worker-id": name,
        "--max-running": MAX_RUNNING,
        "--kv-cache-tokens": 16384,
        "--max-batch-tokens": 64,
        "--read-block-ms": 20,
        "--heartbeat-s": 0.5,
        "--claim-interval-s": 0.2,
        "--metrics-port": 0,
        "--log-level": "warning",
        **{f"--{setting.replace('_', '-')}": value for setting, value in settings.items()},
    }
    args = [str(part) for flag, value in flags.items() for part in switch(flag, value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a core each, as each worker of a fleet has its own device
    command = [sys.executable, "-m", "worker", *args]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def switch(flag: str, value: str | int | float) -> list[str | int | float]:
    """A flag and its value; a boolean is the flag alone, or its `--no-` form."""
    if isinstance(value, bool):
        return [flag if value else flag.replace("--", "--no-", 1)]
    return [flag, value]


async def interactive_ttfts(client: AsyncClient, jobs: list[Job], arrivals: list[float]) -> list[float]:
    """Submits each job at its arrival time; submit -> first streamed token, per job."""
    origin = time.perf_counter()

    async def one(job: Job, at: float) -> float:
        await asyncio.sleep(max(0.0, origin + at - time.perf_counter()))
        sent = time.perf_counter()
        handle = await client.submit(
            input_ids=job.prompt_ids, max_new_tokens=job.max_new_tokens, temperature=0, priority="interactive"
        )
        first = None
        async for delta in handle.stream(timeout=600):
            if first is None and delta.token_ids:
                first = time.perf_counter()
        return (first or time.perf_counter()) - sent

    return list(await asyncio.gather(*(one(job, at) for job, at in zip(jobs, arrivals, strict=True))))


async def batch_run(client: AsyncClient, jobs: list[Job]) -> tuple[list[Any], list[str]]:
    """Submits the batch load; returns its jobs and their ids (awaited by the caller)."""
    options = {"temperature": 0, "ignore_eos": True, "priority": "batch"}
    handles = [
        await client.submit(input_ids=job.prompt_ids, max_new_tokens=job.max_new_tokens, **options) for job in jobs
    ]
    return handles, [h.id for h in handles]


async def outputs(handles: list[Any]) -> tuple[list[list[int] | None], float]:
    """Each batch job's tokens (None when it failed), and when the last one ended."""

    async def one(handle: Any) -> list[int] | None:
        try:
            return (await handle.result(timeout=1800)).token_ids
        except Exception:  # counted as lost
            return None

    results = await asyncio.gather(*(one(h) for h in handles))
    return list(results), time.perf_counter()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="llmq-bench-lanes-"))
    if args.quick:
        from testing.tiny_models import save_tiny_model

        model = str(save_tiny_model(workdir / "model", "llama", max_positions=2048))
        vocab = 400  # the tiny model's vocabulary is smaller than any real one
    else:
        from worker.engine import DEFAULT_MODEL

        model, vocab = DEFAULT_MODEL, 49152
    batch = make_workload(vocab, args.batch, (16, 64), (args.batch_tokens, args.batch_tokens), seed=1)
    interactive = make_workload(vocab, args.interactive, (8, 32), (16, 16), seed=2)
    rng = random.Random(3)
    arrivals, clock = [], 0.0
    for _ in interactive:
        clock += rng.expovariate(args.rate)
        arrivals.append(clock)
    server = RedisServer(workdir / "redis").start()
    workers = [start_worker(server.url, model, f"w{i}", workdir / f"w{i}.log") for i in range(WORKERS)]
    try:
        async with AsyncClient(server.url, max_queue_len=0) as client:
            while len((await client.status()).workers) < WORKERS:
                if any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"a worker exited; logs in {workdir}")
                await asyncio.sleep(0.2)
            # Warm-up: every shape the phases will see once (the first matrix product of a new shape builds its
            # oneDNN kernel, which would otherwise land on whichever phase meets it first).
            handles, _ = await batch_run(client, batch[: WORKERS * MAX_RUNNING])
            await outputs(handles)
            for job in interactive:  # alone, as the idle phase will run them
                await interactive_ttfts(client, [job], [0.0])

            idle = await interactive_ttfts(client, interactive, arrivals)
            print(f"interactive alone: TTFT P50 {percentile(idle, 0.5):.3f} s, P99 {percentile(idle, 0.99):.3f} s")

            started = time.perf_counter()
            handles, _ = await batch_run(client, batch)
            reference, ended = await outputs(handles)
            alone_s = ended - started
            batch_tokens = sum(job.max_new_tokens for job in batch)
            print(f"batch alone: {len(batch)} requests, {batch_tokens / alone_s:.1f} tok/s")

            started = time.perf_counter()
            handles, ids = await batch_run(client, batch)
            while ((await client.status()).lanes[2].pending or 0) < min(len(batch), WORKERS * MAX_RUNNING):
                await asyncio.sleep(0.05)  # every slot busy with batch work before the first interactive arrival
            (loaded_outputs, ended), loaded = await asyncio.gather(
                outputs(handles), interactive_ttfts(client, interactive, arrivals)
            )
            loaded_s = ended - started
            async with Redis.from_url(server.url) as redis:
                counts = [await redis.hget(client.keys.fence(i), Fence.PREEMPTED) for i in ids]
            preemptions = sum(int(count or 0) for count in counts)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=60)
        server.stop()
    lost = sum(1 for out in loaded_outputs if out is None)
    mismatched = sum(1 for out, ref in zip(loaded_outputs, reference, strict=True) if out is not None and out != ref)
    figures = {
        "model": "tiny-llama (random)" if args.quick else model,
        "interactive_requests": len(interactive),
        "batch_requests": len(batch),
        "interactive_ttft_p50_s": round(percentile(loaded, 0.5), 3),
        "interactive_ttft_p99_s": round(percentile(loaded, 0.99), 3),
        "unloaded_ttft_p50_s": round(percentile(idle, 0.5), 3),
        "unloaded_ttft_p99_s": round(percentile(idle, 0.99), 3),
        "ttft_p99_ratio": round(percentile(loaded, 0.99) / percentile(idle, 0.99), 3),
        "batch_completed": len(batch) - lost,
        "batch_lost": lost,
        "batch_mismatched": mismatched,
        "preemptions": preemptions,
        "batch_tok_s": round(batch_tokens / loaded_s, 1),
        "batch_alone_tok_s": round(batch_tokens / alone_s, 1),
        "batch_throughput_ratio": round(alone_s / loaded_s, 3),
    }
    print(
        f"interactive beside batch: TTFT P50 {figures['interactive_ttft_p50_s']} s, "
        f"P99 {figures['interactive_ttft_p99_s']} s (ratio to idle {figures['ttft_p99_ratio']}); "
        f"batch {figures['batch_tok_s']} tok/s ({figures['batch_throughput_ratio']} of alone), "
        f"{preemptions} preemptions, {lost} lost, {mismatched} mismatched"
    )
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model")
    parser.add_argument("--batch", type=int, default=96, help="batch requests (more than the fleet's 16 slots)")
    parser.add_argument("--batch-tokens", type=int, default=96, help="tokens per batch request")
    parser.add_argument("--interactive", type=int, default=32, help="interactive requests (16 tokens each)")
    parser.add_argument("--rate", type=float, default=0.5, help="interactive arrivals per second (Poisson)")
    args = parser.parse_args(argv)
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
