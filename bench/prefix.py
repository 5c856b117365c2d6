"""Shared system prompts on a fleet of two worker processes: prefix caching off, on with plain pulls, and on with
cache affinity, in one run.

    python -m bench.prefix [--quick] [--questions 400] [--system-tokens 1000] [--rate 4] [--kv-cache-tokens N]

The workload of issue 32: 4 system prompts of `--system-tokens` tokens, `--questions` short questions (20-60
tokens, 32 output tokens, greedy) spread over them, submitted at a steady `--rate` per second. Each run starts two
fresh workers (one core each, as two machines) and warms them up on prompts of their own; then it submits the
workload and reports the prompt tokens the workers computed (`llmq:prompt_tokens_total`), the prefix cache's hit
rate (`llmq:prefix_cache_hits_total` over the prompt tokens submitted), TTFT P50/P99 (submit to first streamed
token) and throughput (generated tokens over the time from the first submit to the last answer), and checks the
outputs are equal. Runs: `off` (`--no-prefix-sharing`), `plain` (caching on, `--affinity-wait-ms 0`: whichever
worker reads first takes the request) and `affinity` (caching on, routing on: the defaults). Each worker's KV cache
(`--kv-cache-tokens`, by default 2.5 system prompts and 1,024 tokens for the requests running) holds two of the
four system prompts, not all of them, as in a fleet with more shared prompts than one worker's memory: plain
pulls spread every prompt over every worker, so each worker's cache churns; affinity keeps each prompt on one
worker. The JSON line has `prefill_ratio_affinity` and `prefill_ratio_plain` (prompt tokens computed / with
caching off), `ttft_p50_ratio` and `throughput_ratio` (affinity / off), the plain run's ratios too, and
`outputs_match` (all three runs equal).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
import urllib.request
from collections import Counter
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


def counters(port: int) -> Counter[str]:
    """A worker's prompt-token, prefix-cache and affinity counters, from its /metrics (affinity's by outcome)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    wanted = {"llmq:prompt_tokens_total", "llmq:prefix_cache_hits_total", "llmq:affinity_entries_total"}
    return Counter(
        {
            sample.labels.get("outcome", sample.name): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name in wanted
        }
    )


def totals(ports: list[int]) -> Counter[str]:
    """The counters summed over the workers."""
    return sum((counters(port) for port in ports), Counter())


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


async def run(name: str, model: str, prompts: list[list[int]], rate: float, workdir: Path, **settings: Any) -> Run:
    """One run on a Redis and two workers of its own; `settings` go to both workers."""
    server = RedisServer(workdir / f"redis-{name}").start()
    ports = [free_port() for _ in range(WORKERS)]
    workers = [
        start_worker(server.url, model, f"{name}{i}", workdir / f"{name}{i}.log", metrics_port=port, **settings)
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
            before = totals(ports)
            ttfts, outputs, seconds = await serve(client, prompts, rate)
            after = totals(ports)
            after.subtract(before)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=60)
        server.stop()
    result = Run(
        name,
        after["llmq:prompt_tokens_total"],
        after["llmq:prefix_cache_hits_total"],
        ttfts,
        sum(len(tokens) for tokens in outputs) / seconds,
        outputs,
    )
    submitted = sum(len(p) for p in prompts)
    print(
        f"{name}: prompt tokens computed {result.computed:.0f} of {submitted}, hit rate "
        f"{result.hits / submitted:.1%}, TTFT P50 {percentile(ttfts, 0.5):.3f} s P99 {percentile(ttfts, 0.99):.3f} s, "
        f"{result.tokens_per_s:.1f} tok/s; affinity moves "
        + ", ".join(f"{outcome} {after[outcome]:.0f}" for outcome in ("assigned", "taken", "stolen", "overflow")),
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
    kv = args.kv_cache_tokens or 5 * args.system_tokens // 2 + 1024
    off = await run("off", model, prompts, args.rate, workdir, kv_cache_tokens=kv, prefix_sharing=False)
    plain = await run("plain", model, prompts, args.rate, workdir, kv_cache_tokens=kv, affinity_wait_ms=0)
    affinity = await run("affinity", model, prompts, args.rate, workdir, kv_cache_tokens=kv)
    submitted = sum(len(p) for p in prompts)
    figures: dict[str, Any] = {
        "model": "tiny-llama (random)" if args.quick else model,
        "questions": len(prompts),
        "system_tokens": args.system_tokens,
        "rate": args.rate,
        "kv_cache_tokens": kv,
        "prompt_tokens": submitted,
    }
    for result in (off, plain, affinity):
        figures[f"computed_{result.name}"] = round(result.computed)
    for result in (plain, affinity):
        figures[f"hit_rate_{result.name}"] = round(result.hits / submitted, 3)
    for result in (off, plain, affinity):
        figures[f"ttft_p50_{result.name}_s"] = round(percentile(result.ttfts, 0.5), 3)
        figures[f"ttft_p99_{result.name}_s"] = round(percentile(result.ttfts, 0.99), 3)
        figures[f"tok_s_{result.name}"] = round(result.tokens_per_s, 1)
    return {
        **figures,
        "prefill_ratio_plain": round(plain.computed / off.computed, 3),
        "ttft_p50_ratio_plain": round(percentile(plain.ttfts, 0.5) / percentile(off.ttfts, 0.5), 3),
        "throughput_ratio_plain": round(plain.tokens_per_s / off.tokens_per_s, 3),
        "prefill_ratio_affinity": round(affinity.computed / off.computed, 3),
        "ttft_p50_ratio": round(percentile(affinity.ttfts, 0.5) / percentile(off.ttfts, 0.5), 3),
        "throughput_ratio": round(affinity.tokens_per_s / off.tokens_per_s, 3),
        "outputs_match": off.outputs == plain.outputs == affinity.outputs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model")
    parser.add_argument("--questions", type=int, default=400, help="questions, spread over 4 system prompts")
    parser.add_argument("--system-tokens", type=int, default=1000, help="tokens of each system prompt")
    parser.add_argument("--rate", type=float, default=4.0, help="submissions per second")
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=0,
        help="each worker's KV cache (default: 2.5 system prompts and 1,024 tokens for the requests running)",
    )
    args = parser.parse_args(argv)
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
