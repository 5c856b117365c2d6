"""The service end to end: client -> Redis -> one worker process -> Redis -> client, against the engine alone,
and time to first token under Poisson arrivals against static batching of the same arrivals.

    python -m bench.e2e [--quick] [--requests N] [--rounds 3] [--load 0.8] [--device D --dtype T]

Throughput runs `bench.engine`'s busy workload (64 requests by default, `max_running` 32, prompts 16-256, outputs
70 % 16-64 and 30 % 128-384 tokens, greedy, EOS ignored) through the engine alone in this process and through the
service, one after the other (the engine first in odd rounds, the service first in even ones), `--rounds` times
(each round with prompts of its own, so that no prefix cache helps): `ratio` is the median of the rounds'
service/engine ratios, and `ratio_min` / `ratio_max` their spread (the target, 0.95, is for every round).
`service_cpu_pct` says where the CPU went during the service's rounds, in % of one core (Linux, from `/proc`):
the client (this process, whose engine is idle meanwhile), Redis, the worker's event loop (its main thread: intake,
relays, publisher) and the worker's other threads (the engine's). On a machine whose cores the engine fills, every
point the first three take is about a point of throughput the service loses. The
arrival rate is `--load` times the request rate the engine alone sustained on that workload, so the service is
loaded but not swamped. Static batching serves the same arrivals as a server would with `model.generate`:
whenever it is idle it takes every request that has arrived (up to 32) as one padded batch; a request's first
token comes when its batch's first step ends.
`--device` / `--dtype` place all three (the engine alone, the worker process, static batching) on the same device,
as the worker's own `--device` / `--dtype` do (`bench/device.sh` runs it on CUDA in bfloat16).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.engine import MAX_RUNNING, engine_config, load_busy, run_engine
from bench.workload import Job, cpu_s, peak_rss_mb, percentile, print_json
from client import AsyncClient
from worker.embedded_redis import RedisServer
from worker.engine import DEFAULT_MODEL, EngineConfig, LoadOptions

STATIC_MAX_BATCH = 32


def start_worker(
    url: str, model: str, options: LoadOptions, config: EngineConfig, log: Path
) -> subprocess.Popen[bytes]:
    flags = {
        "--redis-url": url,
        "--model": model,
        "--device": options.device,
        "--dtype": options.dtype,
        "--model-cache-dir": options.cache_dir,
        "--kv-cache-tokens": config.kv_cache_tokens,
        "--page-size": config.page_size,
        "--max-batch-tokens": config.max_batch_tokens,
        "--max-running": config.max_running,
        "--log-level": "warning",
    }  # the rest as deployed: the default read block (a wait that any new entry ends) and heartbeat
    args = [str(part) for pair in flags.items() for part in pair]
    return subprocess.Popen([sys.executable, "-m", "worker", *args], stdout=log.open("wb"), stderr=subprocess.STDOUT)


class CpuMeter:
    """CPU used by each part of the service while it is measured, in % of one core: the client, Redis, the worker's
    event loop (its main thread) and the worker's other threads. None where `/proc` is missing (not Linux)."""

    def __init__(self, client: int, redis: int, worker: int) -> None:
        self._client, self._redis, self._worker = client, redis, worker
        self._used: dict[str, float] = {}
        self._seconds = 0.0
        self._start: tuple[float, dict[str, float]] | None = None

    def _sample(self) -> dict[str, float]:
        loop = cpu_s(Path(f"/proc/{self._worker}/task/{self._worker}/stat"))
        return {
            "client": cpu_s(Path(f"/proc/{self._client}/stat")),
            "redis": cpu_s(Path(f"/proc/{self._redis}/stat")),
            "worker_loop": loop,
            "worker_engine": cpu_s(Path(f"/proc/{self._worker}/stat")) - loop,
        }

    def start(self) -> None:
        if Path("/proc/self/stat").is_file():
            self._start = (time.perf_counter(), self._sample())

    def stop(self) -> None:
        if self._start is None:
            return
        began, before = self._start
        after = self._sample()
        self._seconds += time.perf_counter() - began
        for part, used in after.items():
            self._used[part] = self._used.get(part, 0.0) + used - before[part]
        self._start = None

    def shares(self) -> dict[str, float] | None:
        if not self._seconds:
            return None
        return {part: round(100 * used / self._seconds, 1) for part, used in self._used.items()}


async def wait_for_worker(client: AsyncClient, process: subprocess.Popen[bytes], log: Path) -> None:
    while not (await client.status()).workers:
        if process.poll() is not None:
            raise RuntimeError(f"the worker exited; its log is {log}")
        await asyncio.sleep(0.2)


def other_prompts(jobs: list[Job], shift: int, vocab_size: int) -> list[Job]:
    """The same lengths with other prompt tokens: a round must not find the previous round's prompts in the worker's
    prefix cache (it did: the service then ran 13 % faster than the engine alone)."""
    return [
        Job(
            job.index,
            [3 + (token - 3 + 7919 * shift) % (vocab_size - 3) for token in job.prompt_ids],
            job.max_new_tokens,
        )
        for job in jobs
    ]


async def run_service(
    client: AsyncClient, jobs: list[Job], meter: CpuMeter | None = None
) -> tuple[float, list[list[int]]]:
    if meter is not None:
        meter.start()
    start = time.perf_counter()
    submitted = await asyncio.gather(*(_submit(client, job) for job in jobs))
    results = await asyncio.gather(*(job.result(timeout=600) for job in submitted))
    seconds = time.perf_counter() - start
    if meter is not None:
        meter.stop()
    return seconds, [result.token_ids for result in results]


async def service_ttfts(client: AsyncClient, jobs: list[Job], arrivals: list[float]) -> list[float]:
    """Submits each job at its arrival time and measures submit -> first streamed token."""
    origin = time.perf_counter()

    async def one(job: Job, at: float) -> float:
        await asyncio.sleep(max(0.0, origin + at - time.perf_counter()))
        sent = time.perf_counter()
        handle = await _submit(client, job)
        first = None
        async for delta in handle.stream(timeout=600):
            if first is None and delta.token_ids:
                first = time.perf_counter()
        assert first is not None
        return first - sent

    return list(await asyncio.gather(*(one(job, at) for job, at in zip(jobs, arrivals, strict=True))))


def static_ttfts(model: Any, tokenizer: Any, jobs: list[Job], arrivals: list[float]) -> list[float]:
    """A static-batching server in real time: idle -> take everything that has arrived -> generate."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ttft: dict[int, float] = {}
    origin = time.perf_counter()
    pending = list(zip(jobs, arrivals, strict=True))
    while pending:
        now = time.perf_counter() - origin
        if pending[0][1] > now:
            time.sleep(pending[0][1] - now)
            continue
        arrived = [p for p in pending if p[1] <= time.perf_counter() - origin][:STATIC_MAX_BATCH]
        pending = pending[len(arrived) :]
        first_step = _FirstStep()
        batch = [job for job, _ in arrived]
        width = max(len(job.prompt_ids) for job in batch)
        ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch])
        with torch.no_grad():
            model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                do_sample=False,
                pad_token_id=pad,
                streamer=first_step,
                max_new_tokens=max(job.max_new_tokens for job in batch),
            )
        for job, at in arrived:
            ttft[job.index] = first_step.at - origin - at
    return [ttft[job.index] for job in jobs]


class _FirstStep:
    """A `generate` streamer that only notes when the first generated tokens come out (its 2nd `put`)."""

    def __init__(self) -> None:
        self.calls = 0
        self.at = 0.0
        self._lock = threading.Lock()

    def put(self, value: Any) -> None:
        with self._lock:
            self.calls += 1
            if self.calls == 2:
                self.at = time.perf_counter()

    def end(self) -> None:
        pass


async def _submit(client: AsyncClient, job: Job) -> Any:
    return await client.submit(
        input_ids=job.prompt_ids, max_new_tokens=job.max_new_tokens, temperature=0, ignore_eos=True
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="llmq-bench-e2e-"))
    if args.quick:
        from testing.tiny_models import save_tiny_model

        model_spec = str(save_tiny_model(workdir / "model", "llama", max_positions=2048))
    else:
        model_spec = DEFAULT_MODEL
    options = LoadOptions(device=args.device, dtype=args.dtype)
    if args.quick:
        options = replace(options, cache_dir=workdir / "cache")
    model, tokenizer, jobs = load_busy(args.requests, model_spec, options)
    useful = sum(job.max_new_tokens for job in jobs)
    config = engine_config(jobs, MAX_RUNNING)
    print(
        f"model: {model_spec} on {model.device} ({model.dtype}); {len(jobs)} requests (busy), {useful} useful "
        f"tokens; torch threads {torch.get_num_threads()}"
    )

    server = RedisServer(workdir / "redis").start()
    log = workdir / "worker.log"
    worker = start_worker(server.url, model_spec, options, config, log)
    rounds: list[tuple[float, float]] = []  # (engine alone s, service s)
    outputs_match = True
    if server.pid is None:
        raise RuntimeError("redis-server is not running")
    meter = CpuMeter(os.getpid(), server.pid, worker.pid)
    try:
        async with AsyncClient(server.url, max_queue_len=0) as client:
            await wait_for_worker(client, worker, log)
            warmup = other_prompts(jobs[:2], args.rounds + 1, model.config.vocab_size)
            await run_service(client, warmup)  # warm the worker's kernels, as the engine run does its own
            for round_number in range(1, args.rounds + 1):
                shifted = other_prompts(jobs, round_number, model.config.vocab_size)
                # Odd rounds run the engine alone first, even rounds the service: a machine whose speed drifts
                # over a run's minutes then favours neither side (one such run gave the engine alone 38 tok/s in
                # its first round and 48 in its second).
                if round_number % 2:
                    engine_s, engine_out = await run_engine(model, tokenizer, shifted, config)
                    e2e_s, e2e_out = await run_service(client, shifted, meter)
                else:
                    e2e_s, e2e_out = await run_service(client, shifted, meter)
                    engine_s, engine_out = await run_engine(model, tokenizer, shifted, config)
                outputs_match = outputs_match and e2e_out == engine_out
                rounds.append((engine_s, e2e_s))
                print(
                    f"round {round_number}: engine alone {useful / engine_s:7.1f} tok/s, client+redis+worker "
                    f"{useful / e2e_s:7.1f} tok/s: ratio {engine_s / e2e_s:.3f}"
                )
            engine_s = statistics.median(engine for engine, _ in rounds)
            e2e_s = statistics.median(e2e for _, e2e in rounds)
            ratios = [engine / e2e for engine, e2e in rounds]

            rate = args.load * len(jobs) / engine_s
            rng = random.Random(1)
            arrivals, clock = [], 0.0
            for _ in jobs:
                clock += rng.expovariate(rate)
                arrivals.append(clock)
            print(f"Poisson arrivals at {rate:.2f} req/s ({args.load:.0%} of the engine's request rate)")
            service = await service_ttfts(client, jobs, arrivals)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        server.stop()
    static = static_ttfts(model, tokenizer, jobs, arrivals)
    figures = {
        "model": model_spec,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "requests": len(jobs),
        "workload": "busy",
        "rounds": len(rounds),
        "engine_tok_s": round(useful / engine_s, 2),
        "e2e_tok_s": round(useful / e2e_s, 2),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "ratios": [round(ratio, 3) for ratio in ratios],
        "service_cpu_pct": meter.shares(),
        "outputs_match": outputs_match,
        "arrival_rate_req_s": round(rate, 3),
        "ttft_p50_s": round(percentile(service, 0.5), 3),
        "ttft_p99_s": round(percentile(service, 0.99), 3),
        "ttft_mean_s": round(statistics.fmean(service), 3),
        "static_ttft_p50_s": round(percentile(static, 0.5), 3),
        "static_ttft_p99_s": round(percentile(static, 0.99), 3),
        "ttft_ratio": round(percentile(service, 0.5) / percentile(static, 0.5), 3),
        "peak_rss_mb": round(peak_rss_mb()),
    }
    print(
        f"throughput ratio e2e/engine: median {figures['ratio']} over {len(rounds)} rounds (min {figures['ratio_min']},"
        f" max {figures['ratio_max']}); outputs equal: {figures['outputs_match']}"
    )
    print(f"CPU during the service's rounds, % of one core: {figures['service_cpu_pct']}")
    print(
        f"TTFT service p50 {figures['ttft_p50_s']} s p99 {figures['ttft_p99_s']} s; "
        f"static p50 {figures['static_ttft_p50_s']} s p99 {figures['static_ttft_p99_s']} s; "
        f"ratio {figures['ttft_ratio']}"
    )
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, finishes in under a minute")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="engine alone, then the service, this many times")
    parser.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of the engine's")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
