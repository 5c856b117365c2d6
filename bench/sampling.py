"""Constrained decoding's cost: a batch of 32 JSON-schema requests against the same batch unconstrained, in one
run on one engine (the default model, or `--quick` a tiny random one).

    python -m bench.sampling [--quick] [--requests 32] [--tokens 64]

The schema holds a long string (`minLength` past `--tokens`), so every constrained request generates exactly as
many tokens as its unconstrained twin (which ignores EOS): the ratio is the per-step cost of the masks. Also
reported: the same batch with logprobs (5 alternatives) and with penalties. Target: `constrained_ratio >= 0.8`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench.workload import load_bench_model, print_json
from worker.engine import Engine, EngineConfig, EngineRequest, GenerationParams
from worker.engine.constraints import json_schema_format

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["news", "sport", "tech"]}, "maxItems": 3},
        "summary": {"type": "string", "minLength": 4000},
    },
    "required": ["title", "tags", "summary"],
}


async def timed(engine: Engine, prompts: list[str], params: GenerationParams, label: str) -> tuple[float, int]:
    """Seconds and tokens for the whole batch, submitted at once."""
    started = time.perf_counter()

    async def one(index: int, prompt: str) -> int:
        stream = engine.submit(EngineRequest(f"{label}-{index}", prompt=prompt, params=params))
        return sum([len(delta.token_ids) async for delta in stream])

    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return time.perf_counter() - started, tokens


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer, name = load_bench_model(args.quick)
    config = EngineConfig(kv_cache_tokens=32768, page_size=32, max_batch_tokens=1024, max_running=args.requests)
    prompts = [f"Write a news item about topic number {i} as JSON." for i in range(args.requests)]
    base = {"max_new_tokens": args.tokens, "temperature": 0.7, "seed": 1}
    runs = {
        "free": GenerationParams(**base, ignore_eos=True),
        "constrained": GenerationParams(**base, output_format=json_schema_format(SCHEMA)),
        "logprobs": GenerationParams(**base, ignore_eos=True, logprobs=5),
        "penalties": GenerationParams(**base, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.5),
    }
    rates = {}
    async with Engine(model, tokenizer, config) as engine:
        await timed(engine, prompts[:4], runs["constrained"], "warm")  # compiles the schema, warms the kernels
        for label, params in runs.items():
            seconds, tokens = await timed(engine, prompts, params, label)
            rates[label] = tokens / seconds
            print(f"{label:12s} {tokens} tokens in {seconds:6.2f} s = {rates[label]:7.1f} tok/s")
    figures = {
        "model": name,
        "requests": args.requests,
        "tokens": args.tokens,
        "free_tok_s": round(rates["free"], 1),
        "constrained_tok_s": round(rates["constrained"], 1),
        "constrained_ratio": round(rates["constrained"] / rates["free"], 3),
        "logprobs_ratio": round(rates["logprobs"] / rates["free"], 3),
        "penalties_ratio": round(rates["penalties"] / rates["free"], 3),
    }
    print(f"constrained / free: {figures['constrained_ratio']} (target >= 0.8)")
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    print_json(asyncio.run(main_async(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
