"""Real processes for the client / CLI black-box tests: a private redis-server with AOF (so it can be restarted
with its data), and `python -m worker` processes on a tiny random model with a short lease, so a SIGKILLed
worker's requests move to the other one within seconds. Only the README's commands and the `client` package's
documented API are used; the process helpers come from `gateway_batch_support`.

For the in-process CLI tests (`main(argv)` in a thread): `scripted_worker`, a worker on the scripted engine in the
test's loop, heartbeating before it is handed over, and `scripted_text`, the text that engine answers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from structlog.testing import capture_logs

from client import Client, protocol, store
from client.cli import main
from testing.scripted_engine import expected_tokens, text_of
from tests.gateway.batch_support import LLMQ, PYTHON, ROOT, Process, _env, poll, spawn
from tests.polling import wait_until
from worker.embedded_redis import RedisServer

__all__ = [
    "LLMQ",
    "PYTHON",
    "ROOT",
    "Fleet",
    "cli",
    "dead_letter",
    "env",
    "heartbeat",
    "llmq",
    "poll",
    "scripted_text",
    "scripted_worker",
]


async def llmq(*argv: str) -> int:
    """`main(argv)` in a thread, so a worker in the test's loop serves it meanwhile."""
    return await asyncio.to_thread(main, list(argv))


def scripted_text(prompt: str, count: int) -> str:
    """What the scripted engine answers `prompt` (for chat: the messages' contents joined) in `count` tokens."""
    return "".join(text_of(token) for token in expected_tokens(list(prompt.encode()), count))


@asynccontextmanager
async def scripted_worker(url: str, folder: Path, queue: str = "default", **settings: Any) -> AsyncIterator[None]:
    """An in-process worker on the scripted engine, yielded once its heartbeat is in Redis (so `llmq` sees it
    live), its log lines kept out of the output; `settings` are worker settings (`step_s`: the engine's seconds
    per token)."""
    from tests.worker.conftest import serving  # the worker's stack, loaded only by the tests that run one

    with capture_logs():  # the worker's log lines would land in the output under test (structlog's default: stdout)
        async with serving(url, queue, folder, **settings), aioredis.Redis.from_url(url) as redis:
            await wait_until(lambda: redis.hlen(store.Keys(queue).workers), within_s=30)
            yield


def heartbeat(worker_id: str, queue: str = "default", at_ms: int | None = None) -> bytes:
    """A worker's heartbeat as the workers hash holds it; `at_ms` defaults to now (a live worker)."""
    beat = protocol.ms_now() if at_ms is None else at_ms
    info = protocol.WorkerInfo(
        id=worker_id, host="h", pid=1, queue=queue, model="m", running=0, waiting=0, kv_used_blocks=0,
        kv_total_blocks=1, tokens_generated=0, started=beat, heartbeat=beat,
    )  # fmt: skip
    return protocol.encode(info)


def dead_letter(request: protocol.GenerateRequest | None, reason: str = "test", raw: bytes | None = None) -> bytes:
    """A dead-letter entry's `m` field as `worker.intake.Intake.dead_letter` writes it."""
    body = raw if raw is not None else protocol.encode(request) if request is not None else b""
    return protocol.encode(protocol.DeadLetterBody(entry_id="1-0", reason=reason, raw=body))


def default_sigint() -> None:
    """A child's `preexec_fn` for Ctrl-C tests: SIGINT back to its default, so the child's Python raises
    KeyboardInterrupt. A shell starts background jobs with SIGINT ignored, and a process that starts with it ignored
    keeps it so (Python does too): a suite run in the background would otherwise send its Ctrl-Cs to nobody."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
