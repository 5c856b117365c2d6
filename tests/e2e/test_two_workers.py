"""End to end as a new user meets it: two `python -m worker` processes on one Redis, the async and sync
clients, a second process following a request, and bad input mixed into the traffic."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import AsyncClient, Client, QueueFull
from testing.tiny_models import save_tiny_model
from worker.embedded_redis import RedisServer
from worker.engine import Engine, EngineConfig, EngineRequest, GenerationParams, LoadOptions, load_model

pytestmark = pytest.mark.slow
WORKER_FLAGS = [
    "--kv-cache-tokens",
    "4096",
    "--page-size",
    "16",
    "--max-batch-tokens",
    "256",
    "--max-running",
    "16",
    "--read-block-ms",
    "100",
    "--heartbeat-s",
    "0.5",
    "--log-format",
    "json",
    "--metrics-port",
    "0",
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A redis-server of its own and two worker processes on a tiny model; stopped (SIGTERM) afterwards."""
    root = tmp_path_factory.mktemp("e2e")
    model_dir = save_tiny_model(root / "model", "qwen2", max_positions=512)
    server = RedisServer(root / "redis").start()
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker",
                "--redis-url",
                server.url,
                "--model",
                str(model_dir),
                "--model-cache-dir",
                str(root / "cache"),
                "--worker-id",
                f"w{i}",
                *WORKER_FLAGS,
            ],
            stdout=open(root / f"w{i}.log", "wb"),  # noqa: SIM115 - the process owns it until the fixture ends
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for i in range(2)
    ]
    try:
        with Client(server.url) as client:
            deadline = time.monotonic() + 120
            while len(client.status().workers) < 2:
                assert all(w.poll() is None for w in workers), (root / "w0.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "workers did not start"
                time.sleep(0.2)
        yield server.url, model_dir
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            assert worker.wait(timeout=60) == 0, "a worker did not exit cleanly on SIGTERM"
        server.stop()


async def engine_outputs(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model, tokenizer = load_model(str(model_dir), LoadOptions(cache_dir=model_dir / "cache"))
    async with Engine(model, tokenizer, EngineConfig(kv_cache_tokens=4096, page_size=16)) as engine:
        greedy = GenerationParams(max_new_tokens=max_new_tokens, temperature=0)
        streams = [engine.submit(EngineRequest(f"e{i}", input_ids=p, params=greedy)) for i, p in enumerate(prompts)]
        return [[t async for d in s for t in d.token_ids] for s in streams]


async def test_hundred_requests_over_two_workers(deployment: tuple[str, Path]) -> None:
    url, model_dir = deployment
    prompts = [[3 + (i % 50), 4 + (i % 7), 5, 6 + (i % 11)] for i in range(100)]
    expected = await engine_outputs(model_dir, prompts, 16)
    async with AsyncClient(url) as client:
        before = {w.id: w.tokens_generated for w in (await client.status()).workers}
        jobs = await asyncio.gather(*(client.submit(input_ids=p, max_new_tokens=16, temperature=0) for p in prompts))
        results = await asyncio.gather(*(job.result(timeout=120) for job in jobs))
        assert [r.token_ids for r in results] == expected
        assert all(r.text == r.text.strip("\x00") for r in results)
        await asyncio.sleep(1.2)  # a heartbeat after the last request
        status = await client.status()
    served = {w.id: w.tokens_generated - before.get(w.id, 0) for w in status.workers}
    assert sorted(served) == ["w0", "w1"] and all(count > 0 for count in served.values()), served
    assert sum(served.values()) == sum(len(e) for e in expected)
    assert status.depth == 0 and status.pending == 0


def test_sync_client_and_attach_from_another_process(deployment: tuple[str, Path]) -> None:
    url, _ = deployment
    with Client(url) as client:
        job = client.submit(prompt="The quick brown fox", max_new_tokens=24, temperature=0, ignore_eos=True)
        follower = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from client import Client, Job; c = Client(sys.argv[1]); "
                "print(Job.attach(c, sys.argv[2]).result(timeout=60).text, end='')",
                url,
                job.id,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        result = job.result(timeout=60)
        assert follower.stdout == result.text and len(result.token_ids) == 24
        streamed = "".join(
            d.text
            for d in client.submit(
                prompt="The quick brown fox", max_new_tokens=24, temperature=0, ignore_eos=True
            ).stream(timeout=60)
        )
        assert streamed == result.text


async def test_queue_full_is_refused_at_submit(deployment: tuple[str, Path]) -> None:
    url, _ = deployment
    async with AsyncClient(url, max_queue_len=1) as client:
        jobs, refused = [], 0
        for _ in range(30):
            try:
                jobs.append(await client.submit(input_ids=[3, 4], max_new_tokens=60, temperature=0, ignore_eos=True))
            except QueueFull:
                refused += 1
        assert refused > 0 and jobs
        lengths = [len((await job.result(timeout=120)).token_ids) for job in jobs]
        assert lengths == [60] * len(jobs)
