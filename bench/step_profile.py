"""Where a decode step's time goes: torch.profiler over 20 steps of a 32-row decode in the engine.

    python -m bench.step_profile [--quick] [--rows 32] [--steps 20] [--prompt 200] [--no-prepack]
                                 [--kernel-source FILE] [--dtype bfloat16] [--float32-few-rows] [--top N]

Requests with prompts of `--prompt` tokens (plus 4 per request, so lengths differ) are started together; once every
row decodes, the profiler runs in the engine's thread for `--steps` steps. Self CPU time is summed by op family.
`--kernel-source` builds the native decode kernel from another file, to compare two versions on one machine, e.g.
`git show REV:worker/engine/kernels/paged_decode.c > /tmp/old.c`, then a run with `--kernel-source /tmp/old.c` and one
without. `--top N` also lists the N ops with the most self CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.workload import load_bench_model, print_json
from worker.engine import Engine, EngineConfig, EngineRequest, GenerationParams, Step
from worker.engine.kernels import cpu_kernels
from worker.engine.loader import DEFAULT_MODEL, LoadOptions, load_model

KERNEL_RANGE = "llmq::paged_decode"  # the native kernels are no torch ops: timed as ranges of these names
NORM_RANGE = "llmq::rms_norm"  # counted in "other", with the norms torch runs where the native one is not used
FEW_ROWS_RANGE = "llmq::few_rows"
# The native decoder layer (few-row float32, bfloat16): its halves around the attention, or a whole decode layer.
LAYER_RANGES = ("llmq::attention_in", "llmq::attention_out", "llmq::decoder_layer")
FAMILIES = {
    "matmul": (
        "aten::addmm",
        "aten::mm",
        "aten::bmm",
        "aten::linear",
        "mkldnn::",
        "aten::mkldnn",
        "aten::matmul",
        FEW_ROWS_RANGE,
    ),
    "native layer": LAYER_RANGES,
    "attention": (
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product",
        "aten::_softmax",
        KERNEL_RANGE,
    ),
    "kv gather": ("aten::index_select", "aten::index"),
    "kv write": ("aten::index_copy",),
    "copy/slice/cat": (
        "aten::slice",
        "aten::select",
        "aten::cat",
        "aten::transpose",
        "aten::contiguous",
        "aten::clone",
        "aten::copy_",
        "aten::as_strided",
        "aten::view",
        "aten::reshape",
        "aten::_unsafe_view",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::empty",
        "aten::permute",
        "aten::expand",
        "aten::narrow",
        "aten::to",
        "aten::_to_copy",
        "aten::tril",
        "aten::ones",
        "aten::item",
        "aten::_local_scalar_dense",
    ),
}


# The native calls a step makes, each timed as its range: (class, method, range). The lean layers call a layer's bound
# halves and `decode_step`, not `DecoderLayer.attention_in` / `_out`.
RECORDED = (
    (cpu_kernels.PagedDecode, "__call__", KERNEL_RANGE),
    (cpu_kernels.RmsNorm, "__call__", NORM_RANGE),
    (cpu_kernels.FewRows, "__call__", FEW_ROWS_RANGE),
    (cpu_kernels.AttentionIn, "__call__", LAYER_RANGES[0]),
    (cpu_kernels.AttentionOut, "__call__", LAYER_RANGES[1]),
    (cpu_kernels.DecoderLayer, "decode_step", LAYER_RANGES[2]),
)


def _record_kernel_calls() -> None:
    """Makes the native kernels' calls show in the profile, as ranges (ctypes calls are invisible to it)."""
    for owner, method, name in RECORDED:
        setattr(owner, method, _recorded(getattr(owner, method), name))


def _recorded(call: Any, name: str) -> Any:
    def recorded(self: Any, *args: Any) -> Any:
        with torch.profiler.record_function(name):
            return call(self, *args)

    return recorded


def family(op: str) -> str:
    return next((name for name, prefixes in FAMILIES.items() if op.startswith(prefixes)), "other")


async def profile(model: Any, tokenizer: Any, rows: int, steps: int, prompt: int, top: int = 0) -> dict[str, Any]:
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    state = {"full_steps": 0, "profiled": 0, "start": 0.0, "end": 0.0}

    def observe(step: Step) -> None:  # in the engine's thread, after each step
        tokens = step.tokens
        if state["end"]:
            return
        if not state["start"]:
            state["full_steps"] = state["full_steps"] + 1 if tokens == rows else 0
            if state["full_steps"] >= 3:  # every row decodes, and has for a few steps
                profiler.start()
                state["start"] = time.perf_counter()
            return
        state["profiled"] += 1
        if state["profiled"] >= steps:
            state["end"] = time.perf_counter()
            profiler.stop()

    rng = random.Random(0)
    config = EngineConfig(kv_cache_tokens=32768, page_size=32, max_batch_tokens=512, max_running=rows)
    async with Engine(model, tokenizer, config) as engine:
        engine.observe_steps(observe)
        streams = [
            engine.submit(
                EngineRequest(
                    f"r{index}",
                    input_ids=[rng.randrange(3, model.config.vocab_size) for _ in range(prompt + 4 * index)],
                    params=GenerationParams(max_new_tokens=steps + 16, temperature=0, ignore_eos=True),
                )
            )
            for index in range(rows)
        ]
        await asyncio.gather(*(_drain(stream) for stream in streams))
    if not state["end"]:
        raise RuntimeError("the decode never ran all rows for enough steps")
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in profiler.key_averages():
        totals[family(event.key)] += event.self_cpu_time_total / 1e3 / steps
        calls[family(event.key)] += event.count // steps
    wall_ms = (state["end"] - state["start"]) * 1e3 / steps
    cpu_ms = sum(totals.values())
    print(f"{rows}-row decode step: {wall_ms:.1f} ms wall (profiled), {cpu_ms:.1f} ms self CPU")
    for name, ms in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {name:<15} {ms:7.1f} ms  {100 * ms / cpu_ms:5.1f} %   {calls[name]:6d} calls/step")
    for event in sorted(profiler.key_averages(), key=lambda event: -event.self_cpu_time_total)[:top]:
        ms = event.self_cpu_time_total / 1e3 / steps
        print(f"    {event.key[:40]:<40} {ms:7.2f} ms  {event.count // steps:5d} calls/step")
    return {"rows": rows, "step_ms": round(wall_ms, 1), **{f"{k}_ms": round(v, 1) for k, v in totals.items()}}


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--no-prepack", action="store_true", help="plain F.linear weights")
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU")
    parser.add_argument("--top", type=int, default=0, help="also list the N ops with the most self CPU time")
    parser.add_argument("--kernel-source", type=Path, help="build the decode kernel from this paged_decode.c")
    parser.add_argument("--float32-few-rows", action="store_true", help="LLMQ_FLOAT32_FEW_ROWS: the few-row mode")
    args = parser.parse_args(argv)
    if args.kernel_source is not None:
        cpu_kernels.SOURCE = args.kernel_source.resolve(strict=True)
    _record_kernel_calls()
    if args.quick:
        model, tokenizer, _ = load_bench_model(True)
    else:
        options = LoadOptions(dtype=args.dtype, prepack=not args.no_prepack, float32_few_rows=args.float32_few_rows)
        model, tokenizer = load_model(DEFAULT_MODEL, options)
    print_json(asyncio.run(profile(model, tokenizer, args.rows, args.steps, args.prompt, args.top)))


if __name__ == "__main__":
    main()
