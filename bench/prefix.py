"""Shared system prompts on a fleet of two worker processes, with prefix caching off and on, in one run.

    python -m bench.prefix [--quick] [--questions 400] [--system-tokens 1000] [--rate 4]

The workload of issue 32: 4 system prompts of `--system-tokens` tokens, `--questions` short questions (20-60
tokens, 32 output tokens, greedy) spread over them, submitted at a steady `--rate` per second. Each run starts two
fresh workers (one core each, as two machines) and warms them up on prompts of their own; then it submits the
workload and reports the prompt tokens the workers computed (`llmq:prompt_tokens_total`), the prefix cache's hit
rate (`llmq:prefix_cache_hits_total` over the prompt tokens submitted), TTFT P50/P99 (submit to first streamed
token) and throughput (generated tokens over the time from the first submit to the last answer), and checks the
outputs are equal. Runs: `off` (`--no-prefix-sharing`) and `plain` (caching on, the default, with plain pulls).
The JSON line has `prefill_ratio_plain` (computed with caching / off), `ttft_p50_ratio` and
`throughput_ratio` (plain / off) and `outputs_match`. Cache affinity across workers, issue 32's third run, is not
built yet.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.lanes import start_worker
from bench.workload import percentile, print_json
from client import AsyncClient
from worker.embedded_redis import RedisServer, free_port

WORKERS = 2
SYSTEMS = 4
OUTPUT_TOKENS = 32


@dataclass
class Run:
    name: str
    computed: float  # prompt tokens the workers ran through a forward pass
    hits: float  # prompt tokens found in the prefix cache
    ttfts: list[float]
    tokens_per_s: float
    outputs: list[list[int]]


def workload(vocab: int, questions: int, system_tokens: int) -> list[list[int]]:
    """Each question's prompt: one of the system prompts, then the question's own tokens."""
    rng = random.Random(32)
    systems = [[rng.randrange(3, vocab) for _ in range(system_tokens)] for _ in range(SYSTEMS)]
    return [
        systems[i % SYSTEMS] + [rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))] for i in range(questions)
    ]


def counters(port: int) -> dict[str, float]:
    """A worker's prompt-token and prefix-cache counters, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    wanted = {"llmq:prompt_tokens_total", "llmq:prefix_cache_hits_total"}
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in wanted
    }


def totals(ports: list[int]) -> tuple[float, float]:
    read = [counters(port) for port in ports]
    return (
        sum(r.get("llmq:prompt_tokens_total", 0.0) for r in read),
        sum(r.get("llmq:prefix_cache_hits_total", 0.0) for r in read),
    )


async def serve(
    client: AsyncClient, prompts: list[list[int]], rate: float
) -> tuple[list[float], list[list[int]], float]:
    """Submits the prompts at `rate` per second; each one's TTFT and tokens, and the time to the last answer."""
    origin = time.perf_counter()

    async def one(index: int, prompt: list[int]) -> tuple[float, list[int]]:
        await asyncio.sleep(max(0.0, origin + index / rate - time.perf_counter()))
        sent = time.perf_counter()
        job = await client.submit(input_ids=prompt, max_new_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
        first, tokens = None, []
        async for delta in job.stream(timeout=1800):
            if first is None and delta.token_ids:
                first = time.perf_counter()
            tokens += delta.token_ids
        return (first or time.perf_counter()) - sent, tokens

    answers = await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(prompts)))
    return [ttft for ttft, _ in answers], [tokens for _, tokens in answers], time.perf_counter() - origin


async def run(name: str, model: str, prompts: list[list[int]], rate: float, caching: bool, workdir: Path) -> Run:
    server = RedisServer(workdir / f"redis-{name}").start()
    ports = [free_port() for _ in range(WORKERS)]
    workers = [
        start_worker(
            server.url, model, f"{name}{i}", workdir / f"{name}{i}.log", metrics_port=port, prefix_sharing=caching
        )
        for i, port in enumerate(ports)
    ]
    try:
        async with AsyncClient(server.url, max_queue_len=0) as client:
            while len((await client.status()).workers) < WORKERS:
                if any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"a worker exited; logs in {workdir}")
                await asyncio.sleep(0.2)
            rng = random.Random(7)  # warm-up prompts of the same lengths, sharing nothing with the workload
            warm = [[rng.randrange(3, 400) for _ in range(len(p))] for p in prompts[: 4 * WORKERS]]
            await serve(client, warm, rate=100.0)
            computed, hits = totals(ports)
            ttfts, outputs, seconds = await serve(client, prompts, rate)
            computed_after, hits_after = totals(ports)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=60)
        server.stop()
    result = Run(
        name,
        computed_after - computed,
        hits_after - hits,
        ttfts,
        sum(len(tokens) for tokens in outputs) / seconds,
        outputs,
    )
    submitted = sum(len(p) for p in prompts)
    print(
        f"{name}: prompt tokens computed {result.computed:.0f} of {submitted}, hit rate "
        f"{result.hits / submitted:.1%}, TTFT P50 {percentile(ttfts, 0.5):.3f} s P99 {percentile(ttfts, 0.99):.3f} s, "
        f"{result.tokens_per_s:.1f} tok/s",
        flush=True,
    )
    return result


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="llmq-bench-prefix-"))
    if args.quick:
        from testing.tiny_models import save_tiny_model

        model, vocab = str(save_tiny_model(workdir / "model", "llama", max_positions=4096)), 400
    else:
        from worker.engine import DEFAULT_MODEL

        model, vocab = DEFAULT_MODEL, 49152
    prompts = workload(vocab, args.questions, args.system_tokens)
    off = await run("off", model, prompts, args.rate, False, workdir)
    plain = await run("plain", model, prompts, args.rate, True, workdir)
    submitted = sum(len(p) for p in prompts)
    return {
        "model": "tiny-llama (random)" if args.quick else model,
        "questions": len(prompts),
        "system_tokens": args.system_tokens,
        "rate": args.rate,
        "prompt_tokens": submitted,
        "computed_off": round(off.computed),
        "computed_plain": round(plain.computed),
        "hit_rate_plain": round(plain.hits / submitted, 3),
        "prefill_ratio_plain": round(plain.computed / off.computed, 3),
        "ttft_p50_off_s": round(percentile(off.ttfts, 0.5), 3),
        "ttft_p50_plain_s": round(percentile(plain.ttfts, 0.5), 3),
        "ttft_p99_off_s": round(percentile(off.ttfts, 0.99), 3),
        "ttft_p99_plain_s": round(percentile(plain.ttfts, 0.99), 3),
        "ttft_p50_ratio": round(percentile(plain.ttfts, 0.5) / percentile(off.ttfts, 0.5), 3),
        "tok_s_off": round(off.tokens_per_s, 1),
        "tok_s_plain": round(plain.tokens_per_s, 1),
        "throughput_ratio": round(plain.tokens_per_s / off.tokens_per_s, 3),
        "outputs_match": off.outputs == plain.outputs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model")
    parser.add_argument("--questions", type=int, default=400, help="questions, spread over 4 system prompts")
    parser.add_argument("--system-tokens", type=int, default=1000, help="tokens of each system prompt")
    parser.add_argument("--rate", type=float, default=4.0, help="submissions per second")
    args = parser.parse_args(argv)
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
