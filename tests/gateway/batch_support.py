"""Real processes for the gateway / batch black-box tests: a private redis-server (AOF on, so it can be
stopped and started again with its data, as the README requires of Redis), one `python -m worker` on a tiny
random model, and `python -m gateway` processes, all started the way a user starts them (README commands),
each with its own log file. Nothing here imports the gateway or the batch code: the tests see only HTTP, the
`llmq` command and the `client` package's documented API.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from worker.embedded_redis import RedisServer, free_port

T = TypeVar("T")
PYTHON = sys.executable
LLMQ = str(Path(sys.executable).parent / "llmq")
ROOT = Path(__file__).resolve().parents[2]


def poll(predicate: Callable[[], T], within_s: float = 20.0, every_s: float = 0.02, what: str = "condition") -> T:
    """Calls `predicate` until it returns something truthy (exceptions count as not yet); fails after `within_s`."""
    deadline = time.monotonic() + within_s
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as error:
            last = error
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {within_s} s (last error: {last!r})")
        time.sleep(every_s)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # 2 shared cores: the worker must not starve the gateways and the tests
    env.pop("LLMQ_GATEWAY_API_KEYS", None)
    return env


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The process stopped (SIGSTOP) for the block and continued (SIGCONT) however the block ends: what it was
        doing waits, whatever the machine's speed."""
        self.popen.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.popen.send_signal(signal.SIGCONT)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def spawn(name: str, args: list[str], folder: Path, env: dict[str, str] | None = None) -> Process:
    log = folder / f"{name}.log"
    handle = log.open("wb")
    popen = subprocess.Popen(
        args, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env or _env(), start_new_session=True
    )
    handle.close()
    return Process(name, popen, log)


@dataclass
class Gateway:
    process: Process
    url: str
    api_key: str | None = None

    def http(self, **options: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=options.pop("timeout", 60), **options)


@dataclass
class Stack:
    folder: Path
    redis: RedisServer
    model_dir: Path
    worker: Process | None = None
    gateways: dict[str, Gateway] = field(default_factory=dict)
    model_id: str = ""

    @property
    def redis_url(self) -> str:
        return self.redis.url

    def start_worker(self) -> Process:
        args = [
            PYTHON, "-m", "worker",
            "--redis-url", self.redis_url,
            "--model", str(self.model_dir),
            "--model-cache-dir", str(self.folder / "model-cache"),
            "--kv-cache-tokens", "4096", "--page-size", "16", "--max-batch-tokens", "128", "--max-running", "8",
            "--read-block-ms", "50", "--heartbeat-s", "0.2", "--metrics-port", "0",
            "--health-file", str(self.folder / "worker.health"),
        ]  # fmt: skip
        self.worker = spawn("worker", args, self.folder)
        return self.worker

    def start_gateway(self, name: str, *extra: str, api_keys: str | None = None) -> Gateway:
        port = free_port()
        args = [
            PYTHON, "-m", "gateway", "--redis-url", self.redis_url, "--host", "127.0.0.1", "--port", str(port),
            "--models-refresh-s", "0", "--log-level", "warning", *extra,
        ]  # fmt: skip
        env = _env()
        if api_keys is not None:
            env["LLMQ_GATEWAY_API_KEYS"] = api_keys
        gateway = Gateway(spawn(f"gateway-{name}", args, self.folder, env), f"http://127.0.0.1:{port}")
        if api_keys:
            gateway.api_key = api_keys.split(",")[0]
        self.gateways[name] = gateway
        return gateway

    def wait_ready(self, within_s: float = 90.0) -> None:
        """Every gateway answers /health and lists the worker's model (its heartbeat is in)."""
        for gateway in self.gateways.values():

            def listed(gateway: Gateway = gateway) -> bool:
                for process in [gateway.process, self.worker]:
                    assert process is not None
                    if not process.alive():
                        raise RuntimeError(f"{process.name} exited:\n{process.tail()}")
                with httpx.Client(base_url=gateway.url, timeout=5) as http:
                    health = http.get("/health")
                    return health.status_code == 200 and bool(health.json().get("models"))

            poll(listed, within_s, every_s=0.1, what=f"gateway {gateway.url} ready")
        with httpx.Client(base_url=next(iter(self.gateways.values())).url, timeout=5) as http:
            self.model_id = http.get("/health").json()["models"][0]

    def stop(self) -> None:
        for gateway in self.gateways.values():
            gateway.process.stop()
        if self.worker is not None:
            self.worker.stop()
        self.redis.stop()


def redis_with_aof(folder: Path) -> RedisServer:
    return RedisServer(folder, "--appendonly", "yes", "--appendfsync", "always").start()


# ---------------------------------------------------------------------------------------------- llmq batch


def batch_line(custom_id: Any, body: Any, url: str = "/v1/chat/completions", method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat_body(content: str, max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}  # fmt: skip


def run_batch(
    redis_url: str, input_path: Path, output_path: Path, *extra: str, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LLMQ, "batch", str(input_path), "-o", str(output_path), "--url", redis_url, "--timeout", "30", *extra],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=_env(),
    )


def start_batch(redis_url: str, input_path: Path, output_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [LLMQ, "batch", str(input_path), "-o", str(output_path), "--url", redis_url, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=_env(),
        start_new_session=True,
    )


def read_output(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def complete_lines(path: Path) -> int:
    """Lines of `path` that end with a newline (a line being written does not count)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0
