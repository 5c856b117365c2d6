"""Real processes for the client / CLI black-box tests: a private redis-server with AOF (so it can be restarted
with its data), and `python -m worker` processes on a tiny random model with a short lease, so a SIGKILLed
worker's requests move to the other one within seconds. Only the README's commands and the `client` package's
documented API are used; the process helpers come from `gateway_batch_support`.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client import Client
from tests.blackbox.gateway_batch_support import LLMQ, PYTHON, ROOT, Process, _env, poll, spawn
from worker.embedded_redis import RedisServer

__all__ = ["LLMQ", "PYTHON", "ROOT", "Fleet", "cli", "env", "poll"]


def env(**extra: str) -> dict[str, str]:
    variables = _env()
    variables.pop("LLMQ_REDIS_URL", None)
    variables.update(extra)
    return variables


def cli(*args: str, timeout_s: float = 60, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """`llmq ARGS` as a user runs it; text output."""
    return subprocess.run(
        [LLMQ, *args], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env(**extra_env)
    )


@dataclass
class Fleet:
    folder: Path
    redis: RedisServer
    model_dir: Path
    workers: list[Process] = field(default_factory=list)
    baseline: dict[str, list[int]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.redis.url

    def start_worker(self, name: str) -> Process:
        args = [
            PYTHON, "-m", "worker",
            "--redis-url", self.url,
            "--model", str(self.model_dir),
            "--model-cache-dir", str(self.folder / "model-cache"),
            "--worker-id", name,
            "--kv-cache-tokens", "8192", "--page-size", "16", "--max-batch-tokens", "256", "--max-running", "32",
            "--read-block-ms", "50", "--heartbeat-s", "0.2", "--metrics-port", "0",
            "--lease-timeout-s", "2", "--lease-renew-s", "0.3", "--claim-interval-s", "0.2",
            "--health-file", str(self.folder / f"{name}.health"),
        ]  # fmt: skip
        process = spawn(name, args, self.folder)
        self.workers.append(process)
        return process

    def live_workers(self) -> list[str]:
        with Client(self.url) as client:
            return sorted(worker.id for worker in client.status(stale_after_s=2).workers)

    def wait_workers(self, names: list[str], within_s: float = 90) -> None:
        def ready() -> bool:
            for process in self.workers:
                if process.name in names and not process.alive():
                    raise RuntimeError(f"{process.name} exited:\n{process.tail()}")
            return set(names) <= set(self.live_workers())

        poll(ready, within_s, every_s=0.1, what=f"workers {names} heartbeating")

    def worker(self, name: str) -> Process:
        return next(process for process in self.workers if process.name == name)

    def stop(self) -> None:
        for process in self.workers:
            process.stop()
        self.redis.stop()


def kill(process: Process) -> None:
    os.killpg(process.popen.pid, 9)
    process.popen.wait(10)


def greedy(**options: Any) -> dict[str, Any]:
    return {"temperature": 0, "ignore_eos": True, **options}
