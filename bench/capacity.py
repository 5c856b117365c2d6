"""What one Redis shard carries: Redis commands and Redis CPU per request and per generated token, measured on a
real redis-server under scripted-engine workers (`testing/scripted_engine.py`: no model), and the capacity they
project for one shard and for P shards.

    python -m bench.capacity [--quick] [--workers 2] [--max-running 32] [--requests 400] [--step-ms 20 5]

Per step setting, `--workers` worker processes start with the service's default timings (500 ms read block,
2 s heartbeat, leases renewed every 2 s, claims every 1 s). The idle fleet's own load on Redis (heartbeats, claim
sweeps, idle reads) is measured for a few seconds, reported per worker, and subtracted from the runs that follow:
`--requests` requests of 1, 16 and 128 tokens each (half streamed, half awaited whole) from one `AsyncClient`
that keeps 2 x the fleet's slots in flight, so the queue always holds a backlog. Around each run: CONFIG
RESETSTAT, INFO commandstats (calls and usec by command), INFO stats (network bytes) and INFO cpu (the main
thread's user + sys time, which includes reading and writing the sockets; commandstats' usec does not),
cross-checked with the process's time in /proc/<pid>/stat.

Per request and per token: per-request cost(T) = a + b T, the line through the 1- and the 128-token runs; the
16-token run checks it. commandstats counts a script call once as `evalsha` and each command the script runs
under its own name as well, so "commands" are what Redis executed, not round trips, and the time "in commands" is
the scripts' (whole) plus that of the commands no script runs. Events per flush (per publish-script call, each
carrying what an engine step produced) come from the workers' own counters.

Capacity: a shard is one Redis main thread, one core. At 100 % of it, requests of T tokens run at 1e6 / (a + b T)
per second, with a and b in CPU microseconds from the step setting whose runs kept Redis busiest (the nearest to
a loaded shard; the other setting's runs are checked against its line). P shards, each holding its own queues (or,
once issue 27 lands, partitions of one queue: `LLMQ_QUEUE_PARTITIONS`), share nothing, so their row is P times one
shard's. Every row of the table is a projection, not a measurement: on 2 cores the workers and the client saturate
long before Redis does. What is measured directly is Redis's utilisation at the rates the runs reach.

A last run (default mode) keeps 4 requests in flight, so the queue runs dry and the workers wait in a blocking
read: each submission then wakes every idle worker, which reads the queue in vain. It runs with `--workers` and
with 2 x `--workers`, to show how much that costs per request and per idle worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from redis.asyncio import Redis

import client
import worker
from bench.workload import cpu_s, print_json
from client import AsyncClient
from client.connection import open_async
from client.store import Keys
from worker.embedded_redis import RedisServer
from worker.pausing import pause

KEYS = Keys("default")
SCRIPT_CALLS = ("evalsha", "eval", "fcall", "fcall_ro")  # commandstats times a script whole, its commands included
# Commands some script runs: commandstats counts them again under their own names (time included), so the time "in
# commands" is the scripts' plus that of the commands no script runs; the few a client calls too are left out.
SCRIPTED = frozenset(
    name.lower()
    for path in (Path(client.__file__).parent, Path(worker.__file__).parent)
    for source in [*path.glob("*.py"), *path.glob("**/*.lua")]
    for name in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", source.read_text())
)
OWN_CALLS = ("info", "config|resetstat")  # the benchmark's own calls, left out of every figure
TIMEOUT_S = 600.0
SHAPES = (1, 16, 256)  # tokens per request in the capacity table
SHARDS = (1, 3, 6)
DRY_IN_FLIGHT, DRY_TOKENS = 4, 4


@dataclass(frozen=True)
class Usage:
    """What Redis did in one window (calls may be fractional once the idle fleet's share is taken off)."""

    seconds: float
    calls: dict[str, float]
    usec: dict[str, float]
    cpu_us: float  # the main thread's user + sys (INFO cpu): the one core a shard has
    process_cpu_us: float  # every thread's (INFO cpu)
    proc_cpu_us: float  # the process's, from /proc/<pid>/stat: the cross-check
    net_bytes: float  # in + out

    def minus(self, idle: Usage) -> Usage:
        """This window less what the idle fleet does in as long."""
        k = self.seconds / idle.seconds

        def less(mine: dict[str, float], theirs: dict[str, float]) -> dict[str, float]:
            names = set(mine) | set(theirs)
            return {name: max(0.0, mine.get(name, 0.0) - k * theirs.get(name, 0.0)) for name in names}

        return Usage(
            self.seconds,
            less(self.calls, idle.calls),
            less(self.usec, idle.usec),
            self.cpu_us - k * idle.cpu_us,
            self.process_cpu_us - k * idle.process_cpu_us,
            self.proc_cpu_us - k * idle.proc_cpu_us,
            self.net_bytes - k * idle.net_bytes,
        )


class Meter:
    """Windows of one redis-server's work: CONFIG RESETSTAT at the start, INFO at the end, CPU time diffed."""

    def __init__(self, redis: Redis, pid: int) -> None:
        self._redis = redis
        self._stat = Path(f"/proc/{pid}/stat")
        self._started = (0.0, 0.0, 0.0, 0.0)

    async def _cpu_s(self) -> tuple[float, float]:
        info = await self._redis.info("cpu")
        process = info["used_cpu_user"] + info["used_cpu_sys"]
        if "used_cpu_user_main_thread" not in info:  # before Redis 6.2: the whole process
            return process, process
        return info["used_cpu_user_main_thread"] + info["used_cpu_sys_main_thread"], process

    async def start(self) -> None:
        await self._redis.config_resetstat()
        main, process = await self._cpu_s()
        self._started = (time.perf_counter(), main, process, cpu_s(self._stat))

    async def stop(self) -> Usage:
        seconds = time.perf_counter() - self._started[0]
        (main, process), proc = await self._cpu_s(), cpu_s(self._stat)
        stats = await self._redis.info("commandstats")
        net = await self._redis.info("stats")
        names = {key.removeprefix("cmdstat_"): value for key, value in stats.items() if key.startswith("cmdstat_")}
        mine = {name: value for name, value in names.items() if name not in OWN_CALLS}
        return Usage(
            seconds,
            {name: float(value["calls"]) for name, value in mine.items()},
            {name: float(value["usec"]) for name, value in mine.items()},
            (main - self._started[1]) * 1e6,
            (process - self._started[2]) * 1e6,
            (proc - self._started[3]) * 1e6,
            float(net["total_net_input_bytes"] + net["total_net_output_bytes"]),
        )


# --- the fleet -------------------------------------------------------------------------------------------------


async def run_worker(url: str, step_s: float, max_running: int, name: str, counters: Path) -> None:
    """One worker process with the service's default timings; its publisher's counters go to `counters`."""
    # Here only: the client side of the benchmark must not carry torch's heap (see bench.fabric).
    from testing.scripted_engine import ScriptedEngine
    from worker.config import Settings
    from worker.logging import configure
    from worker.service import Worker

    configure("console", "warning")
    settings = Settings(  # type: ignore[call-arg]  # _env_file: pydantic-settings' own keyword
        _env_file=None,
        redis_url=SecretStr(url),
        worker_id=name,
        max_running=max_running,
        metrics_port=0,
        model="scripted",
        health_file=counters.with_suffix(".health"),
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with open_async(url) as redis:
        service = Worker(settings, ScriptedEngine(step_s=step_s, max_running=max_running), redis)
        stats, scratch = service.publisher.stats, counters.with_suffix(".tmp")

        async def write_counters() -> None:
            while await pause(stop, 0.1):
                scratch.write_text(json.dumps({"flushes": stats.flushes, "events": stats.events}))
                os.replace(scratch, counters)

        writer = asyncio.create_task(write_counters())
        await service.run(stop)
        await writer


class Fleet:
    """The worker processes of one phase and their publishers' counters."""

    def __init__(self, url: str, count: int, step_ms: float, max_running: int, logs: Path) -> None:
        self._counters = [logs / f"w{count}-{step_ms:g}-{i}.json" for i in range(count)]
        self._logs = [path.with_suffix(".log").open("wb") for path in self._counters]
        command = [sys.executable, "-m", "bench.capacity", "--worker", url, "--max-running", str(max_running)]
        self._processes = [
            subprocess.Popen(
                [*command, "--step-ms", str(step_ms), "--name", f"w{i}", "--counters", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for i, (path, log) in enumerate(zip(self._counters, self._logs, strict=True))
        ]

    def check(self) -> None:
        """Raises if a worker has exited (say, at start-up), with the end of its log."""
        for process, log in zip(self._processes, self._logs, strict=True):
            if process.poll() is not None:
                raise RuntimeError(f"a worker exited ({process.returncode}): {Path(log.name).read_text()[-2000:]}")

    def published(self) -> tuple[int, int]:
        """(publish-script calls, events) of every worker so far."""
        flushes = events = 0
        for path in self._counters:
            if path.exists():
                counts = json.loads(path.read_text())
                flushes, events = flushes + counts["flushes"], events + counts["events"]
        return flushes, events

    def stop(self) -> None:
        for process in self._processes:
            process.terminate()
        for process, log in zip(self._processes, self._logs, strict=True):
            process.wait(timeout=60)
            log.close()


# --- a run -----------------------------------------------------------------------------------------------------


async def load(client: AsyncClient, requests: int, tokens: int, in_flight: int) -> int:
    """`requests` requests of `tokens` tokens with at most `in_flight` at once, the even ones streamed and the odd
    ones awaited whole; returns how many were answered with all their tokens."""
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> int:
        async with gate:
            job = await client.submit(input_ids=[1 + i % 300], max_new_tokens=tokens)
            if i % 2:
                return len((await job.result(timeout=TIMEOUT_S)).token_ids)
            received = 0
            async for delta in job.stream(timeout=TIMEOUT_S):
                received += len(delta.token_ids)
            return received

    return sum(count == tokens for count in await asyncio.gather(*(one(i) for i in range(requests))))


@dataclass(frozen=True)
class Run:
    requests: int
    tokens: int  # per request
    usage: Usage  # less the idle fleet's share
    cpu_share: float  # of a core, Redis's main thread over the whole window (idle fleet included)
    idle_share: float  # of that, the idle fleet's
    flushes: int
    events: int
    complete: int  # requests answered with all their tokens


async def measure(
    meter: Meter, client: AsyncClient, fleet: Fleet, idle: Usage, requests: int, tokens: int, in_flight: int
) -> Run:
    before = fleet.published()
    await meter.start()
    complete = await load(client, requests, tokens, in_flight)
    usage = await meter.stop()
    await asyncio.sleep(0.3)  # the workers write their counters every 0.1 s
    after = fleet.published()
    return Run(
        requests,
        tokens,
        usage.minus(idle),
        usage.cpu_us / usage.seconds / 1e6,
        idle.cpu_us / idle.seconds / 1e6,
        after[0] - before[0],
        after[1] - before[1],
        complete,
    )


async def phase(
    url: str, meter: Meter, args: argparse.Namespace, workers: int, step_ms: float, lengths: tuple[int, ...], dry: bool
) -> tuple[Usage, list[Run], Run | None]:
    """One fleet: its idle load, a run of each of `lengths` tokens per request, then (`dry`) the dry-queue run."""
    fleet = Fleet(url, workers, step_ms, args.max_running, args.logs)
    in_flight = 2 * workers * args.max_running
    try:
        async with AsyncClient(url, max_queue_len=0) as client:
            while len((await client.status()).workers) < workers:
                fleet.check()
                await asyncio.sleep(0.2)
            await load(client, in_flight, 2, in_flight)  # every connection has loaded the scripts
            await asyncio.sleep(0.5)
            await meter.start()
            await asyncio.sleep(args.idle_s)
            idle = await meter.stop()
            runs = [await measure(meter, client, fleet, idle, args.requests, t, in_flight) for t in lengths]
            dried = None
            if dry:
                dried = await measure(meter, client, fleet, idle, args.dry_requests, DRY_TOKENS, DRY_IN_FLIGHT)
    finally:
        fleet.stop()
        async with open_async(url) as redis:  # so the next fleet counts only its own heartbeats
            await redis.delete(KEYS.workers)
    return idle, runs, dried


# --- figures ---------------------------------------------------------------------------------------------------


def fit(points: dict[int, float]) -> tuple[float, float]:
    """(a, b) of cost(T) = a + b T per request, the line through the shortest and the longest run."""
    low, high = min(points), max(points)
    b = (points[high] - points[low]) / (high - low)
    return points[low] - b * low, b


def capacity_table(cpu_us_per_request: float, cpu_us_per_token: float) -> list[dict[str, Any]]:
    """Requests/s and tokens/s of P shards at 100 % of each one's core, for every shape: a projection."""
    rows = []
    for tokens in SHAPES:
        per_s = 1e6 / (cpu_us_per_request + cpu_us_per_token * tokens)
        for shards in SHARDS:
            rows.append(
                {
                    "tokens_per_request": tokens,
                    "shards": shards,
                    "requests_per_s": round(shards * per_s),
                    "tokens_per_s": round(shards * per_s * tokens),
                }
            )
    return rows


def per_request(run: Run) -> dict[str, float]:
    usage, n = run.usage, run.requests
    scripts = sum(usec for name, usec in usage.usec.items() if name in SCRIPT_CALLS)
    unscripted = sum(usec for name, usec in usage.usec.items() if name not in SCRIPTED and name not in SCRIPT_CALLS)
    return {
        "commands": sum(usage.calls.values()) / n,
        "cpu_us": usage.cpu_us / n,
        "usec": (scripts + unscripted) / n,
        "usec_scripts": scripts / n,
        "process_cpu_us": usage.process_cpu_us / n,
        "proc_cpu_us": usage.proc_cpu_us / n,
        "net_bytes": usage.net_bytes / n,
        **{f"calls:{name}": calls / n for name, calls in usage.calls.items()},
        **{f"usec:{name}": usec / n for name, usec in usage.usec.items()},
    }


@dataclass(frozen=True)
class StepFit:
    """The runs of one step setting and the lines (per request, per token) of every figure through them."""

    step_ms: float
    runs: list[Run]
    points: dict[int, dict[str, float]]  # tokens per request -> `per_request`
    lines: dict[str, tuple[float, float]]

    @classmethod
    def of(cls, step_ms: float, runs: list[Run]) -> StepFit:
        points = {run.tokens: per_request(run) for run in runs}
        names = sorted({key for figures in points.values() for key in figures})
        return cls(step_ms, runs, points, {n: fit({t: f.get(n, 0.0) for t, f in points.items()}) for n in names})

    @property
    def busiest(self) -> float:
        """The largest share of a core Redis's main thread used in a run."""
        return max(run.cpu_share for run in self.runs)

    def by_command(self) -> dict[str, list[float]]:
        """Per command: calls per request, per token, usec per request, per token (those that count)."""
        names = {key.split(":", 1)[1] for key in self.lines if key.startswith("calls:")}
        rows = {name: [*self.lines[f"calls:{name}"], *self.lines.get(f"usec:{name}", (0.0, 0.0))] for name in names}
        ranked = sorted(rows.items(), key=lambda item: -(item[1][0] + 16 * item[1][1]))
        return {n: [round(x, 3) + 0.0 for x in row] for n, row in ranked if abs(row[0]) + 16 * abs(row[1]) >= 0.01}


def describe_step(step: StepFit, reference: StepFit) -> dict[str, Any]:
    """One step setting's runs and fit, printed; each run's Redis CPU against what `reference`'s line predicts at
    the run's rate (for `reference` itself, its middle run is the check)."""
    a, b = step.lines["cpu_us"]
    per_request_us, per_token_us = reference.lines["cpu_us"]
    print(f"step {step.step_ms:g} ms:")
    print(
        "  tokens/req   req/s   tok/s  events/flush  commands/req  CPU us/req  Redis main thread"
        f" (the {reference.step_ms:g} ms line says)"
    )
    for run in step.runs:
        figures, rate = step.points[run.tokens], run.requests / run.usage.seconds
        predicted = rate * (per_request_us + per_token_us * run.tokens) / 1e6 + run.idle_share
        print(
            f"  {run.tokens:>10}  {rate:>6,.0f}  {rate * run.tokens:>6,.0f}  {run.events / max(1, run.flushes):>12.1f}"
            f"  {figures['commands']:>12.1f}  {figures['cpu_us']:>10.0f}  {100 * run.cpu_share:>5.1f} % of a core"
            f" ({100 * predicted:.1f} %)"
        )
    middle = sorted(step.points)[len(step.points) // 2]
    off = step.points[middle]["cpu_us"] / (a + b * middle) - 1
    commands, usec, scripts, net = (step.lines[k] for k in ("commands", "usec", "usec_scripts", "net_bytes"))
    print(
        f"  line: per request {commands[0]:.1f} commands, {a:.0f} us CPU, {usec[0]:.0f} us in commands"
        f" ({scripts[0]:.0f} in scripts), {net[0]:,.0f} bytes; per token {commands[1]:.2f} commands, {b:.1f} us"
        f" CPU, {usec[1]:.1f} us in commands ({scripts[1]:.1f} in scripts), {net[1]:,.0f} bytes"
    )
    print(f"  the {middle}-token run's CPU per request is {100 * off:+.1f} % off this step's line")
    cross = [(step.points[run.tokens]["process_cpu_us"], step.points[run.tokens]["proc_cpu_us"]) for run in step.runs]
    print("  the process's CPU us/request, INFO cpu vs /proc: " + ", ".join(f"{i:.0f} vs {p:.0f}" for i, p in cross))
    rows = step.by_command()
    print(
        "  calls by command, per request and per token: "
        + ", ".join(f"{n} {r[0]:.2f} {r[1]:+.3f}" for n, r in rows.items())
    )
    timed = sorted(rows.items(), key=lambda item: -(item[1][2] + 16 * item[1][3]))[:6]
    print(
        "  usec by command, per request and per token (evalsha's include what its scripts run): "
        + ", ".join(f"{n} {r[2]:.1f} {r[3]:+.2f}" for n, r in timed)
    )
    return {
        "step_ms": step.step_ms,
        "commands_per_request": round(commands[0], 2),
        "commands_per_token": round(commands[1], 3),
        "redis_cpu_us_per_request": round(a, 1),
        "redis_cpu_us_per_token": round(b, 2),
        "commandstats_usec_per_request": round(usec[0], 1),
        "commandstats_usec_per_token": round(usec[1], 2),
        "script_usec_per_request": round(scripts[0], 1),
        "script_usec_per_token": round(scripts[1], 2),
        "net_bytes_per_request": round(net[0]),
        "net_bytes_per_token": round(net[1]),
        "fit_check_off": round(off, 3),
        "shard_requests_per_s": round(1e6 / (a + b)),  # one-token requests, at 100 % of a core
        "shard_tokens_per_s": round(1e6 / b),  # the limit of long generations
        "by_command": rows,
        "runs": [
            {
                "tokens": run.tokens,
                "tokens_per_s": round(run.requests * run.tokens / run.usage.seconds),
                "redis_cpu_share": round(run.cpu_share, 3),
                "events_per_flush": round(run.events / max(1, run.flushes), 1),
                "complete": run.complete,
            }
            for run in step.runs
        ],
    }


def describe_idle(idle: Usage, workers: int) -> dict[str, Any]:
    commands, cpu_us = sum(idle.calls.values()) / idle.seconds / workers, idle.cpu_us / idle.seconds / workers
    print(
        f"idle fleet: {commands:.1f} commands/s and {cpu_us / 1e4:.2f} % of a core per worker (heartbeats, claim"
        f" sweeps, idle reads; subtracted from every run): {1e6 / cpu_us:,.0f} idle workers would fill a shard"
    )
    return {"idle_commands_per_s_per_worker": round(commands, 1), "idle_cpu_us_per_s_per_worker": round(cpu_us)}


def describe_dry(dry: dict[int, Run], step: StepFit) -> dict[str, Any]:
    """The dry-queue runs (at `step`'s setting) by fleet size: commands and CPU per request, against the backlog
    line's."""
    (few, low), (many, high) = sorted((workers, per_request(run)) for workers, run in dry.items())
    commands, cpu = step.lines["commands"], step.lines["cpu_us"]
    print(
        f"dry queue ({DRY_IN_FLIGHT} in flight, {DRY_TOKENS} tokens each, {step.step_ms:g} ms step): per request"
        f" {low['commands']:.1f} commands and {low['cpu_us']:.0f} us CPU with {few} workers, {high['commands']:.1f} and"
        f" {high['cpu_us']:.0f} with {many}: {(high['commands'] - low['commands']) / (many - few):+.1f} commands and"
        f" {(high['cpu_us'] - low['cpu_us']) / (many - few):+.0f} us per extra idle worker; with a backlog the line"
        f" says {commands[0] + DRY_TOKENS * commands[1]:.1f} and {cpu[0] + DRY_TOKENS * cpu[1]:.0f}"
    )
    return {
        str(workers): {"commands": round(figures["commands"], 1), "cpu_us": round(figures["cpu_us"])}
        for workers, figures in ((few, low), (many, high))
    }


def describe_capacity(head: dict[str, Any], longest: int) -> dict[str, Any]:
    a, b = head["redis_cpu_us_per_request"], head["redis_cpu_us_per_token"]
    table = capacity_table(a, b)
    print(f"capacity at 100 % of each shard's core: a projection from the {head['step_ms']:g} ms line, not measured")
    if max(SHAPES) > longest:
        print(f"(past {longest} tokens per request the line is extrapolated)")
    print("| tokens/request | shards | requests/s | tokens/s |\n| --- | --- | --- | --- |")
    for row in table:
        print(
            f"| {row['tokens_per_request']} | {row['shards']} | {row['requests_per_s']:,} | {row['tokens_per_s']:,} |"
        )
    print(
        "P shards are P x one shard, as shards share nothing (P queues, or P partitions of one queue); each idle"
        " worker takes its share above off its shard"
    )
    return {"capacity_projection": table}


def compare_steps(steps: list[StepFit], described: list[dict[str, Any]], head: StepFit) -> None:
    """Redis's utilisation in each step setting's longest run, and what each other setting's line projects."""
    top = described[steps.index(head)]
    for step, figures in zip(steps, described, strict=True):
        run = step.runs[-1]
        line = (
            f"{step.step_ms:g} ms step: Redis's main thread used {100 * run.cpu_share:.1f} % of a core at"
            f" {run.requests * run.tokens / run.usage.seconds:,.0f} tokens/s"
        )
        if step is not head:
            line += (
                f"; its line costs {figures['redis_cpu_us_per_token'] / top['redis_cpu_us_per_token']:.2f}x the CPU"
                f" per token of the {head.step_ms:g} ms line for {figures['commands_per_token']} commands per token"
                f" (there {top['commands_per_token']}) and projects one shard at {figures['shard_requests_per_s']:,}"
                f" one-token requests/s, {figures['shard_tokens_per_s']:,} tokens/s"
            )
        print(line)
    print(f"the capacity table takes the line of the busiest runs ({head.step_ms:g} ms step)")


async def measure_all(url: str, meter: Meter, args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    steps: list[StepFit] = []
    dry: dict[int, Run] = {}
    for index, step_ms in enumerate(args.step_ms):
        first = index == 0
        idle, runs, dried = await phase(url, meter, args, args.workers, step_ms, args.tokens, first and args.dry)
        if first:
            figures.update(describe_idle(idle, args.workers))
        steps.append(StepFit.of(step_ms, runs))
        if dried is not None:
            dry[args.workers] = dried
    if args.dry:
        _, _, dried = await phase(url, meter, args, 2 * args.workers, args.step_ms[0], (), True)
        assert dried is not None
        dry[2 * args.workers] = dried
    head = max(steps, key=lambda step: step.busiest)  # the nearest to a loaded shard
    described = [describe_step(step, head) for step in steps]
    compare_steps(steps, described, head)
    if dry:
        figures["dry_queue"] = describe_dry(dry, steps[0])
    summary = described[steps.index(head)]
    figures.update({key: value for key, value in summary.items() if key not in ("by_command", "runs")})
    figures.update(describe_capacity(summary, max(args.tokens)))
    figures["by_step"] = described
    checked = [run for step in steps for run in step.runs] + list(dry.values())
    figures["complete"] = sum(run.complete for run in checked)
    figures["expected"] = sum(run.requests for run in checked)
    print(f"requests answered with all their tokens: {figures['complete']} of {figures['expected']}")
    return figures


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    args.logs = Path(tempfile.mkdtemp(prefix="llmq-bench-capacity-"))
    server = RedisServer(args.logs / "redis").start()
    in_flight = 2 * args.workers * args.max_running
    try:
        async with open_async(server.url) as redis:
            info = await redis.info("server")
            print(
                f"settings: {args.workers} workers x {args.max_running} slots, {in_flight} requests in flight,"
                f" {args.requests} requests per run; Redis {info['redis_version']} on {os.cpu_count()} cores"
            )
            figures = await measure_all(server.url, Meter(redis, int(info["process_id"])), args)
    finally:
        server.stop()
    settings = {"workers": args.workers, "max_running": args.max_running, "in_flight": in_flight}
    return {**settings, "requests": args.requests, "tokens": list(args.tokens), **figures}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one step setting, short runs, no dry-queue runs")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[20.0, 5.0])
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="w", help=argparse.SUPPRESS)
    parser.add_argument("--counters", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        asyncio.run(run_worker(args.worker, args.step_ms[0] / 1000, args.max_running, args.name, args.counters))
        return
    args.tokens, args.idle_s, args.dry, args.dry_requests = (1, 16, 128), 3.0, True, 120
    if args.quick:
        args.step_ms, args.tokens, args.idle_s, args.dry = args.step_ms[:1], (1, 8, 32), 1.0, False
        args.requests = min(args.requests, 64)
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
