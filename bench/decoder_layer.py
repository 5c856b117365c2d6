"""A few-row mode with and without the native decoder layer (`kernels/decoder_layer.c`), alternating in one process:
float32 with the few-row kernel (`LLMQ_FLOAT32_FEW_ROWS`), or bfloat16 (`--bfloat16`, on CPUs with AVX-512 BF16).

    python -m bench.decoder_layer [--rounds 3] [--busy] [--requests 64] [--bfloat16]

The default model loaded in that mode; each round runs a lone request (48 tokens after a 64-token prompt) on an engine
whose lean layers take the native layer for steps of up to `few_rows_limit` rows (a step of decode rows only in one
call a layer, others in its two halves around the attention), and on one whose lean layers run their torch ops around
the same few-row products; `--busy` also runs `bench.engine`'s busy workload in each (whose steps fall to a few rows
only at its end). Prints each run and the ratio of the medians, and how many busy requests' greedy tokens agree
between the two ways (SiLU's `expf` may move a last bit); the last line is one JSON object."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

import torch

from bench.engine import MAX_RUNNING, _drain, _greedy, _lone_decode_ms, engine_config, load_busy, run_engine
from bench.workload import Job, print_json
from worker.engine import Engine, EngineRequest, lean_layers
from worker.engine.loader import DEFAULT_MODEL, LoadOptions

MODES = ("native", "torch_ops")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="also the busy workload, in both ways")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--bfloat16", action="store_true", help="the bfloat16 mode instead of float32's few-row one")
    args = parser.parse_args(argv)
    options = LoadOptions(dtype="bfloat16") if args.bfloat16 else LoadOptions(float32_few_rows=True)
    model, tokenizer, jobs = load_busy(args.requests, DEFAULT_MODEL, options)
    if args.bfloat16 and model.dtype != torch.bfloat16:
        parser.error("this CPU has no native bfloat16 products: the model loaded in float32")
    config = engine_config(jobs, MAX_RUNNING)
    useful = sum(job.max_new_tokens for job in jobs)
    native_layer = lean_layers._native_layer
    lone: dict[str, list[float]] = {mode: [] for mode in MODES}
    busy: dict[str, list[float]] = {mode: [] for mode in MODES}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                lean_layers._native_layer = native_layer if mode == "native" else (lambda layer, width: None)
                lean_layers.uninstall(model)  # the next engine installs the lean layers again, this way
                lone[mode].append(asyncio.run(_lone(model, tokenizer, jobs[0], config)))
                line = f"{mode:9s} {lone[mode][-1]:6.2f} ms/token alone"
                if args.busy:
                    seconds, outputs[mode] = asyncio.run(run_engine(model, tokenizer, jobs, config))
                    busy[mode].append(useful / seconds)
                    line += f"   {busy[mode][-1]:7.1f} tok/s busy"
                print(line, flush=True)
    finally:
        lean_layers._native_layer = native_layer
        lean_layers.uninstall(model)
    figures: dict[str, Any] = {"dtype": str(model.dtype).removeprefix("torch."), "rounds": args.rounds}
    figures["requests"] = len(jobs)
    for mode in MODES:
        figures[f"{mode}_lone_ms"] = [round(ms, 2) for ms in lone[mode]]
        figures[f"{mode}_tok_s"] = [round(tok_s, 1) for tok_s in busy[mode]] or None
    figures["lone_speedup"] = round(statistics.median(lone["torch_ops"]) / statistics.median(lone["native"]), 3)
    figures["busy_speedup"] = None
    figures["busy_matches"] = None
    if args.busy:
        figures["busy_speedup"] = round(statistics.median(busy["native"]) / statistics.median(busy["torch_ops"]), 3)
        figures["busy_matches"] = sum(a == b for a, b in zip(outputs["native"], outputs["torch_ops"], strict=True))
    print(f"native layer against the torch ops: lone {figures['lone_speedup']}x, busy {figures['busy_speedup']}x")
    print_json(figures)


async def _lone(model: Any, tokenizer: Any, job: Job, config: Any) -> float:
    """A lone request's decode ms/token on a fresh engine, after a warm-up request."""
    async with Engine(model, tokenizer, config) as engine:
        await _drain(engine.submit(EngineRequest("warmup", input_ids=job.prompt_ids, params=_greedy(4))))
        return await _lone_decode_ms(engine, job.prompt_ids[:64])


if __name__ == "__main__":
    main()
