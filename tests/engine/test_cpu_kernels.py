"""The native paged-decode kernel: against SDPA on the gathered keys, its refusals, its build cache, and the engine
without it."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from tests.engine.conftest import load, reference_greedy
from tests.engine.test_engine import collect, greedy, mixed_prompts, tokens_of
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import DecodeRows, PagedDecode
from worker.engine.paged_reads import PAGED_KV
from worker.engine.types import EngineRequest


@pytest.fixture
def kernel() -> PagedDecode:
    built = cpu_kernels.load()
    assert built is not None, "the CPU engine's kernel must build here (a C compiler is on this machine and CI's)"
    return built


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """`load()` builds again, into an empty cache; the process-wide kernel is back after the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.load.cache_clear()
    yield tmp_path / "llmq" / "kernels"
    cpu_kernels.load.cache_clear()


def _scattered_step(
    lengths: list[int], heads: int, kv_heads: int, head_dim: int, seed: int, query_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeRows, list[torch.Tensor]]:
    """Decode rows whose keys lie scattered over a cache as pages do, in a step whose query rows are shuffled and
    include rows the kernel must not touch."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cache_rows = sum(lengths) + 64
    keys, values = torch.randn(cache_rows, kv_heads, head_dim), torch.randn(cache_rows, kv_heads, head_dim)
    free = list(range(cache_rows))
    rng.shuffle(free)
    reads = [torch.tensor([free.pop() for _ in range(length)]) for length in lengths]
    tokens = len(lengths) + 3  # three rows that are not decode rows
    query_rows = rng.sample(range(tokens), len(lengths))
    query = torch.randn(tokens, heads, head_dim) * query_scale
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    rows = DecodeRows(torch.tensor(query_rows), torch.tensor(starts), torch.tensor(lengths), torch.cat(reads))
    return query, keys, values, rows, reads


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 4, 16), (6, 2, 8), (9, 3, 64), (8, 2, 80), (2, 1, 7), (8, 2, 128), (14, 2, 64), (5, 1, 300), (4, 4, 64)],
    ids=["mha", "gqa", "smollm2", "head-dim-80", "odd-head-dim", "llama3", "qwen2-0.5b", "head-dim-300", "mha-64"],
)
def test_the_kernel_matches_sdpa_on_the_gathered_keys(
    kernel: PagedDecode, heads: int, kv_heads: int, head_dim: int
) -> None:
    lengths = [1, 2, 37, 300, 700, 64, 5]
    query, keys, values, rows, reads = _scattered_step(lengths, heads, kv_heads, head_dim, seed=heads * head_dim)
    out = torch.full_like(query, 123.0)
    kernel(query, keys, values, rows, head_dim**-0.5, out)
    for position, read in zip(rows.query_rows.tolist(), reads, strict=True):
        expected = functional.scaled_dot_product_attention(
            query[position].unsqueeze(1),  # [heads, 1, d]
            keys[read].transpose(0, 1),
            values[read].transpose(0, 1),
            enable_gqa=True,
        )[:, 0]
        torch.testing.assert_close(out[position], expected)
    untouched = sorted(set(range(query.shape[0])) - set(rows.query_rows.tolist()))
    assert bool((out[untouched] == 123.0).all()), "rows that are not decode rows are left alone"


def test_peaked_and_flat_scores_stay_exact(kernel: PagedDecode) -> None:
    """Scores thousands apart (softmax nearly one-hot, most weights underflow to 0) and all-equal scores."""
    query, keys, values, rows, reads = _scattered_step([50, 400], 4, 2, 16, seed=5, query_scale=300.0)
    out = torch.empty_like(query)
    kernel(query, keys, values, rows, 0.25, out)
    for position, read in zip(rows.query_rows.tolist(), reads, strict=True):
        expected = functional.scaled_dot_product_attention(
            query[position].unsqueeze(1), keys[read].transpose(0, 1), values[read].transpose(0, 1), scale=0.25,
            enable_gqa=True,
        )[:, 0]  # fmt: skip
        assert bool(out[position].isfinite().all())
        torch.testing.assert_close(out[position], expected)
    kernel(torch.zeros_like(query), keys, values, rows, 0.25, out)
    for position, read in zip(rows.query_rows.tolist(), reads, strict=True):
        mean = values[read].mean(0).repeat_interleave(2, 0)  # equal weights: the mean value, per KV head
        torch.testing.assert_close(out[position], mean)


def test_the_kernel_refuses_what_it_cannot_read(kernel: PagedDecode) -> None:
    query, keys, values, rows, _ = _scattered_step([10, 20], 4, 2, 16, seed=1)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernel(query.double(), keys, values, rows, 0.25, out)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernel(query.transpose(0, 1).contiguous().transpose(0, 1), keys, values, rows, 0.25, out)
    with pytest.raises(ValueError, match="does not fit"):
        kernel(query[:, :3].contiguous(), keys, values, rows, 0.25, out[:, :3].contiguous())


def test_the_kernel_is_built_once_per_machine_and_reused(fresh_build: Path) -> None:
    assert cpu_kernels.load() is not None
    [built] = fresh_build.glob("paged_decode-*.so")
    stamp = built.stat().st_mtime_ns
    cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None
    assert [path.name for path in fresh_build.iterdir()] == [built.name], "no second build, no leftovers"
    assert built.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_without_a_working_compiler_load_says_why_and_returns_none(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, compiler: str
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc" if compiler == "missing" else "false")
    with caplog.at_level(logging.WARNING, logger="worker.engine.kernels.cpu_kernels"):
        assert cpu_kernels.load() is None
    assert "kernel unavailable, using the torch path" in caplog.text
    assert not fresh_build.exists() or not list(fresh_build.glob("*.so"))


@pytest.mark.parametrize("path", ["native", "torch"])
async def test_engine_decode_paths_match_generate(
    llama_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Decode rows go to the kernel, or, where it cannot be built, through the padded SDPA groups; either way the
    outputs are `generate`'s."""
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda *_: None)
    reference_model, _ = load(llama_dir)
    engine = await make_engine(llama_dir, max_batch_tokens=32)
    plans: list[Any] = []
    cache = engine._manager.library.batch_processor.cache
    update = cache.update

    def spy(key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict[str, Any]) -> Any:
        result = update(key, value, layer_idx, kwargs)
        if PAGED_KV in kwargs:
            plans.append(kwargs[PAGED_KV].plan)
        return result

    cache.update = spy
    workload = mixed_prompts(engine.vocab_size, count=6, seed=4)
    for index, (ids, n) in enumerate(workload):
        deltas = await collect(engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n))))
        assert tokens_of(deltas) == reference_greedy(reference_model, ids, n), f"request {index}"
    decoding = [plan for plan in plans if plan.native is not None or plan.decode]
    assert decoding
    if path == "native":
        assert all(plan.native is not None and not plan.decode for plan in decoding)
    else:
        assert all(plan.native is None for plan in decoding)
