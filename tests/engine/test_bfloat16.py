"""The CPU engine in bfloat16 (`LLMQ_DTYPE=bfloat16`): its two native kernels (few-row products, decode attention
over a bfloat16 cache), the engine's outputs against bfloat16 `generate`, and the float32 fallback on a CPU without
native bfloat16 products."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from tests.engine.conftest import reference_greedy
from tests.engine.test_cpu_kernels import _scattered_step
from tests.engine.test_engine import collect, greedy, mixed_prompts, tokens_of
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import FewRows, PagedDecode
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import (
    FEW_ROWS,
    FEW_ROWS_BFLOAT16_WITHOUT_AMX,
    FEW_ROWS_FLOAT32_AVX512,
    PackedLinear,
    few_rows_limit,
    prepack,
)
from worker.engine.types import EngineRequest

BFLOAT16_FEW_ROWS = few_rows_limit(torch.bfloat16)  # 6 with AMX, 32 without

native = pytest.mark.skipif(
    not cpu_kernels.native_bfloat16(), reason="this CPU has no native bfloat16 products (AVX-512 BF16)"
)


def load_bfloat16(folder: Path) -> tuple[Any, Any]:
    return load_model(str(folder), LoadOptions(dtype="bfloat16", cache_dir=folder / "cache"))


@pytest.fixture
def few_rows() -> FewRows:
    built = cpu_kernels.few_rows()
    assert built is not None, "the few-row kernel must build on a CPU with AVX-512 BF16 (CI's has it)"
    return built


@native
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (33, 7), (100, 65), (32, 1)])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
def test_few_rows_is_the_product_rounded_once(
    few_rows: FewRows, in_features: int, out_features: int, biased: bool
) -> None:
    """Within a rounding of the exact product (sums in float32, one rounding to bfloat16), for every row count it
    serves, input widths that are not a multiple of 32 included."""
    torch.manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16() if biased else None
    for rows in range(1, BFLOAT16_FEW_ROWS + 1):
        x = torch.randn(rows, in_features).bfloat16()
        exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
        out = few_rows(x, weight, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
        torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-3 * in_features**0.5)


def test_the_few_row_limit_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's bfloat16 products run on AMX tiles where the CPU has them (the kernel leads only for a few rows) and
    on the kernel's own AVX-512 BF16 dot products where it has not (the kernel led to 32 rows and more); the float32
    kernel built for AVX-512 leads further than AVX2's, whose 16 registers hold fewer sums."""
    try:
        for has_amx, has_avx512 in ((True, True), (False, True), (False, False)):
            monkeypatch.setattr(cpu_kernels, "amx", lambda has_amx=has_amx: has_amx)
            monkeypatch.setattr(cpu_kernels, "avx512", lambda has_avx512=has_avx512: has_avx512)
            few_rows_limit.cache_clear()
            assert few_rows_limit(torch.bfloat16) == (FEW_ROWS if has_amx else FEW_ROWS_BFLOAT16_WITHOUT_AMX)
            assert few_rows_limit(torch.float32) == (FEW_ROWS_FLOAT32_AVX512 if has_avx512 else FEW_ROWS)
    finally:
        monkeypatch.undo()
        few_rows_limit.cache_clear()


@native
def test_few_rows_gives_a_row_the_same_bits_in_any_batch(few_rows: FewRows) -> None:
    """Each row is summed in one order whatever else is in the step, so a decode row's output does not depend on
    the other rows batched with it (oneDNN's bfloat16 kernels change with the row count)."""
    torch.manual_seed(0)
    weight = torch.randn(3072, 576).bfloat16()
    x = torch.randn(BFLOAT16_FEW_ROWS, 576).bfloat16()
    batched = few_rows(x, weight, None)
    for row in range(BFLOAT16_FEW_ROWS):
        assert torch.equal(few_rows(x[row : row + 1].contiguous(), weight, None)[0], batched[row])


@native
def test_few_rows_refuses_what_it_cannot_read(few_rows: FewRows) -> None:
    weight = torch.randn(8, 64).bfloat16()
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        few_rows(torch.randn(2, 64), weight, None)
    with pytest.raises(ValueError, match="do not fit"):
        few_rows(torch.randn(2, 32).bfloat16(), weight, None)
    with pytest.raises(ValueError, match="bias"):
        few_rows(torch.randn(2, 64).bfloat16(), weight, torch.randn(7).bfloat16())


@native
def test_a_bfloat16_linear_is_packed_and_serves_every_row_count() -> None:
    """`prepack` takes bfloat16 layers too: a few rows through the kernel, more through oneDNN at a padded count;
    either way close to the float32 product of the same bfloat16 numbers."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(96, 40, bias=True)).to(torch.bfloat16)
    assert prepack(model) == 1 and type(model[0]) is PackedLinear
    with torch.no_grad():
        for rows in (1, BFLOAT16_FEW_ROWS, BFLOAT16_FEW_ROWS + 1, 17, 100):
            x = torch.randn(rows, 96).bfloat16()
            expected = functional.linear(x.float(), model[0].weight.float(), model[0].bias.float())
            torch.testing.assert_close(model(x).float(), expected, rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (2, 1, 7), (5, 1, 80)])
def test_the_bfloat16_decode_kernel_matches_sdpa(heads: int, kv_heads: int, head_dim: int) -> None:
    """Keys and values read as bfloat16 and widened exactly: the float32 attention over the widened cache."""
    kernel = cpu_kernels.load(torch.bfloat16)
    assert kernel is not None and kernel.cache_dtype == torch.bfloat16
    query, keys, values, rows, reads = _scattered_step([1, 3, 40, 333, 64], heads, kv_heads, head_dim, seed=7)
    keys, values = keys.bfloat16(), values.bfloat16()
    out = torch.full_like(query, 123.0)
    kernel(query, keys, values, rows, head_dim**-0.5, out)
    for position, read in zip(rows.query_rows.tolist(), reads, strict=True):
        expected = functional.scaled_dot_product_attention(
            query[position].unsqueeze(1), keys[read].float().transpose(0, 1), values[read].float().transpose(0, 1),
            enable_gqa=True,
        )[:, 0]  # fmt: skip
        torch.testing.assert_close(out[position], expected)
    untouched = sorted(set(range(query.shape[0])) - set(rows.query_rows.tolist()))
    assert bool((out[untouched] == 123.0).all())
    with pytest.raises(ValueError, match="bfloat16 CPU keys"):
        kernel(query, keys.float(), values.float(), rows, 0.1, out)


def test_no_kernel_for_another_cache_dtype() -> None:
    assert cpu_kernels.load(torch.float16) is None
    assert isinstance(cpu_kernels.load(torch.float32), PagedDecode)


@native
async def test_a_lone_bfloat16_request_follows_bfloat16_generate(tiny_model_dir: Path, make_engine: Any) -> None:
    """One request at a time runs `generate`'s products (one row a step, the same kernel) but its own decode
    attention (float32 sums over the bfloat16 cache, where SDPA rounds its weights to bfloat16): the first token
    (from the prompt's step) is `generate`'s, and most requests' every token (measured 13 and 10 of 16 on the tiny
    models); a near-tie in a random tiny model can turn on the last bit."""
    model, tokenizer = load_bfloat16(tiny_model_dir)
    assert model.dtype == torch.bfloat16
    reference, _ = load_bfloat16(tiny_model_dir)
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    paths = engine.counters.paths
    assert paths["paged_decode"] == "compiled" and paths["decoder_layers"] == "lean"
    assert paths["few_rows"] == "compiled"  # `llmq:engine_path{component="few_rows"}`
    identical = 0
    for index, (ids, n) in enumerate(mixed_prompts(engine.vocab_size, count=16, seed=3)):
        deltas = await collect(engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n))))
        tokens, expected = tokens_of(deltas), reference_greedy(reference, ids, n)
        assert tokens[0] == expected[0], f"request {index}"
        identical += tokens == expected
    assert identical >= 8


@native
async def test_a_busy_bfloat16_engine_answers_everyone_in_full(llama_dir: Path, make_engine: Any) -> None:
    """Batched, a bfloat16 request's tokens may differ from `generate`'s (oneDNN's products change with the row
    count): each still gets all it asked for, and most agree with `generate` from the first token on."""
    model, tokenizer = load_bfloat16(llama_dir)
    reference, _ = load_bfloat16(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer, max_batch_tokens=64)
    workload = mixed_prompts(engine.vocab_size, count=12, seed=5)
    streams = [
        engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n, ignore_eos=True)))
        for index, (ids, n) in enumerate(workload)
    ]
    outputs = [tokens_of(await collect(stream)) for stream in streams]
    assert [len(tokens) for tokens in outputs] == [n for _, n in workload]
    with torch.no_grad():
        firsts = [int(reference(torch.tensor([ids])).logits[0, -1].argmax()) for ids, _ in workload]
    assert sum(tokens[0] == first for tokens, first in zip(outputs, firsts, strict=True)) >= len(workload) - 1


def test_without_native_bfloat16_the_loader_keeps_float32_and_says_why(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "native_bfloat16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="worker.engine.loader"):
        model, _ = load_bfloat16(llama_dir)
    assert model.dtype == torch.float32
    [record] = [record for record in caplog.records if record.name == "worker.engine.loader"]
    assert "without native bfloat16" in record.getMessage() and "float32" in record.getMessage()


def test_with_native_bfloat16_the_loader_loads_bfloat16(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "native_bfloat16", lambda: True)
    model, _ = load_bfloat16(llama_dir)
    assert model.dtype == torch.bfloat16
