"""One real fleet for the OpenAI-client black-box tests: `python -m worker` on a tiny random model (with its
Prometheus endpoint on, so generations can be counted from outside), `python -m gateway` processes started and
restarted with the user's flags, on the session's redis-server. It builds on `batch_support` (process spawning,
logs, readiness) and reads only what a user can read: HTTP and `/metrics`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.batch_support import PYTHON, Gateway, Process, Stack, poll, spawn
from worker.embedded_redis import RedisServer, free_port


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of every sample called `name` (counters: with `_total`) at `url` whose labels include `labels`."""
    text = httpx.get(url, timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@dataclass
class Fleet:
    """A worker and named gateways on one Redis; `stop` ends the processes and leaves Redis to its fixture."""

    folder: Path
    redis: RedisServer
    model_dir: Path
    stack: Stack = field(init=False)
    metrics_port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.stack = Stack(self.folder, self.redis, self.model_dir)

    @property
    def redis_url(self) -> str:
        return self.redis.url

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start_worker(self, *extra: str) -> Process:
        args = [
            PYTHON, "-m", "worker", "--redis-url", self.redis_url, "--model", str(self.model_dir),
            "--model-cache-dir", str(self.folder / "model-cache"),
            "--kv-cache-tokens", "16384", "--page-size", "16", "--max-batch-tokens", "256", "--max-running", "16",
            "--read-block-ms", "50", "--heartbeat-s", "0.2",
            "--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1",
            "--health-file", str(self.folder / "worker.health"), *extra,
        ]  # fmt: skip
        self.stack.worker = spawn("worker", args, self.folder)
        return self.stack.worker

    def start_gateway(self, name: str, *flags: str, api_keys: Iterable[str] = ()) -> Gateway:
        keys = list(api_keys)
        extra = [*flags, "--api-keys", ",".join(keys)] if keys else list(flags)
        gateway = self.stack.start_gateway(name, *extra)
        gateway.api_key = keys[0] if keys else None
        return gateway

    def gateway(self, name: str) -> Gateway:
        return self.stack.gateways[name]

    def wait_ready(self) -> None:
        self.stack.wait_ready()
        poll(lambda: httpx.get(self.metrics_url, timeout=5).status_code == 200, 60, 0.1, "worker /metrics")

    @property
    def model_id(self) -> str:
        return self.stack.model_id

    def kill_gateway(self, name: str) -> None:
        """kill -9: no clean stop, no lease released."""
        process = self.gateway(name).process
        process.popen.kill()
        process.popen.wait(20)

    def restart_gateway(self, name: str) -> Gateway:
        """The same command again (same port, flags and keys), once the old process is gone."""
        gateway = self.gateway(name)
        gateway.process.stop()
        args = [str(arg) for arg in gateway.process.popen.args]  # type: ignore[union-attr]
        gateway.process = spawn(f"{gateway.process.name}-again", args, self.folder)
        self.stack.wait_ready()
        return gateway

    def generations(self) -> float:
        """Requests the worker's engine finished, whatever the reason (`llmq:request_success_total`)."""
        return metric_sum(self.metrics_url, "llmq:request_success_total")

    def stop(self) -> None:
        for gateway in self.stack.gateways.values():
            gateway.process.stop()
        if self.stack.worker is not None:
            self.stack.worker.stop()

    def logs(self) -> str:
        processes = [self.stack.worker, *[g.process for g in self.stack.gateways.values()]]
        return "\n".join(f"--- {p.name}\n{p.tail()}" for p in processes if p is not None)
