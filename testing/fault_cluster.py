"""A small deployment for fault tests and `bench/faults.py`: a redis-server with AOF that can be restarted on
the same port, worker processes that can be killed, stopped and restarted, and the checks run after a fault."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from redis.asyncio import Redis
from redis.exceptions import RedisError

from client import AsyncClient, AsyncJob, LLMQError, RequestFailed
from client.protocol import ENTRY_FIELD, decode_event, ms_now
from client.store import Keys
from client.tenants import TenantLimits
from worker.embedded_redis import RedisServer
from worker.engine import Engine, EngineConfig, EngineRequest, GenerationParams, LoadOptions, load_model

KEYS = Keys("default")
ENGINE_DIED = "Error in generation loop"  # transformers' log line when its generation thread dies
WORKER_FLAGS = {
    "--kv-cache-tokens": 4096,
    "--page-size": 16,
    "--max-batch-tokens": 128,
    "--max-running": 8,
    "--read-block-ms": 50,
    "--heartbeat-s": 0.3,
    "--lease-timeout-s": 2.0,
    "--lease-renew-s": 0.3,
    "--claim-interval-s": 0.3,
    "--drain-timeout-s": 0.2,
    "--log-format": "json",
    "--max-deliveries": 20,
    "--metrics-port": 0,
}


@dataclass
class Cluster:
    """`module` runs each worker (`testing.poison` adds the test-only engine killer); `flags` override
    `WORKER_FLAGS`."""

    root: Path
    model_dir: Path
    module: str = "worker"
    flags: dict[str, object] = field(default_factory=dict)
    server: RedisServer = field(init=False)
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.server = RedisServer(self.root / "redis", "--appendonly", "yes", "--appendfsync", "everysec").start()

    @property
    def url(self) -> str:
        return self.server.url

    def start_worker(self, name: str) -> None:
        flags = [str(part) for pair in {**WORKER_FLAGS, **self.flags}.items() for part in pair]
        log = (self.root / f"{name}.log").open("ab")
        self.workers[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                self.module,
                "--redis-url",
                self.url,
                "--model",
                str(self.model_dir),
                "--worker-id",
                name,
                "--health-file",
                str(self.root / f"{name}.health"),
                *flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()

    def signal(self, name: str, signum: int) -> None:
        self.workers[name].send_signal(signum)

    def wait_or_dump(self, name: str, timeout: float) -> int:
        """The exit code; a worker still running after `timeout` dumps its threads' stacks into its log
        (SIGUSR1) and is killed, so a hang shows where it hung."""
        process = self.workers[name]
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)
            time.sleep(2)
            process.kill()
            return process.wait(timeout=30) or -9

    def kill(self, name: str) -> None:
        self.workers[name].send_signal(signal.SIGKILL)
        self.workers[name].wait(timeout=30)

    def restart_redis(self) -> None:
        """Stops Redis (it writes its AOF on the way down) and starts it again on the same port and files."""
        self.server.stop()
        self.server.start()

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def engine_failures(self) -> int:
        """Engine thread deaths in every worker's log (the library logs each one, as an error)."""
        return sum(path.read_text(errors="replace").count(ENGINE_DIED) for path in self.root.glob("*.log"))

    def alive(self) -> list[str]:
        return [name for name, process in self.workers.items() if process.poll() is None]

    def stop(self) -> dict[str, int]:
        """SIGTERM to every worker; returns their exit codes."""
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        return {name: self.wait_or_dump(name, 60) for name in self.workers}

    def close(self) -> None:
        self.stop()
        self.server.stop()


async def wait_for_workers(client: AsyncClient, count: int) -> None:
    async with asyncio.timeout(120):
        while len((await client.status()).workers) < count:
            await asyncio.sleep(0.2)


async def expected_outputs(model_dir: Path, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
    """The engine's own greedy output for each prompt, in this process."""
    model, tokenizer = load_model(str(model_dir), LoadOptions(cache_dir=model_dir / "cache"))
    async with Engine(model, tokenizer, EngineConfig(kv_cache_tokens=8192, page_size=16, max_running=64)) as engine:
        streams = [
            engine.submit(
                EngineRequest(
                    f"x{i}", input_ids=p, params=GenerationParams(max_new_tokens=n, temperature=0, ignore_eos=True)
                )
            )
            for i, (p, n) in enumerate(zip(prompts, max_new_tokens, strict=True))
        ]
        return [[t async for d in s for t in d.token_ids] for s in streams]


@dataclass
class StreamCheck:
    tokens: list[int]
    gaps: int
    duplicates: int
    terminal: str | None


async def check_stream(redis: Redis, request_id: str) -> StreamCheck:
    """Reads a result stream raw: `seq` must run 0..n-1 with no gap and no repeat, then one terminal event."""
    tokens: list[int] = []
    gaps = duplicates = 0
    terminal = None
    for _, fields in await redis.xrange(KEYS.result(request_id)):
        event = decode_event(fields[ENTRY_FIELD])
        if terminal is not None:
            duplicates += 1  # anything after the end
        elif event.type == "tokens":
            if event.seq < len(tokens):
                duplicates += 1
            elif event.seq > len(tokens):
                gaps += 1
            else:
                tokens.extend(event.ids)
        else:
            terminal = event.finish_reason if event.type == "done" else f"error:{event.code}"
    return StreamCheck(tokens, gaps, duplicates, terminal)


async def unbounded_keys(redis: Redis) -> list[str]:
    """Keys of ours that can grow without limit: every per-request key must carry a TTL."""
    held = {KEYS.held(lane) for lane in KEYS.lanes}  # emptied as workers move them, as the lanes' streams are
    bounded_by_design = {*KEYS.lanes.values(), *held, KEYS.dead, KEYS.workers, KEYS.prefix_caches}  # or trimmed, pruned
    bounded_by_design |= {KEYS.tenant_limits, KEYS.tenant_counts, KEYS.tenant_running}  # by tenants, running requests
    found = []
    async for key in redis.scan_iter(match=f"{KEYS.tag}*", count=1000):
        name = key.decode()
        if name not in bounded_by_design and await redis.ttl(name) < 0:
            found.append(name)
    return found


def malformed_entries(count: int, seed: int) -> list[bytes]:
    """Random bytes, random msgpack values, and maps that look like requests but are not valid."""
    import random

    rng = random.Random(seed)
    makers = [
        lambda: rng.randbytes(rng.randint(0, 64)),
        lambda: msgpack.packb([rng.random() for _ in range(rng.randint(0, 5))]),
        lambda: msgpack.packb({"v": rng.choice([0, 2, "1", None]), "id": f"bad-{rng.random()}"}),
        lambda: msgpack.packb({"v": 1, "id": f"bad-{rng.randrange(10**9)}", "prompt": rng.choice(["", None, 5])}),
        lambda: msgpack.packb(
            {
                "v": 1,
                "id": f"bad-{rng.randrange(10**9)}",
                "input_ids": [rng.randint(-5, 10**7)],
                "params": {"temperature": rng.choice([-1.0, "hot", float("nan")])},
                "submitted": 0,
            }
        ),
        lambda: msgpack.packb({"v": 1, "id": "no spaces allowed!", "prompt": "x", "submitted": 0}),
        lambda: msgpack.packb({rng.randbytes(3): rng.randbytes(3) for _ in range(3)}),
    ]
    return [rng.choice(makers)() for _ in range(count)]


def hostile_entries(count: int, killer_top_p: float | None) -> list[tuple[str, bytes]]:
    """(request id, raw entry) of `count` hostile requests, cycling through kinds that each once stalled a
    worker or went unanswered: values past the library's or Redis' bounds, broken versions and encodings,
    and (with `killer_top_p`, for `testing.poison` workers) a request that kills the engine thread."""

    def request(rid: str, **fields: object) -> dict[str, object]:
        base: dict[str, object] = {"v": 1, "id": rid, "input_ids": [3, 4, 5], "submitted": ms_now()}
        return {**base, "params": {"max_new_tokens": 8, "temperature": 0.0}, **fields}

    kinds: list[tuple[str, object]] = [
        ("top-k-int32", {"params": {"max_new_tokens": 8, "temperature": 1.0, "top_k": 2**31}}),
        ("ttl-past-expire", {"result_ttl": 2**62}),
        ("no-version", {"v": None}),
        ("string-version", {"v": "1"}),
        ("not-utf8", {"prompt": "bad \udcff", "input_ids": None}),
        ("nan-temperature", {"params": {"temperature": float("nan")}}),
        ("inf-temperature", {"params": {"temperature": float("inf")}}),
        ("deadline-past-int64", {"deadline": 2**63 - 1}),
        ("id-past-int32", {"input_ids": [2**40]}),
        ("id-past-vocab", {"input_ids": [3, 100_000]}),
        ("over-context", {"input_ids": [3] * 600}),
        ("huge-max-new-tokens", {"params": {"max_new_tokens": 2**40}}),
        ("params-a-list", {"params": [1, 2]}),
        ("future-version", {"v": 2}),
        ("too-many-stops", {"params": {"max_new_tokens": 8, "stop": ["x"] * 100}}),
        ("content-not-text", {"messages": [{"role": "user", "content": 5}], "input_ids": None}),
    ]
    if killer_top_p is not None:
        kinds.append(("engine-killer", {"params": {"max_new_tokens": 8, "temperature": 1.0, "top_p": killer_top_p}}))
    entries = []
    for index in range(count):
        kind, fields = kinds[index % len(kinds)]
        rid = f"hostile-{kind}-{index}"
        body = {k: v for k, v in request(rid, **fields).items() if v is not None or k == "v"}
        if body.get("v") is None:
            del body["v"]
        entries.append((rid, msgpack.packb(body, unicode_errors="surrogateescape")))
    return entries


@dataclass
class FaultReport:
    requests: int = 0
    completed: int = 0
    lost: int = 0
    gaps: int = 0
    duplicates: int = 0
    wrong_outputs: int = 0
    kills: int = 0
    stops: int = 0
    terms: int = 0
    redis_restarts: int = 0
    malformed: int = 0
    unbounded_keys: int = 0
    requests_left: int = 0
    dead_letters: int = 0
    poison_sent: int = 0
    poison_answered: int = 0  # a typed error within 30 s
    engine_restarts: int = 0
    stuck_workers: int = 0  # did not exit 0 by themselves on SIGTERM
    held_keys: int = 0  # cache affinity's keys with a holder at the end
    usage_requests: int = 0  # requests counted in the tenants' usage
    usage_generated: int = 0  # generated tokens counted there
    generated: int = 0  # generated tokens the clients saw
    quota_state_left: dict[str, int] = field(default_factory=dict)  # tenants' queued and running counts at the end
    exit_codes: dict[str, int] = field(default_factory=dict)


async def run_faults(
    cluster: Cluster,
    *,
    requests: int,
    faults: list[str],
    malformed: int,
    seed: int,
    hostile: list[tuple[str, bytes]] | None = None,
    shared_starts: int = 0,
    tenants: dict[str, TenantLimits] | None = None,
) -> FaultReport:
    """Streams `requests` greedy requests through the cluster's workers while injecting `faults` (each one of
    kill, stop, term, redis) at random moments and interleaving `malformed` bad entries and `hostile`
    requests (each must be answered with a typed error within 30 s); then checks. With `shared_starts`, the
    prompts begin with one of that many 80-token starts, so cache affinity gives each start a holder. With
    `tenants` (name -> quotas), the requests are theirs in turn, under those quotas."""
    import random

    rng = random.Random(seed)
    starts = [[rng.randrange(3, 300) for _ in range(80)] for _ in range(shared_starts)]
    prompts = [
        [*(starts[i % shared_starts] if starts else []), *(rng.randrange(3, 300) for _ in range(rng.randint(2, 40)))]
        for i in range(requests)
    ]
    lengths = [rng.randint(60, 160) for _ in range(requests)]
    expected = await expected_outputs(cluster.model_dir, prompts, lengths)
    hostile = list(hostile or [])
    report = FaultReport(requests=requests, malformed=malformed, poison_sent=len(hostile))
    bad = malformed_entries(malformed, seed)
    answers = []
    # One blocking XREAD per request in flight: the pool must hold them all.
    async with (
        AsyncClient(cluster.url, max_queue_len=0, max_connections=requests + len(hostile) + 16) as client,
        Redis.from_url(cluster.url) as redis,
    ):
        await wait_for_workers(client, len(cluster.workers))
        for tenant, limits in (tenants or {}).items():
            await redis.hset(KEYS.tenant_limits, tenant, limits.pack())
        owners = list(tenants or {}) or [None]
        jobs = []
        per_request = max(1, len(bad) // max(1, requests))
        every = max(1, requests // max(1, len(hostile)))
        for index, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
            owner = owners[index % len(owners)]
            jobs.append(
                await client.submit(
                    input_ids=prompt, max_new_tokens=length, temperature=0, ignore_eos=True, tenant=owner
                )
            )
            for _ in range(per_request):
                if bad:
                    await redis.xadd(KEYS.requests, {ENTRY_FIELD: bad.pop()})
            if hostile and index % every == 0:
                answers.append(asyncio.create_task(_typed_error_in_time(client, redis, *hostile.pop())))
        for entry in bad:
            await redis.xadd(KEYS.requests, {ENTRY_FIELD: entry})
        answers += [asyncio.create_task(_typed_error_in_time(client, redis, *entry)) for entry in hostile]
        injector = asyncio.create_task(_inject(cluster, faults, rng, report, client))
        results = await asyncio.gather(*(job.result(timeout=300) for job in jobs), return_exceptions=True)
        report.poison_answered = sum(await asyncio.gather(*answers))
        await injector
        report.completed = sum(1 for r in results if not isinstance(r, BaseException))
        report.lost = requests - report.completed
        report.generated = sum(r.usage.completion_tokens for r in results if not isinstance(r, BaseException))
    # A fresh connection for the checks: the one above may have outlived a Redis restart.
    async with Redis.from_url(cluster.url) as redis:
        for job, want in zip(jobs, expected, strict=True):
            check = await check_stream(redis, job.id)
            report.gaps += check.gaps
            report.duplicates += check.duplicates
            report.wrong_outputs += check.tokens != want
        with contextlib.suppress(TimeoutError):  # the last acknowledgements and dead letters land
            async with asyncio.timeout(30):
                while await redis.xlen(KEYS.requests):
                    await asyncio.sleep(0.2)
        report.requests_left = await redis.xlen(KEYS.requests)
        report.dead_letters = await redis.xlen(KEYS.dead)
        report.unbounded_keys = len(await unbounded_keys(redis))
        report.held_keys = await redis.hlen(KEYS.affinity_holders)
        if tenants:
            hour = int(time.time()) // 3600  # and the one before: a run may cross an hour
            hours = [await redis.hgetall(KEYS.usage(h)) for h in (hour - 1, hour)]
            counted = [(k, int(v)) for usage in hours for k, v in usage.items()]
            report.usage_requests = sum(v for k, v in counted if b"|requests|" in k)
            report.usage_generated = sum(v for k, v in counted if k.endswith(b"|generated_tokens"))
            counts = await redis.hgetall(KEYS.tenant_counts)
            kept = (b"|queued", b"|queued_tokens", b"|running")
            report.quota_state_left = {k.decode(): int(v) for k, v in counts.items() if k.endswith(kept)}
    report.exit_codes.update(cluster.stop())
    report.stuck_workers = sum(code != 0 for code in report.exit_codes.values())
    report.engine_restarts = cluster.engine_failures()
    return report


async def _typed_error_in_time(client: AsyncClient, redis: Redis, request_id: str, raw: bytes) -> bool:
    """Adds a hostile entry; True when its reader gets a typed error (an `error` event) within 30 s."""
    await redis.xadd(KEYS.requests, {ENTRY_FIELD: raw})
    try:
        await AsyncJob.attach(client, request_id).result(timeout=30)
    except RequestFailed:
        return True
    except (LLMQError, RedisError):
        return False
    return False


async def _restart(cluster: Cluster, name: str, client: AsyncClient) -> None:
    """Starts the worker again and waits until it serves, so the next fault meets a running worker (a
    signal during interpreter start-up, before any handler exists, would say nothing about the service)."""
    since = ms_now()
    cluster.start_worker(name)
    async with asyncio.timeout(120):
        while True:
            with contextlib.suppress(RedisError):  # a connection may have outlived a Redis restart
                if any(w.id == name and w.started >= since for w in (await client.status()).workers):
                    return
            await asyncio.sleep(0.1)


async def _inject(cluster: Cluster, faults: list[str], rng: object, report: FaultReport, client: AsyncClient) -> None:
    for fault in faults:
        await asyncio.sleep(rng.uniform(0.3, 1.5))  # type: ignore[attr-defined]
        while not cluster.alive():
            await asyncio.sleep(0.2)
        name = rng.choice(cluster.alive())  # type: ignore[attr-defined]
        if fault == "kill":
            cluster.kill(name)
            await _restart(cluster, name, client)
            report.kills += 1
        elif fault == "stop":  # paused past its lease: others claim; on waking it must write nothing
            cluster.signal(name, signal.SIGSTOP)
            await asyncio.sleep(float(WORKER_FLAGS["--lease-timeout-s"]) + 1.5)
            cluster.signal(name, signal.SIGCONT)
            report.stops += 1
        elif fault == "term":
            cluster.signal(name, signal.SIGTERM)
            code = await asyncio.to_thread(cluster.wait_or_dump, name, 60)
            report.exit_codes[f"{name}-term-{report.terms}"] = code
            await _restart(cluster, name, client)
            report.terms += 1
        elif fault == "redis":
            await asyncio.to_thread(cluster.restart_redis)
            report.redis_restarts += 1
