"""The engine with and without ending idle OpenMP teams (`worker/engine/openmp.py`), alternating in one process.

    python -m bench.openmp_teams [--rounds 2] [--requests 64]

Each round runs `bench.engine`'s busy workload and a lone request twice on the default model: once as the engine
runs now, and once with `openmp.release_idle_threads` a no-op, after a parallel torch op in this thread (as the
loader's would be), which is how every engine ran before. Prints busy tokens/s and lone ms/token of each run and
the ratios of the bests; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio

import torch

from bench.engine import MAX_RUNNING, EngineProbe, engine_config, load_busy, run_engine
from bench.workload import print_json
from worker.engine import openmp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer, jobs = load_busy(args.requests)
    useful = sum(job.max_new_tokens for job in jobs)
    config = engine_config(jobs, MAX_RUNNING)
    release = openmp.release_idle_threads
    runs: dict[str, list[tuple[float, float]]] = {"kept": [], "released": []}
    try:
        for _ in range(args.rounds):
            for mode in runs:
                openmp.release_idle_threads = release if mode == "released" else (lambda: True)
                torch.ones(4096, 4096).sum()  # a parallel region in this thread, as loading the model runs
                probe = EngineProbe()
                seconds, _ = asyncio.run(run_engine(model, tokenizer, jobs, config, probe))
                runs[mode].append((useful / seconds, probe.lone_decode_ms))
                print(
                    f"teams {mode:8s} {useful / seconds:7.1f} tok/s busy   {probe.lone_decode_ms:6.1f} ms/token alone"
                )
    finally:
        openmp.release_idle_threads = release
    best = {mode: (max(tok_s for tok_s, _ in done), min(ms for _, ms in done)) for mode, done in runs.items()}
    figures = {
        "requests": len(jobs),
        "rounds": args.rounds,
        "kept_tok_s": [round(tok_s, 1) for tok_s, _ in runs["kept"]],
        "released_tok_s": [round(tok_s, 1) for tok_s, _ in runs["released"]],
        "kept_lone_ms": [round(ms, 1) for _, ms in runs["kept"]],
        "released_lone_ms": [round(ms, 1) for _, ms in runs["released"]],
        "busy_speedup": round(best["released"][0] / best["kept"][0], 3),
        "lone_speedup": round(best["kept"][1] / best["released"][1], 3),
    }
    print(f"released against kept: busy {figures['busy_speedup']}x, lone {figures['lone_speedup']}x (bests)")
    print_json(figures)


if __name__ == "__main__":
    main()
