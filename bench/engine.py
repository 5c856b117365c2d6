"""Engine throughput: our continuous batching vs static padded `model.generate` batches vs one at a time.

    python -m bench.engine [--quick] [--requests N]

One workload (greedy, EOS ignored, arrival order), three ways. Useful tokens/s counts only the tokens each
request asked for (a static batch runs until its longest request is done; the padding is wasted work).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import torch

from bench.workload import Job, load_bench_model, make_workload, peak_rss_mb, print_json
from worker.engine import Engine, EngineConfig, EngineRequest, GenerationParams


async def run_engine(
    model: Any, tokenizer: Any, jobs: list[Job], config: EngineConfig
) -> tuple[float, list[list[int]]]:
    async with Engine(model, tokenizer, config) as engine:
        # Warm the kernels once so no run pays for first-call setup.
        await _drain(engine.submit(EngineRequest("warmup", input_ids=jobs[0].prompt_ids, params=_greedy(4))))
        start = time.perf_counter()
        streams = [
            engine.submit(EngineRequest(f"r{job.index}", input_ids=job.prompt_ids, params=_greedy(job.max_new_tokens)))
            for job in jobs
        ]
        outputs = await asyncio.gather(*(_drain(stream) for stream in streams))
        return time.perf_counter() - start, outputs


def run_static(model: Any, tokenizer: Any, jobs: list[Job], batch_size: int) -> tuple[float, list[list[int]]]:
    """Padded batches in arrival order; each runs until its longest request has all its tokens."""
    outputs: list[list[int]] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    for first in range(0, len(jobs), batch_size):
        batch = jobs[first : first + batch_size]
        width = max(len(job.prompt_ids) for job in batch)
        ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=pad,
                max_new_tokens=max(job.max_new_tokens for job in batch),
            )
        outputs.extend(out[row, width : width + job.max_new_tokens].tolist() for row, job in enumerate(batch))
    return time.perf_counter() - start, outputs


def run_sequential(model: Any, jobs: list[Job]) -> tuple[float, list[list[int]]]:
    outputs = []
    start = time.perf_counter()
    for job in jobs:
        with torch.no_grad():
            out = model.generate(torch.tensor([job.prompt_ids]), do_sample=False, max_new_tokens=job.max_new_tokens)
        outputs.append(out[0, len(job.prompt_ids) :].tolist())
    return time.perf_counter() - start, outputs


def _report(label: str, seconds: float, useful: int) -> None:
    print(f"{label:<12} {seconds:7.2f} s  {useful / seconds:8.1f} useful tok/s   peak RSS {peak_rss_mb():.0f} MB")


def _greedy(max_new_tokens: int) -> GenerationParams:
    return GenerationParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


async def _drain(stream: Any) -> list[int]:
    return [token async for delta in stream for token in delta.token_ids]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, finishes in under a minute")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer, name = load_bench_model(args.quick)
    model.generation_config.eos_token_id = None  # EOS ignored: every request generates all it asked for
    jobs = make_workload(model.config.vocab_size, args.requests, (16, 256), (16, 128))
    useful = sum(job.max_new_tokens for job in jobs)
    print(f"model: {name}; {len(jobs)} requests, prompts 16-256, max_new_tokens 16-128, {useful} useful tokens")
    print(f"torch threads: {torch.get_num_threads()}")

    config = EngineConfig(kv_cache_tokens=16384, page_size=32, max_batch_tokens=512, max_running=len(jobs))
    engine_s, engine_out = asyncio.run(run_engine(model, tokenizer, jobs, config))
    _report("engine", engine_s, useful)

    static = {}
    for size in args.batch_sizes:
        static_s, static_out = run_static(model, tokenizer, jobs, size)
        static[size] = (static_s, static_out)
        _report(f"static b={size}", static_s, useful)
    best_size = min(static, key=lambda size: static[size][0])
    static_s, static_out = static[best_size]

    sequential_s, sequential_out = run_sequential(model, jobs)
    _report("sequential", sequential_s, useful)

    matches = sum(a == b for a, b in zip(engine_out, sequential_out, strict=True))
    static_matches = sum(a == b for a, b in zip(static_out, sequential_out, strict=True))
    figures = {
        "model": name,
        "requests": len(jobs),
        "useful_tokens": useful,
        "engine_tok_s": round(useful / engine_s, 2),
        "static_tok_s": round(useful / static_s, 2),
        "static_best_batch_size": best_size,
        "sequential_tok_s": round(useful / sequential_s, 2),
        "ratio_static": round(static_s / engine_s, 3),
        "ratio_sequential": round(sequential_s / engine_s, 3),
        "outputs_match": matches == len(jobs),
        "engine_matches_sequential": matches,
        "static_matches_sequential": static_matches,
        "peak_rss_mb": round(peak_rss_mb()),
    }
    print(
        f"ratio vs static (b={best_size}): {figures['ratio_static']}x   vs sequential: {figures['ratio_sequential']}x"
    )
    print(f"engine outputs equal to one-at-a-time greedy: {matches}/{len(jobs)}; static padded: {static_matches}")
    print_json(figures)


if __name__ == "__main__":
    main()
