"""Memory soak: one worker process, the gateway in its own process and a client process (which never imports
torch), all on one Redis started here, fed a fixed count of mixed requests while each process's RSS is sampled.

    python -m bench.soak [--quick] [--requests 5000] [--model tiny|smollm2] [--concurrency 24] [--seed 0]

A leak that costs a few hundred bytes a request never shows in a short benchmark but fills a machine in a week,
so this one runs long and looks only at memory. The mix is meant to reach every path that keeps per-request
state: prompts of 1 to 2,000 tokens (many short, some long, and the chunk and page edges), 1-64 new tokens,
greedy and seeded sampling, penalties, logprobs, JSON schemas, regexes, stop strings, cancels mid-stream,
streamed and whole answers, through `AsyncClient`, `Client` and the gateway's `/v1/completions` and
`/v1/chat/completions`; each request is drawn from its own seeded `random.Random`, so a run is reproducible.
RSS (`VmRSS`) is sampled every `--sample-every` completed requests. Reported per process: RSS at load (before
any traffic), after 500 requests, at the end, the peak (`VmHWM`), and the growth over the second half of the
run in MB per 1,000 requests (least-squares slope, and end minus middle). Targets, printed beside the figures
but not enforced: each growth <= 1.0 MB per 1,000 requests, 0 errors. `completed` counts every request that
ended; one that ends `cancelled` (or that the client cancels by disconnecting) is no error, one answered with an
error event, an exception or an HTTP error is (counted by kind, the first few printed). The default model is a
tiny random Llama (`testing/tiny_models.py`): 5,000 requests took 2-3 minutes on 2 cores (`--requests 20000`
soaks for about 10); `--model smollm2` runs the real default model, far slower.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.workload import print_json
from client import AsyncClient, Cancelled, Client, LLMQError, RequestFailed
from worker.embedded_redis import RedisServer, free_port

TIMEOUT_S = 600.0  # per request: a stuck request is an error, not a hung benchmark
TARGET_GROWTH_MB_PER_1K = 1.0
PROCESSES = ("worker", "gateway", "client")
SMOLLM2_VOCAB = 49152
# The tiny tokenizer's corpus (`testing/tiny_models.py`): about 1.3 tokens a word.
WORDS = (
    *("The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog.", "Continuous", "batching", "lets"),
    *("short", "requests", "finish", "early.", "Paris", "is", "capital", "of", "France;", "Tokyo", "Japan."),
    *("def", "main():", "return", "42"),
)
EXTRA_WORDS = ("emoji", "😀🚀🎉", "日本語の文章", "中文字符", "한국어")  # multi-byte text, now and then
# The engine's chunk (512 tokens) and page (32) edges, and the longest prompt.
EDGE_LENGTHS = (1, 2, 31, 32, 33, 63, 64, 65, 511, 512, 513, 1023, 1024, 1025, 1999, 2000)
# A fixed set, so the worker's bounded grammar cache fills once and what grows after is a leak.
FORMATS: tuple[dict[str, Any], ...] = (
    {
        "type": "json_schema",
        "json_schema": {
            "name": "label",
            "schema": {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]}}, "required": ["label"]},
        },
    },
    {
        "type": "json_schema",
        "json_schema": {
            "name": "person",
            "schema": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            },
        },
    },
    {"type": "json_schema", "json_schema": {"name": "list", "schema": {"type": "array", "items": {"type": "number"}}}},
    {"type": "json_object"},
    {"type": "regex", "regex": "[a-z]{1,8}( [a-z]{1,8}){0,5}"},
)
STOPS = ("\n", ".", " the", "}", "e", "42")
ROUTES = (("client", 0.25), ("client-result", 0.15), ("client-sync", 0.1), ("completions", 0.2), ("chat", 0.3))


# ---------------------------------------------------------------- the requests (pure) ----------------------------


@dataclass(frozen=True)
class Plan:
    """One request of the mix: where it goes, what it asks, and after how many deltas it is cancelled."""

    index: int
    route: str  # client (streamed), client-result, client-sync (`Client` in a thread), completions, chat
    stream: bool
    content: list[int] | str  # input_ids, or the text of a prompt or a chat message
    as_messages: bool
    max_new_tokens: int
    sampling: dict[str, Any]
    top_logprobs: int | None  # None: no logprobs
    response_format: dict[str, Any] | None
    stop: list[str] | None
    ignore_eos: bool
    cancel_after: int | None  # deltas seen before cancelling (streams only)


def make_plan(index: int, seed: int, vocab: int) -> Plan:
    """Request `index` of the mix, the same in every run with the same seed, whatever order the others finish."""
    rng = random.Random(f"soak:{seed}:{index}")
    route = rng.choices([name for name, _ in ROUTES], [share for _, share in ROUTES])[0]
    stream = route == "client" or (route in ("client-sync", "completions", "chat") and rng.random() < 0.5)
    length = prompt_length(rng)
    as_ids = route != "chat" and rng.random() < 0.5
    content: list[int] | str = [rng.randrange(3, vocab) for _ in range(length)] if as_ids else prompt_text(rng, length)
    response_format = rng.choice(FORMATS) if rng.random() < 0.12 else None
    return Plan(
        index=index,
        route=route,
        stream=stream,
        content=content,
        as_messages=route == "chat" or (not as_ids and route.startswith("client") and rng.random() < 0.4),
        max_new_tokens=rng.choice((1, 64)) if rng.random() < 0.2 else rng.randint(1, 64),
        sampling=sampling(rng),
        top_logprobs=rng.randint(0, 5) if rng.random() < 0.2 else None,
        response_format=response_format,
        stop=rng.sample(STOPS, rng.randint(1, 3)) if rng.random() < 0.15 else None,
        ignore_eos=response_format is None and route.startswith("client") and rng.random() < 0.3,
        cancel_after=rng.randint(1, 3) if stream and rng.random() < 0.1 else None,
    )


def prompt_length(rng: random.Random) -> int:
    """Tokens of a prompt: mostly short, some long, and the engine's edges now and then."""
    draw = rng.random()
    if draw < 0.06:
        return rng.choice(EDGE_LENGTHS)
    if draw < 0.6:
        return rng.randint(1, 32)
    if draw < 0.8:
        return rng.randint(33, 256)
    if draw < 0.92:
        return rng.randint(257, 1024)
    return rng.randint(1025, 2000)


def prompt_text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of text (at most that many with the tiny tokenizer: ~1.3 tokens a word)."""
    words = [rng.choice(EXTRA_WORDS) if rng.random() < 0.02 else rng.choice(WORDS) for _ in range(tokens * 2 // 3)]
    return " ".join(words) or "Hi"


def sampling(rng: random.Random) -> dict[str, Any]:
    """Greedy, seeded sampling, or unseeded sampling; penalties now and then."""
    draw = rng.random()
    params: dict[str, Any] = {"temperature": 0}
    if draw >= 0.4:
        params = {"temperature": round(rng.uniform(0.5, 1.5), 2), "top_p": rng.choice((1.0, 0.9, 0.5))}
        if rng.random() < 0.3:
            params["top_k"] = rng.choice((1, 20, 100))
        if draw < 0.85:
            params["seed"] = rng.randrange(2**32)
    if rng.random() < 0.1:
        params |= {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    return params


def client_options(plan: Plan) -> dict[str, Any]:
    """`submit` keyword arguments of a client request."""
    options: dict[str, Any] = {"max_new_tokens": plan.max_new_tokens, **plan.sampling}
    if isinstance(plan.content, list):
        options["input_ids"] = plan.content
    elif plan.as_messages:
        options["messages"] = [{"role": "user", "content": plan.content}]
    else:
        options["prompt"] = plan.content
    if plan.top_logprobs is not None:
        options |= {"logprobs": True, "top_logprobs": plan.top_logprobs}
    if plan.response_format is not None:
        options["response_format"] = plan.response_format
    if plan.stop is not None:
        options["stop"] = plan.stop
    if plan.ignore_eos:
        options["ignore_eos"] = True
    return options


def http_body(plan: Plan, model: str) -> tuple[str, dict[str, Any]]:
    """The gateway route and OpenAI body of a gateway request."""
    body: dict[str, Any] = {"model": model, "max_tokens": plan.max_new_tokens, "stream": plan.stream, **plan.sampling}
    if plan.route == "chat":
        url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": plan.content}]
        if plan.top_logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": plan.top_logprobs}
    else:
        url, body["prompt"] = "/v1/completions", plan.content
        if plan.top_logprobs is not None:
            body["logprobs"] = plan.top_logprobs
    if plan.response_format is not None:
        body["response_format"] = plan.response_format
    if plan.stop is not None:
        body["stop"] = plan.stop
    if plan.stream and plan.index % 2:
        body["stream_options"] = {"include_usage": True}
    return url, body


# ---------------------------------------------------------------- the client process ----------------------------


@dataclass(frozen=True)
class Ending:
    """How one request ended: `ok`, `cancelled` or `error`; `detail` is the finish reason or the error's kind."""

    kind: str
    detail: str
    tokens: int = 0
    message: str = ""


def finished(reason: str | None, tokens: int) -> Ending:
    return Ending("cancelled" if reason == "cancelled" else "ok", reason or "none", tokens)


def failed(error: BaseException) -> Ending:
    if isinstance(error, Cancelled):  # `result()` of a cancelled request: not an error
        return Ending("cancelled", "cancelled", len(error.result.token_ids))
    kind = type(error).__name__
    if isinstance(error, RequestFailed):
        kind = f"{kind}:{error.code}"
    return Ending("error", kind, message=str(error)[:300])


async def via_client(client: AsyncClient, plan: Plan) -> Ending:
    job = await client.submit(**client_options(plan))
    if not plan.stream:
        result = await job.result(timeout=TIMEOUT_S)
        return finished(result.finish_reason, len(result.token_ids))
    deltas = tokens = 0
    async for delta in job.stream(timeout=TIMEOUT_S):
        deltas, tokens = deltas + 1, tokens + len(delta.token_ids)
        if deltas == plan.cancel_after:
            await job.cancel()
    return finished(job.finish_reason, tokens)


def via_sync_client(client: Client, plan: Plan) -> Ending:
    """The blocking twin, in a thread of its own (its reader thread serves every such thread)."""
    try:
        job = client.submit(**client_options(plan))
        if not plan.stream:
            result = job.result(timeout=TIMEOUT_S)
            return finished(result.finish_reason, len(result.token_ids))
        deltas = tokens = 0
        for delta in job.stream(timeout=TIMEOUT_S):
            deltas, tokens = deltas + 1, tokens + len(delta.token_ids)
            if deltas == plan.cancel_after:
                job.cancel()
        return finished(job.finish_reason, tokens)
    except LLMQError as error:
        return failed(error)


def http_error(status: int, content: bytes) -> Ending:
    try:
        error = json.loads(content)["error"]
        code, message = error.get("code"), error.get("message", "")
    except (ValueError, KeyError, TypeError):
        code, message = None, content[:300].decode(errors="replace")
    return Ending("error", f"http {status}:{code}", message=str(message)[:300])


@dataclass
class Events:
    """What a gateway stream has said so far. Its lines are split on bytes, at LF only (as SSE and the OpenAI SDK
    do): httpx's `aiter_lines` also breaks at U+0085 and U+2028, which the JSON of a chunk may hold raw."""

    plan: Plan
    deltas: int = 0
    finish: str | None = None
    usage: int | None = None
    _rest: bytes = b""

    def data(self, chunk: bytes) -> list[bytes]:
        """The `data:` payloads completed by `chunk`."""
        *lines, self._rest = (self._rest + chunk).split(b"\n")
        return [line[6:].rstrip(b"\r") for line in lines if line.startswith(b"data: ")]

    def take(self, data: bytes) -> Ending | None:
        """How the request ended, once this payload says so (or once it is to be cancelled)."""
        if data == b"[DONE]":
            return finished(self.finish, self.deltas if self.usage is None else self.usage)
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"] or {}
            return Ending("error", f"sse:{error.get('code')}", message=str(error.get("message"))[:300])
        if chunk.get("usage"):
            self.usage = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or ():
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text or choice.get("logprobs"):
                self.deltas += 1
            self.finish = choice.get("finish_reason") or self.finish
        if self.plan.cancel_after is not None and self.deltas >= self.plan.cancel_after:
            return Ending("cancelled", "disconnect", self.deltas)
        return None


async def read_events(response: httpx.Response, plan: Plan) -> Ending:
    """Reads a stream to `data: [DONE]`; leaving early (a cancel) closes the connection, which cancels it."""
    events = Events(plan)
    async for chunk in response.aiter_bytes():
        for data in events.data(chunk):
            ending = events.take(data)
            if ending is not None:
                return ending
    return Ending("error", "sse:truncated", message="the stream ended without data: [DONE]")


async def via_gateway(http: httpx.AsyncClient, model: str, plan: Plan) -> Ending:
    url, body = http_body(plan, model)
    if not plan.stream:
        response = await http.post(url, json=body)
        if response.status_code != 200:
            return http_error(response.status_code, response.content)
        answer = response.json()
        return finished(answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"])
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return http_error(response.status_code, await response.aread())
        return await read_events(response, plan)


@dataclass
class Driver:
    """The client process's state: its three ways in, and the tally it reports to the parent on stdout."""

    aclient: AsyncClient
    sclient: Client
    http: httpx.AsyncClient
    model: str
    seed: int
    vocab: int
    completed: int = 0
    tokens: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    details: Counter[str] = field(default_factory=Counter)
    routes: Counter[str] = field(default_factory=Counter)
    first_errors: list[str] = field(default_factory=list)

    async def one(self, plan: Plan) -> Ending:
        try:
            if plan.route in ("client", "client-result"):
                return await via_client(self.aclient, plan)
            if plan.route == "client-sync":
                return await asyncio.to_thread(via_sync_client, self.sclient, plan)
            return await via_gateway(self.http, self.model, plan)
        except LLMQError as error:
            return failed(error)
        except (httpx.HTTPError, ValueError, KeyError) as error:
            return Ending("error", type(error).__name__, message=str(error)[:300])

    async def lane(self, indices: Iterator[int]) -> None:
        """One of `--concurrency` loops, each taking the next request when its last one ends."""
        for index in indices:
            plan = make_plan(index, self.seed, self.vocab)
            self.note(plan, await self.one(plan))

    def note(self, plan: Plan, ending: Ending) -> None:
        self.completed += 1
        self.tokens += ending.tokens
        self.kinds[ending.kind] += 1
        self.details[f"{ending.kind}:{ending.detail}" if ending.kind == "error" else ending.detail] += 1
        self.routes[plan.route + (" stream" if plan.stream else "")] += 1
        if ending.kind == "error" and len(self.first_errors) < 5:
            self.first_errors.append(f"#{plan.index} {plan.route}: {ending.detail}: {ending.message}")
        # Python's own live allocations beside each count: RSS that grows while these do not is the allocator
        # keeping freed memory (fragmentation), not objects kept alive.
        print(f"progress {self.completed} {self.kinds['error']} {sys.getallocatedblocks()}", flush=True)

    def summary(self) -> dict[str, Any]:
        return {
            "completed": self.completed,
            "ok": self.kinds["ok"],
            "cancelled": self.kinds["cancelled"],
            "errors": self.kinds["error"],
            "tokens": self.tokens,
            "endings": dict(self.details),
            "routes": dict(self.routes),
            "first_errors": self.first_errors,
            "torch_imported": "torch" in sys.modules,
        }


async def drive(args: argparse.Namespace) -> None:
    """The client process: opens its clients, says `ready`, waits for `go` on stdin, runs the mix."""
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with (
        AsyncClient(args.redis_url, max_queue_len=0) as aclient,
        httpx.AsyncClient(base_url=args.gateway_url, limits=limits, timeout=TIMEOUT_S) as http,
    ):
        with Client(args.redis_url, max_queue_len=0) as sclient:
            driver = Driver(aclient, sclient, http, args.model_id, args.seed, args.vocab)
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            indices = iter(range(args.requests))
            await asyncio.gather(*(driver.lane(indices) for _ in range(args.concurrency)))
    print("final " + json.dumps(driver.summary()), flush=True)


# ---------------------------------------------------------------- the parent: processes and samples -------------


def status_mb(pid: int, field_name: str) -> float:
    """`VmRSS` or `VmHWM` (the peak) of a process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field_name} for process {pid}")


def start_worker(url: str, model: str, cache: Path | None, workdir: Path) -> subprocess.Popen[bytes]:
    flags: dict[str, Any] = {
        "--redis-url": url,
        "--model": model,
        "--read-block-ms": 20,
        "--heartbeat-s": 0.5,
        "--metrics-port": 0,
        "--health-file": workdir / "worker.health",
        "--log-level": "warning",
    }
    if cache is not None:
        flags["--model-cache-dir"] = cache
    args = [str(part) for pair in flags.items() for part in pair]
    log = (workdir / "worker.log").open("wb")
    return subprocess.Popen([sys.executable, "-m", "worker", *args], stdout=log, stderr=subprocess.STDOUT)


def wait_for_worker(url: str, worker: subprocess.Popen[bytes], workdir: Path) -> None:
    deadline = time.monotonic() + 900  # converting SmolLM2 on a first run takes minutes
    with Client(url) as client:
        while not client.status().workers:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not come up; see {workdir / 'worker.log'}")
            time.sleep(0.2)


def start_gateway(url: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """The gateway on a free port, once it lists the worker's model; returns it, its URL and the model id."""
    port = free_port()
    command = [sys.executable, "-m", "gateway", "--redis-url", url, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--log-level", "warning", "--max-queue-len", "0"]
    log = (workdir / "gateway.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if process.poll() is not None:
            break
        try:
            models = httpx.get(base + "/health").json().get("models", [])
            if models:
                return process, base, models[0]
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop(process)
    raise RuntimeError(f"the gateway did not come up; see {workdir / 'gateway.log'}")


def start_client(
    args: argparse.Namespace, url: str, base: str, model_id: str, vocab: int, workdir: Path
) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "bench.soak", "--drive", "--redis-url", url, "--gateway-url", base]
    command += ["--model-id", model_id, "--vocab", str(vocab), "--requests", str(args.requests)]
    command += ["--concurrency", str(args.concurrency), "--seed", str(args.seed)]
    log = (workdir / "client.log").open("wb")
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)


def lines_of(stream: Any) -> queue.Queue[str | None]:
    """The stream's lines, read by a thread (None at its end), so the parent can watch the others meanwhile."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


@dataclass
class Samples:
    """RSS of every process, keyed by completed requests, with seconds since the traffic started."""

    pids: dict[str, int]
    rows: list[tuple[int, float, dict[str, float]]] = field(default_factory=list)
    blocks: list[tuple[int, int]] = field(default_factory=list)  # the client's `sys.getallocatedblocks()`
    started: float = field(default_factory=time.monotonic)

    def take(self, completed: int) -> dict[str, float]:
        rss = {name: status_mb(pid, "VmRSS") for name, pid in self.pids.items()}
        self.rows.append((completed, time.monotonic() - self.started, rss))
        return rss

    def at(self, completed: int) -> dict[str, float]:
        """The first sample at or past `completed` (the last one for a shorter run)."""
        return next((rss for count, _, rss in self.rows if count >= completed), self.rows[-1][2])

    def write(self, path: Path) -> None:
        header = "completed,seconds," + ",".join(f"{name}_rss_mb" for name in self.pids)
        body = [f"{c},{t:.2f}," + ",".join(f"{rss[n]:.2f}" for n in self.pids) for c, t, rss in self.rows]
        path.write_text("\n".join([header, *body]) + "\n")


def wait_line(lines: queue.Queue[str | None], watched: dict[str, subprocess.Popen[Any]], workdir: Path) -> str:
    """The client's next line, failing (with where the logs are) if it or another process ends meanwhile."""
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            line = ""
        if line is None:
            raise RuntimeError(f"the client process ended early; see {workdir / 'client.log'}")
        if line:
            return line
        for name, process in watched.items():
            if process.poll() is not None:
                raise RuntimeError(f"the {name} exited (status {process.returncode}); see {workdir / name}.log")


def follow(
    client: subprocess.Popen[str], watched: dict[str, subprocess.Popen[Any]], args: argparse.Namespace, workdir: Path
) -> tuple[dict[str, Any], Samples, dict[str, float]]:
    """Runs the traffic: `go`, then a sample every `--sample-every` completed requests; returns the client's
    summary, the samples and each process's peak RSS."""
    assert client.stdin is not None and client.stdout is not None
    lines = lines_of(client.stdout)
    while wait_line(lines, watched, workdir) != "ready":
        pass
    samples = Samples({name: process.pid for name, process in watched.items()})
    samples.take(0)
    client.stdin.write("go\n")
    client.stdin.flush()
    shown = args.sample_every * max(1, args.requests // 10 // args.sample_every)  # about 10 progress lines
    while not (line := wait_line(lines, watched, workdir)).startswith("final "):
        _, completed, errors, blocks = line.split()
        count = int(completed)
        if count % args.sample_every == 0 or count == args.requests:
            rss = samples.take(count)
            samples.blocks.append((count, int(blocks)))
            if count % shown == 0:
                figures = ", ".join(f"{name} {mb:.0f} MB" for name, mb in rss.items())
                print(
                    f"  {count:5d}/{args.requests} requests, {time.monotonic() - samples.started:6.0f} s, "
                    f"errors {errors}: {figures}",
                    flush=True,
                )
    peaks = {name: status_mb(process.pid, "VmHWM") for name, process in watched.items()}
    return json.loads(line.removeprefix("final ")), samples, peaks


def stop(process: subprocess.Popen[Any], timeout_s: float = 60) -> None:
    """terminate, then kill if it has not exited within `timeout_s` (the worker drains on SIGTERM)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tiny_model(workdir: Path) -> tuple[str, int]:
    """A tiny random Llama whose context holds a 2,000-token prompt and 64 new tokens; (folder, vocab size)."""
    from testing.tiny_models import save_tiny_model  # here only: the parent may carry torch, the client must not

    folder = save_tiny_model(workdir / "model", "llama", max_positions=4096)
    return str(folder), json.loads((folder / "config.json").read_text())["vocab_size"]


def metric_lines(base: str) -> int:
    """Series the gateway's /metrics shows: label sets that grow with traffic would be a leak too."""
    return sum(1 for line in httpx.get(base + "/metrics").text.splitlines() if line and not line.startswith("#"))


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model, vocab = tiny_model(workdir) if args.model == "tiny" else ("smollm2", SMOLLM2_VOCAB)
    server = RedisServer(workdir / "redis").start()
    processes: list[subprocess.Popen[Any]] = []
    try:
        worker = start_worker(server.url, model, workdir / "cache" if args.model == "tiny" else None, workdir)
        processes.append(worker)
        wait_for_worker(server.url, worker, workdir)
        gateway, base, model_id = start_gateway(server.url, workdir)
        processes.append(gateway)
        client = start_client(args, server.url, base, model_id, vocab, workdir)
        processes.append(client)
        series_load = metric_lines(base)
        watched: dict[str, subprocess.Popen[Any]] = {"worker": worker, "gateway": gateway, "client": client}
        summary, samples, peaks = follow(client, watched, args, workdir)
        summary |= {"gateway_metric_series_load": series_load, "gateway_metric_series_end": metric_lines(base)}
        client.wait(timeout=60)
    finally:
        for process in reversed(processes):
            stop(process)
        server.stop()
    samples.write(workdir / "samples.csv")
    return report(args, summary, samples, peaks)


# ---------------------------------------------------------------- the figures -----------------------------------


def growth(samples: Samples, name: str, requests: int) -> tuple[float, float]:
    """MB per 1,000 requests over the second half of the run: least-squares slope, and end minus middle."""
    return second_half_slopes([(count, rss[name]) for count, _, rss in samples.rows], requests)


def second_half_slopes(points: list[tuple[int, float]], requests: int) -> tuple[float, float]:
    """Growth per 1,000 requests of (completed, value) points past the middle: the slope and end minus middle."""
    half = [(count, value) for count, value in points if count >= requests / 2]
    if len(half) < 2:
        return 0.0, 0.0
    counts, mbs = [c for c, _ in half], [mb for _, mb in half]
    slope = statistics.linear_regression(counts, mbs).slope
    return slope * 1000, (mbs[-1] - mbs[0]) / (counts[-1] - counts[0]) * 1000


def process_figures(samples: Samples, peaks: dict[str, float], name: str, requests: int) -> dict[str, Any]:
    load, at_500, end = samples.rows[0][2][name], samples.at(500)[name], samples.rows[-1][2][name]
    slope, end_minus_mid = growth(samples, name, requests)
    return {
        f"{name}_rss_load_mb": round(load, 1),
        f"{name}_rss_500_mb": round(at_500, 1),
        f"{name}_rss_end_mb": round(end, 1),
        f"{name}_rss_peak_mb": round(max(peaks[name], end), 1),
        f"{name}_end_over_500": round(end / at_500, 3),
        f"{name}_growth_mb_per_1k": round(slope, 3),
        f"{name}_growth_end_minus_mid_mb_per_1k": round(end_minus_mid, 3),
    }


def report(
    args: argparse.Namespace, summary: dict[str, Any], samples: Samples, peaks: dict[str, float]
) -> dict[str, Any]:
    seconds = samples.rows[-1][1]  # from `go` to the last request's end
    figures: dict[str, Any] = {"model": args.model, "requests": args.requests, "concurrency": args.concurrency}
    figures |= {key: summary[key] for key in ("completed", "ok", "cancelled", "errors", "tokens")}
    figures |= {"seconds": round(seconds, 1), "requests_per_s": round(summary["completed"] / seconds, 2)}
    print(
        f"{summary['completed']} requests in {seconds:.0f} s ({figures['requests_per_s']} req/s), "
        f"{summary['tokens']} tokens; ok {summary['ok']}, cancelled {summary['cancelled']}, "
        f"errors {summary['errors']} (target 0)"
    )
    print("routes: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["routes"].items())))
    print("endings: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["endings"].items())))
    for message in summary["first_errors"]:
        print(f"  error {message}")
    print(
        f"{'process':8} {'load':>8} {'@500':>8} {'end':>8} {'peak':>8} {'end/500':>8} "
        f"{'MB/1k (2nd half, slope; end-mid)':>34}  target <= {TARGET_GROWTH_MB_PER_1K}"
    )
    for name in PROCESSES:
        own = process_figures(samples, peaks, name, args.requests)
        figures |= own
        values = [own[f"{name}_rss_{key}_mb"] for key in ("load", "500", "end", "peak")]
        slope, end_minus_mid = own[f"{name}_growth_mb_per_1k"], own[f"{name}_growth_end_minus_mid_mb_per_1k"]
        verdict = "met" if slope <= TARGET_GROWTH_MB_PER_1K else "MISSED"
        print(
            f"{name:8} " + " ".join(f"{v:8.1f}" for v in values) + f" {own[f'{name}_end_over_500']:8.3f} "
            f"{slope:22.3f}; {end_minus_mid:9.3f}  {verdict}"
        )
    blocks_slope, _ = second_half_slopes([(c, float(b)) for c, b in samples.blocks], args.requests)
    last_blocks = samples.blocks[-1][1]
    print(
        f"client Python heap: {last_blocks} live blocks at the end, {blocks_slope:+.0f} per 1,000 requests over the "
        "second half (objects kept alive grow this; RSS growing while it stays flat is the allocator keeping freed "
        "memory; it moves with what is in flight at each sample)"
    )
    figures |= {"client_py_blocks_end": last_blocks, "client_py_blocks_growth_per_1k": round(blocks_slope)}
    if args.requests < 500:
        print("(the run is shorter than 500 requests: @500 is the end)")
    series = (summary["gateway_metric_series_load"], summary["gateway_metric_series_end"])
    print(
        f"gateway /metrics series: {series[0]} at load, {series[1]} at the end; "
        f"torch in the client process: {summary['torch_imported']}"
    )
    figures |= {"gateway_metric_series_end": series[1], "client_imported_torch": summary["torch_imported"]}
    figures["error_kinds"] = {k: v for k, v in summary["endings"].items() if k.startswith("error:")}
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="300 requests, a sample every 25: a smoke run")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--concurrency", type=int, default=24, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=int, default=50, help="completed requests between RSS samples")
    for hidden in ("--redis-url", "--gateway-url", "--model-id"):  # the client process's own
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        asyncio.run(drive(args))
        return
    if args.quick:
        args.requests, args.sample_every = 300, 25
    workdir = Path(tempfile.mkdtemp(prefix="llmq-bench-soak-"))
    print(
        f"{args.requests} requests, {args.concurrency} in flight, model {args.model}, "
        f"{os.cpu_count()} cores; logs and samples in {workdir}",
        flush=True,
    )
    try:
        figures = run(args, workdir)
    except BaseException:
        print(f"the soak failed; logs in {workdir}", file=sys.stderr, flush=True)
        raise
    print_json(figures)


if __name__ == "__main__":
    main()
