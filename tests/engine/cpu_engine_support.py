"""Helpers for `test_cpu_engine_blackbox.py`: SDPA references for the paged-decode kernel, a child-process runner
for inputs that may crash the kernel, and workloads / references for the engine."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

from worker.engine.core import Engine, EngineConfig
from worker.engine.kernels.cpu_kernels import DecodeRows
from worker.engine.loader import LoadOptions, load_model
from worker.engine.types import OutputDelta

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------- kernel


@dataclass
class Step:
    """One decode step's inputs, with what each request reads, for checking against SDPA."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    rows: DecodeRows
    reads: list[torch.Tensor]  # cache rows each request attends, in order

    @property
    def query_rows(self) -> list[int]:
        return [int(row) for row in self.rows.query_rows]


def make_step(
    lengths: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    seed: int,
    extra_tokens: int = 3,
    spare_cache_rows: int = 32,
    query_scale: float = 1.0,
) -> Step:
    """Requests of `lengths` whose cache rows lie scattered (and may repeat across requests, as shared prefixes
    do); query rows shuffled among `extra_tokens` rows that are not decode rows."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    cache_rows = max(lengths, default=0) + spare_cache_rows
    keys = torch.randn(cache_rows, kv_heads, head_dim, generator=generator)
    values = torch.randn(cache_rows, kv_heads, head_dim, generator=generator)
    reads = [torch.tensor(rng.sample(range(cache_rows), length), dtype=torch.int64) for length in lengths]
    tokens = len(lengths) + extra_tokens
    query_rows = rng.sample(range(tokens), len(lengths))
    query = torch.randn(tokens, heads, head_dim, generator=generator) * query_scale
    starts, offset = [], 0
    for length in lengths:
        starts.append(offset)
        offset += length
    index = torch.cat(reads) if reads else torch.empty(0, dtype=torch.int64)
    rows = DecodeRows(
        torch.tensor(query_rows, dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64),
        index,
    )
    return Step(query, keys, values, rows, reads)


def sdpa_row(step: Step, query_row: int, read: torch.Tensor, scale: float) -> torch.Tensor:
    """`[heads, head_dim]`: SDPA of one query row over the gathered cache rows (grouped-query)."""
    return functional.scaled_dot_product_attention(
        step.query[query_row].unsqueeze(1),  # [heads, 1, d]
        step.keys[read].transpose(0, 1),  # [kv_heads, n, d]
        step.values[read].transpose(0, 1),
        scale=scale,
        enable_gqa=True,
    )[:, 0]


CHILD_PRELUDE = """
import json, sys, torch
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import DecodeRows
kernel = cpu_kernels.load()
assert kernel is not None
T = lambda values, dtype=torch.int64: torch.tensor(values, dtype=dtype)
torch.manual_seed(0)
query = torch.randn(3, 4, 16)
keys = torch.randn(10, 2, 16)
values = torch.randn(10, 2, 16)
out = torch.zeros(3, 4, 16)
rows = DecodeRows(T([1]), T([0]), T([3]), T([0, 5, 9]))
results = {}
def attempt(name, call):
    try:
        call()
        results[name] = "accepted"
    except ValueError:
        results[name] = "ValueError"
    except Exception as error:
        results[name] = type(error).__name__
    print(json.dumps(results), flush=True)
"""


@dataclass
class ChildOutcome:
    returncode: int
    results: dict[str, str]
    stderr: str


def run_kernel_child(body: str, timeout_s: float = 60.0) -> ChildOutcome:
    """Runs `body` (calls to `attempt(name, lambda: kernel(...))`) after `CHILD_PRELUDE` in a fresh interpreter (one
    OpenMP thread: it checks refusals, not speed), so a crash in the kernel fails a test instead of killing pytest.
    `results` holds the child's last complete report: what it did before any crash."""
    script = CHILD_PRELUDE + textwrap.dedent(body)
    completed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    return ChildOutcome(completed.returncode, json.loads(lines[-1]) if lines else {}, completed.stderr[-2000:])


# ---------------------------------------------------------------------------------------------------- engine


def load(folder: Path) -> tuple[Any, Any]:
    return load_model(str(folder), LoadOptions(cache_dir=folder / "cache"))


@asynccontextmanager
async def running_engine(model: Any, tokenizer: Any, **config: Any) -> AsyncIterator[Engine]:
    sizing = {"kv_cache_tokens": 4096, "page_size": 16, "max_batch_tokens": 128, **config}
    engine = await Engine(model, tokenizer, EngineConfig(**sizing)).start()
    try:
        yield engine
    finally:
        await engine.close()


def reference_logprobs(model: Any, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """`[len(generated), vocab]`: log-softmax of the library's own logits at each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated])).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start : start + len(generated)], dim=-1)


async def collect(stream: Any) -> list[OutputDelta]:
    return [delta async for delta in stream]


def tokens_of(deltas: list[OutputDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


def hostile_workload(vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens): one-token prompts, one new token, prompts on page (16) and batch-budget (32)
    boundaries, and prompts many budgets long that need chunked prefill. Ids avoid the three special tokens."""
    rng = random.Random(seed)
    lengths_and_tokens = [
        (1, 1), (1, 17), (2, 1), (15, 5), (16, 16), (17, 3), (31, 1), (32, 9), (33, 12),
        (64, 2), (97, 20), (250, 6), (5, 33), (120, 1),
    ]  # fmt: skip
    return [([rng.randrange(3, vocab) for _ in range(length)], n) for length, n in lengths_and_tokens]
