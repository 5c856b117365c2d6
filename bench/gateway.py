"""The HTTP gateway's cost: one workload (streaming chat, 64 concurrent) through the gateway and through the
Python client, in one run, against the same workers.

    python -m bench.gateway [--quick] [--requests 512] [--concurrency 64] [--tokens 64] [--step-ms 20]

The workers run the scripted engine (`testing/scripted_engine.py`, one token per running request every
`--step-ms`), not a model: what is measured is what the gateway adds on top of the queue, which a model would
only hide. The gateway runs in its own process (`python -m gateway`), as deployed; this process drives both
sides with asyncio (raw httpx + SSE parsing for HTTP, so SDK parsing costs are not counted) and never imports
torch. TTFT is from sending the request to the first text received; `added_ttft_*` are the gateway's
percentiles minus the client's. Targets on 2 cores: ratio >= 0.9, added_ttft_p50_ms <= 15.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.fabric import with_workers
from bench.workload import percentile, print_json
from client import AsyncClient
from worker.embedded_redis import RedisServer

MODEL = "scripted"  # what bench.fabric's workers announce


def prompt(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question number {index}: what comes next?"}]


async def run_load(count: int, concurrency: int, one: Any) -> dict[str, Any]:
    """`count` requests with at most `concurrency` in flight; `one(index)` returns (ttft_s, tokens)."""
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def limited(index: int) -> None:
        nonlocal tokens
        async with gate:
            ttft, produced = await one(index)
        ttfts.append(ttft)
        tokens += produced

    started = time.perf_counter()
    await asyncio.gather(*(limited(i) for i in range(count)))
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1000,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1000,
    }


async def through_client(url: str, count: int, concurrency: int, tokens: int) -> dict[str, Any]:
    async with AsyncClient(url, max_queue_len=0) as client:

        async def one(index: int) -> tuple[float, int]:
            sent = time.perf_counter()
            job = await client.submit(messages=prompt(index), max_new_tokens=tokens, temperature=0)
            ttft, produced = 0.0, 0
            async for delta in job.stream(timeout=600):
                if not produced:
                    ttft = time.perf_counter() - sent
                produced += len(delta.token_ids)
            return ttft, produced

        return await run_load(count, concurrency, one)


async def through_gateway(http: httpx.AsyncClient, count: int, concurrency: int, tokens: int) -> dict[str, Any]:
    """Over one HTTP client (`concurrency` kept-alive connections, opened by the warm-up)."""

    async def one(index: int) -> tuple[float, int]:
        body = {
            "model": MODEL,
            "messages": prompt(index),
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        ttft, produced = 0.0, 0
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not ttft and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - sent
                if chunk.get("usage"):
                    produced = chunk["usage"]["completion_tokens"]
        return ttft, produced

    return await run_load(count, concurrency, one)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def start_gateway(url: str, logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "gateway", "--redis-url", url, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--log-level", "warning", "--max-queue-len", "0"]
    log = (logs / "gateway.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)  # noqa: ASYNC220 - returns at once
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base) as http:
        for _ in range(300):
            if process.poll() is not None:
                raise RuntimeError(f"the gateway exited; see {logs / 'gateway.log'}")
            try:
                if MODEL in (await http.get("/health")).json().get("models", []):
                    return process, base
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the gateway did not come up")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="llmq-bench-gateway-"))
    server = RedisServer(root / "redis").start()
    step_s = args.step_ms / 1000

    async def work() -> dict[str, Any]:
        gateway, base = await start_gateway(server.url, root)
        limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
        try:
            async with httpx.AsyncClient(base_url=base, limits=limits, timeout=600) as http:
                warm = min(args.concurrency, args.requests)
                await through_client(server.url, warm, args.concurrency, 4)
                await through_gateway(http, warm, args.concurrency, 4)
                client = await through_client(server.url, args.requests, args.concurrency, args.tokens)
                via = await through_gateway(http, args.requests, args.concurrency, args.tokens)
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
        return {"client": client, "gateway": via}

    try:
        phases = await with_workers(server.url, 1, step_s, args.concurrency, root, work)
    finally:
        server.stop()
    for label, figures in phases.items():
        print(
            f"{label}: {args.requests} streaming chats, {args.concurrency} concurrent, {figures['tokens']} tokens in "
            f"{figures['seconds']:.2f} s = {figures['tok_s']:,.0f} tok/s, "
            f"TTFT P50 {figures['ttft_p50_ms']:.1f} ms, P99 {figures['ttft_p99_ms']:.1f} ms"
        )
    client, via = phases["client"], phases["gateway"]
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "step_ms": args.step_ms,
        "gateway_tok_s": round(via["tok_s"], 1),
        "client_tok_s": round(client["tok_s"], 1),
        "ratio": round(via["tok_s"] / client["tok_s"], 3),
        "added_ttft_p50_ms": round(via["ttft_p50_ms"] - client["ttft_p50_ms"], 2),
        "added_ttft_p99_ms": round(via["ttft_p99_ms"] - client["ttft_p99_ms"], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 requests of 32 tokens")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per request (all are generated)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the scripted engine's time per step")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.tokens = 128, 32
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
