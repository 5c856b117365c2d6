"""The float32 few-row kernel (`LLMQ_FLOAT32_FEW_ROWS`, off by default): the product it computes, where it writes,
what it refuses, and the engine with it on: every request answered in full, close to `generate` (not bitwise, which
is why it is an option), the default path untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.engine.conftest import record_rows, reference_greedy
from tests.engine.test_engine import collect, greedy, mixed_prompts, tokens_of
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import FewRows
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import PackedLinear, StackedLinears, few_rows_limit, packed_product, prepack
from worker.engine.types import EngineRequest

FLOAT32_FEW_ROWS = few_rows_limit(torch.float32)  # 16 with AVX-512, 6 with AVX2


@pytest.fixture
def few_rows() -> FewRows:
    built = cpu_kernels.few_rows(torch.float32)
    assert built is not None, "the float32 few-row kernel builds on any x86 CPU with AVX2 and FMA (CI's has them)"
    return built


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (33, 7), (7, 3), (8, 1)])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
def test_it_is_the_product_within_float32_rounding(
    few_rows: FewRows, in_features: int, out_features: int, biased: bool
) -> None:
    """Against the product in float64, for every row count it serves; widths below and off the vector width."""
    torch.manual_seed(in_features * 7 + out_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if biased else None
    for rows in range(1, FLOAT32_FEW_ROWS + 1):
        x = torch.randn(rows, in_features)
        exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
        out = few_rows(x, weight, bias)
        assert out.dtype == torch.float32 and out.shape == (rows, out_features)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_a_row_gets_the_same_bits_in_any_batch(few_rows: FewRows) -> None:
    torch.manual_seed(0)
    weight = torch.randn(3072, 576)
    x = torch.randn(FLOAT32_FEW_ROWS, 576)
    batched = few_rows(x, weight, None)
    for row in range(FLOAT32_FEW_ROWS):
        assert torch.equal(few_rows(x[row : row + 1].contiguous(), weight, None)[0], batched[row])


def test_it_writes_a_column_slice_and_nothing_around_it(few_rows: FewRows) -> None:
    torch.manual_seed(1)
    weight, bias, x = torch.randn(40, 96), torch.randn(40), torch.randn(3, 96)
    wide = torch.full((3, 50), 7.0)
    returned = few_rows(x, weight, bias, wide[:, 4:44])
    assert returned.data_ptr() == wide[:, 4:44].data_ptr()
    assert torch.equal(wide[:, 4:44], few_rows(x, weight, bias))
    assert bool((wide[:, :4] == 7.0).all()) and bool((wide[:, 44:] == 7.0).all())


def test_it_refuses_what_it_cannot_read_or_write(few_rows: FewRows) -> None:
    weight = torch.randn(8, 64)
    with pytest.raises(ValueError, match="contiguous float32"):
        few_rows(torch.randn(2, 64).double(), weight, None)
    with pytest.raises(ValueError, match="contiguous float32"):
        few_rows(torch.randn(64, 2).T, weight, None)
    with pytest.raises(ValueError, match="do not fit"):
        few_rows(torch.randn(2, 32), weight, None)
    with pytest.raises(ValueError, match="bias"):
        few_rows(torch.randn(2, 64), weight, torch.randn(7))
    with pytest.raises(ValueError, match="contiguous rows"):
        few_rows(torch.randn(2, 64), weight, None, torch.empty(8, 2).T)
    with pytest.raises(ValueError, match="contiguous rows"):
        few_rows(torch.randn(2, 64), weight, None, torch.empty(2, 9))


def test_no_few_row_kernel_for_other_dtypes() -> None:
    assert cpu_kernels.few_rows(torch.float16) is None and cpu_kernels.few_rows(torch.float64) is None


def _linears(seed: int, *shapes: tuple[int, int]) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(inputs, outputs) for outputs, inputs in shapes]


@pytest.mark.parametrize("asked", [False, True], ids=["default", "asked"])
def test_a_packed_layer_takes_the_kernel_for_a_few_rows_only_when_asked(few_rows: FewRows, asked: bool) -> None:
    """Asked: up to `few_rows_limit` rows are the kernel's bits, more are oneDNN's. Not asked (the default): every row
    count is oneDNN's packed product, as `generate`'s are."""
    [linear] = _linears(2, (40, 96))
    model = nn.Sequential(linear)
    assert prepack(model, float32_few_rows=asked) == 1 and type(model[0]) is PackedLinear
    packed = model[0]
    with torch.no_grad():
        for rows in (1, FLOAT32_FEW_ROWS, FLOAT32_FEW_ROWS + 1, 33):
            x = torch.randn(rows, 96)
            onednn = packed_product(x, packed.packed_weight(), packed.bias)
            kernel = few_rows(x, packed.weight.detach(), packed.bias.detach())
            expected = kernel if asked and rows <= FLOAT32_FEW_ROWS else onednn
            assert torch.equal(model(x), expected), rows


def test_stacked_layers_take_the_kernel_layer_by_layer(few_rows: FewRows) -> None:
    """q/k/v (or gate/up) stacked: each layer's columns are the kernel's product with that layer's own dense weight
    (no stacked dense copy is made), side by side; more rows go to the stacked packed product."""
    linears = [PackedLinear.wrap(linear, float32_few_rows=True) for linear in _linears(3, (48, 64), (16, 64), (16, 64))]
    stacked = StackedLinears(linears)
    with torch.no_grad():
        x = torch.randn(FLOAT32_FEW_ROWS, 64)
        expected = torch.cat([few_rows(x, linear.weight, linear.bias) for linear in linears], dim=1)
        assert torch.equal(stacked(x), expected)
        many = torch.randn(FLOAT32_FEW_ROWS + 3, 64)
        torch.testing.assert_close(stacked(many), torch.cat([linear(many) for linear in linears], dim=1))


async def test_an_engine_with_it_answers_in_full_close_to_generate(
    tiny_model_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded as the worker loads with `LLMQ_FLOAT32_FEW_ROWS=true`: one request at a time, every token asked for
    arrives, the decode steps' products run the kernel and the engine reports it; greedy tokens follow float32
    `generate` (the default model's agreement figures are the engine benchmark's: a decisive tiny model leaves no
    near-tie to flip)."""
    calls = record_rows(monkeypatch, FewRows, "__call__")
    options = LoadOptions(cache_dir=tiny_model_dir / "cache", float32_few_rows=True)
    model, tokenizer = load_model(str(tiny_model_dir), options)
    assert any(getattr(module, "float32_few_rows", False) for module in model.modules())
    reference, _ = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache"))
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    assert engine.counters.paths["few_rows"] == "compiled"  # `llmq:engine_path{component="few_rows"}`
    identical = 0
    for index, (ids, n) in enumerate(mixed_prompts(engine.vocab_size, count=8, seed=11)):
        tokens = tokens_of(await collect(engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n)))))
        expected = reference_greedy(reference, ids, n)
        assert len(tokens) == len(expected) and tokens[0] == expected[0], index
        identical += tokens == expected
    assert identical >= 6
    assert calls and max(calls) <= FLOAT32_FEW_ROWS


async def test_the_default_engine_reports_no_few_row_kernel(tiny_model_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache"))
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    assert "few_rows" not in engine.counters.paths
