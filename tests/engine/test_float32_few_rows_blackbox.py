"""Black-box tests of the opt-in float32 few-row kernel (`LLMQ_FLOAT32_FEW_ROWS`), written from its documented
contract only (docs/engine.md "Float32 few-row kernel (opt-in)", docs/workers.md, docs/operations/metrics.md).

The contract under test:

- `cpu_kernels.few_rows(torch.float32)` gives `FewRows(x, weight, bias, out=None)`: `x @ weight.T + bias` for
  contiguous float32 CPU tensors; with `out` (float32 `[rows, out]`, unit column stride, e.g. a column slice of a
  wider tensor) it writes there and returns it; a row's bits do not depend on the other rows of the call; anything
  else is refused with ValueError. `few_rows(torch.float16)` is None.
- `prepack(model, float32_few_rows=True)`: products of up to `few_rows_limit(torch.float32)` rows (16 with AVX-512,
  else 6) run the kernel on the dense weight, more run oneDNN's packed product; without the flag nothing changes.
- `LoadOptions(float32_few_rows=True)` loads so; the worker setting is `LLMQ_FLOAT32_FEW_ROWS` / `--float32-few-rows`.
- The engine reports `paths["few_rows"] == "compiled"` for such a model (none for a default float32 one), answers
  every request in full, first tokens equal to `generate`'s; outputs close to, not bitwise, `generate`'s.

References are computed in float64 from the very float32 numbers the kernel is given.
"""

from __future__ import annotations

import asyncio
import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from tests.engine.conftest import load, reference_greedy
from tests.engine.test_engine import collect, greedy, mixed_prompts, tokens_of
from tests.polling import wait_until
from worker.config import Settings
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import FewRows
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import PackedLinear, few_rows_limit, prepack
from worker.engine.types import EngineRequest, Finish

FLOAT32_FEW_ROWS = few_rows_limit(torch.float32)  # 16 with AVX-512, 6 with AVX2

UNIT_ROUNDOFF = 2.0**-24


@pytest.fixture(scope="module")
def kernel() -> FewRows:
    built = cpu_kernels.few_rows(torch.float32)
    if built is None:
        pytest.skip("the float32 few-row kernel cannot be built here (no AVX2+FMA or no compiler)")
    return built


def load_few_rows(folder: Path, **options: Any) -> tuple[Any, Any]:
    return load_model(str(folder), LoadOptions(cache_dir=folder / "cache", float32_few_rows=True, **options))


def exact_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def assert_float32_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within the worst-case error of any float32 summation order (FMA or not): gamma_n times the sum of |terms|,
    n the number of terms (in_features products plus the bias)."""
    exact = exact_product(x, weight, bias)
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    terms = x.shape[1] + 1
    bound = magnitude * (terms * UNIT_ROUNDOFF) * 1.01 + exact.abs() * UNIT_ROUNDOFF + 1e-44
    error = (out.double() - exact).abs()
    assert out.dtype == torch.float32
    assert bool(out.isfinite().all()), "a finite product came out non-finite"
    worst = int((error - bound).argmax()) if error.numel() else 0
    assert bool((error <= bound).all()), (
        f"few_rows off by {error.flatten()[worst].item():.3g} (bound {bound.flatten()[worst].item():.3g}) "
        f"at flat index {worst}: got {out.flatten()[worst].item()}, exact {exact.flatten()[worst].item()}"
    )


# ---------------------------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------------------------


def test_the_kernel_is_there_for_float32_only() -> None:
    assert cpu_kernels.few_rows(torch.float16) is None
    assert cpu_kernels.few_rows(torch.float64) is None
    built = cpu_kernels.few_rows(torch.float32)
    assert built is not None, "this AVX2 machine builds the float32 few-row kernel"
    assert isinstance(built, FewRows)
    assert cpu_kernels.few_rows(torch.float32) is built, "built once"


@pytest.mark.parametrize("in_features", [1, 7, 9, 15, 17, 64, 4097])
@pytest.mark.parametrize("out_features", [1, 7, 17])
@pytest.mark.parametrize("biased", [False, True], ids=["nobias", "bias"])
def test_the_kernel_is_the_product_at_odd_widths(
    kernel: FewRows, in_features: int, out_features: int, biased: bool
) -> None:
    """Widths that fill no vector (1, 7), one and a bit (9, 17), one short (15), many (4097): every row count it is
    documented to serve, and a couple more."""
    generator = torch.Generator().manual_seed(in_features * 100 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) * 3 if biased else None
    for rows in range(1, FLOAT32_FEW_ROWS + 3):
        x = torch.randn(rows, in_features, generator=generator)
        out = kernel(x, weight, bias)
        assert out.shape == (rows, out_features) and out.is_contiguous() and out.device.type == "cpu"
        assert_float32_product(out, x, weight, bias)


def test_the_kernel_is_exact_where_float32_sums_are(kernel: FewRows) -> None:
    """Small integers: every product and partial sum is exact in float32, in any order: the exact answer, bit for
    bit, with and without a bias."""
    generator = torch.Generator().manual_seed(5)
    for in_features, out_features in ((1, 1), (7, 3), (9, 17), (15, 2), (17, 9), (4097, 5)):
        weight = torch.randint(-3, 4, (out_features, in_features), generator=generator).float()
        bias = torch.randint(-50, 51, (out_features,), generator=generator).float()
        for rows in range(1, FLOAT32_FEW_ROWS + 1):
            x = torch.randint(-2, 3, (rows, in_features), generator=generator).float()
            assert torch.equal(kernel(x, weight, bias).double(), exact_product(x, weight, bias)), (in_features, rows)
            assert torch.equal(kernel(x, weight, None).double(), exact_product(x, weight, None))


def test_the_kernel_keeps_subnormals(kernel: FewRows) -> None:
    """Multiples of the smallest subnormal times small integers: sums of subnormals are exact, so a kernel that
    flushes them to zero (or reads them as zero) is caught."""
    tiny = 2.0**-149
    generator = torch.Generator().manual_seed(6)
    weight = torch.randint(-3, 4, (5, 17), generator=generator).float()
    x = torch.randint(-20, 21, (3, 17), generator=generator).float() * tiny
    assert bool((x[x != 0].abs() < 2.0**-126).all()), "the inputs are subnormal"
    out = kernel(x, weight, None)
    assert torch.equal(out.double(), exact_product(x, weight, None))
    assert bool((out != 0).any())


def test_the_kernel_handles_huge_values_and_overflow(kernel: FewRows) -> None:
    """Products near float32's largest numbers stay accurate; ones past it are infinite with the right sign."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.rand(7, 17, generator=generator) * 3e18 + 1e18
    x = torch.rand(4, 17, generator=generator) * 3e18 + 1e18  # each product <= 1.6e37, 17 of them <= 2.8e38
    assert_float32_product(kernel(x, weight, None), x, weight, None)
    assert_float32_product(kernel(-x, weight, None), -x, weight, None)

    big = torch.full((3, 9), 1e20)
    positive = torch.full((4, 9), 1e20)
    out = kernel(big, torch.cat([positive, -positive]), None)
    assert bool((out[:, :4] == float("inf")).all()) and bool((out[:, 4:] == float("-inf")).all())
    assert torch.equal(out, nn.functional.linear(big, torch.cat([positive, -positive])))


def test_the_kernel_at_zero_sizes(kernel: FewRows) -> None:
    """No rows: an empty output; no output columns: an empty output; no input columns: the bias (zeros without)."""
    weight = torch.randn(5, 8)
    bias = torch.randn(5)
    assert kernel(torch.empty(0, 8), weight, bias).shape == (0, 5)
    assert kernel(torch.randn(3, 8), torch.empty(0, 8), torch.empty(0)).shape == (3, 0)
    empty_in = torch.empty(3, 0)
    assert torch.equal(kernel(empty_in, torch.empty(5, 0), bias), bias.expand(3, 5))
    assert torch.equal(kernel(empty_in, torch.empty(5, 0), None), torch.zeros(3, 5))


def test_the_kernel_propagates_nan_and_inf_to_their_own_outputs_only(kernel: FewRows) -> None:
    in_features, out_features = 17, 9
    generator = torch.Generator().manual_seed(9)
    weight = torch.rand(out_features, in_features, generator=generator) + 0.5  # positive
    x = torch.rand(FLOAT32_FEW_ROWS, in_features, generator=generator) + 0.25
    clean = kernel(x, weight, None)
    assert bool(clean.isfinite().all())

    poisoned = x.clone()
    poisoned[1, in_features - 1] = float("nan")  # the last element: past the last full vector
    poisoned[3, 0] = float("inf")
    poisoned[4, 8] = float("-inf")
    out = kernel(poisoned, weight, None)
    assert bool(out[1].isnan().all()), "a NaN input makes its row NaN"
    assert bool((out[3] == float("inf")).all()), "an +inf input times positive weights is +inf"
    assert bool((out[4] == float("-inf")).all())
    for row in (0, 2, 5):
        assert torch.equal(out[row], clean[row]), "rows beside a NaN or inf keep their bits"

    inf_weight = weight.clone()
    inf_weight[2, in_features - 1] = float("inf")
    nan_weight = inf_weight.clone()
    nan_weight[6, 3] = float("nan")
    zero_there = x.clone()
    zero_there[0, in_features - 1] = 0.0  # 0 * inf = NaN
    out = kernel(zero_there, nan_weight, None)
    assert bool(out[0, 2].isnan()) and bool((out[1:, 2] == float("inf")).all())
    assert bool(out[:, 6].isnan().all()), "a NaN weight makes its column NaN in every row"
    keep = [c for c in range(out_features) if c not in (2, 6)]
    assert torch.equal(out[1:, keep], clean[1:, keep])

    nan_bias = torch.zeros(out_features)
    nan_bias[4] = float("nan")
    nan_bias[7] = float("-inf")
    out = kernel(x, weight, nan_bias)
    assert bool(out[:, 4].isnan().all()) and bool((out[:, 7] == float("-inf")).all())
    assert bool(out[:, [0, 1, 2, 3, 5, 6, 8]].isfinite().all())


@pytest.mark.parametrize(("in_features", "out_features"), [(17, 9), (4097, 7), (64, 300), (1, 1)])
def test_a_row_gets_the_same_bits_whatever_else_is_in_the_call(
    kernel: FewRows, in_features: int, out_features: int
) -> None:
    """A row alone, in any batch of 1..FLOAT32_FEW_ROWS+2 rows, in any position, repeated: the same bits."""
    generator = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    pool = torch.randn(FLOAT32_FEW_ROWS + 2, in_features, generator=generator)
    alone = torch.stack([kernel(pool[i : i + 1].contiguous(), weight, bias)[0] for i in range(pool.shape[0])])
    rng = random.Random(in_features)
    for count in range(1, pool.shape[0] + 1):
        for _ in range(3):
            chosen = rng.choices(range(pool.shape[0]), k=count)  # duplicates too
            out = kernel(pool[chosen].contiguous(), weight, bias)
            assert torch.equal(out, alone[chosen]), (count, chosen)


def test_the_kernel_writes_a_column_slice_and_nothing_around_it(kernel: FewRows) -> None:
    """Products stacked side by side in one output: each writes only its columns, and the same bits as into a
    fresh tensor; the slice given is the tensor returned."""
    generator = torch.Generator().manual_seed(11)
    widths = [7, 1, 17, 9]
    in_features = 33
    weights = [torch.randn(w, in_features, generator=generator) for w in widths]
    biases = [torch.randn(w, generator=generator) if i % 2 else None for i, w in enumerate(widths)]
    total = sum(widths) + 5
    for rows in range(1, FLOAT32_FEW_ROWS + 1):
        x = torch.randn(rows, in_features, generator=generator)
        wide = torch.full((rows + 2, total), -7.5)
        first = 2
        for weight, bias in zip(weights, biases, strict=True):
            target = wide[1 : rows + 1, first : first + weight.shape[0]]
            before = wide.clone()
            returned = kernel(x, weight, bias, target)
            assert returned.data_ptr() == target.data_ptr() and returned.shape == (rows, weight.shape[0])
            assert torch.equal(returned, kernel(x, weight, bias))
            changed = wide != before
            changed[1 : rows + 1, first : first + weight.shape[0]] = False
            assert not bool(changed.any()), f"rows {rows}: wrote outside columns {first}..{first + weight.shape[0]}"
            first += weight.shape[0]
        assert bool((wide[0] == -7.5).all()) and bool((wide[rows + 1] == -7.5).all())
        assert bool((wide[:, :2] == -7.5).all()) and bool((wide[:, first:] == -7.5).all())


def test_the_kernel_writes_a_whole_contiguous_out(kernel: FewRows) -> None:
    x, weight, bias = torch.randn(4, 20), torch.randn(6, 20), torch.randn(6)
    out = torch.full((4, 6), float("nan"))
    assert kernel(x, weight, bias, out) is out
    assert torch.equal(out, kernel(x, weight, bias))


def test_the_kernel_refuses_what_it_cannot_read_or_write(kernel: FewRows) -> None:
    weight = torch.randn(8, 40)
    x = torch.randn(3, 40)
    bias = torch.randn(8)
    refused: list[tuple[str, tuple[Any, ...]]] = [
        ("float64 rows", (x.double(), weight, None)),
        ("float64 weight", (x, weight.double(), None)),
        ("float64 bias", (x, weight, bias.double())),
        ("bfloat16 rows", (x.bfloat16(), weight, None)),
        ("bfloat16 everything", (x.bfloat16(), weight.bfloat16(), bias.bfloat16())),
        ("float16 rows", (x.half(), weight, None)),
        ("transposed rows", (torch.randn(40, 3).T, weight, None)),
        ("transposed weight", (x, torch.randn(40, 8).T, None)),
        ("strided bias", (x, weight, torch.randn(16)[::2])),
        ("narrow rows", (torch.randn(3, 39), weight, None)),
        ("wide rows", (torch.randn(3, 41), weight, None)),
        ("1-D rows", (torch.randn(40), weight, None)),
        ("3-D rows", (torch.randn(1, 3, 40), weight, None)),
        ("1-D weight", (x, torch.randn(40), None)),
        ("short bias", (x, weight, torch.randn(7))),
        ("long bias", (x, weight, torch.randn(9))),
        ("2-D bias", (x, weight, torch.randn(1, 8))),
        ("out of float64", (x, weight, bias, torch.empty(3, 8, dtype=torch.float64))),
        ("out of bfloat16", (x, weight, bias, torch.empty(3, 8, dtype=torch.bfloat16))),
        ("out too narrow", (x, weight, bias, torch.empty(3, 7))),
        ("out too wide", (x, weight, bias, torch.empty(3, 9))),
        ("out with too few rows", (x, weight, bias, torch.empty(2, 8))),
        ("out 1-D", (x, weight, bias, torch.empty(24))),
        ("out transposed", (x, weight, bias, torch.empty(8, 3).T)),
        ("out of every other column", (x, weight, bias, torch.empty(3, 16)[:, ::2])),
        ("out of overlapping rows", (x, weight, bias, torch.empty(40).as_strided((3, 8), (4, 1)))),
    ]
    for what, arguments in refused:
        with pytest.raises(ValueError):
            kernel(*arguments)
            pytest.fail(f"few_rows accepted {what}")


# ---------------------------------------------------------------------------------------------------------------
# Float32 linears through prepack
# ---------------------------------------------------------------------------------------------------------------


def tied_model(seed: int, *, bias: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    shared = nn.Linear(45, 7, bias=bias)
    return nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Linear(7, 45, bias=False), nn.Sequential(shared))


@pytest.mark.parametrize("biased", [True, False], ids=["bias", "nobias"])
def test_prepack_with_the_flag_routes_rows_as_documented(kernel: FewRows, biased: bool) -> None:
    """Up to `few_rows_limit` rows: the kernel's bits on the dense weight; more: the default packed layer's bits. Tied
    layers stay one module sharing one parameter; the state dict is unchanged."""
    model = tied_model(3, bias=biased)
    default = copy.deepcopy(model)
    keys = list(model.state_dict())
    assert prepack(model, float32_few_rows=True) == 2
    assert prepack(default) == 2
    first, last = model[0][0], model[2][0]
    assert type(first) is PackedLinear and first is last and type(model[1]) is PackedLinear
    assert model[0][0].weight is model[2][0].weight
    assert list(model.state_dict()) == keys
    weight = first.weight.detach()
    bias = None if first.bias is None else first.bias.detach()
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for rows in (1, 2, 3, 5, FLOAT32_FEW_ROWS, FLOAT32_FEW_ROWS + 1, 8, 9, 17, 33, 100):
            x = torch.randn(rows, 45, generator=generator)
            out = first(x)
            assert out.shape == (rows, 7) and out.dtype == torch.float32
            if rows <= FLOAT32_FEW_ROWS:
                assert torch.equal(out, kernel(x, weight, bias)), rows
            else:
                assert torch.equal(out, default[0][0](x)), rows
            assert_float32_product(out, x, weight, bias)
            whole = model(x)
            assert whole.shape == (rows, 7)
            torch.testing.assert_close(whole, default(x), rtol=1e-5, atol=1e-5)
            if rows > FLOAT32_FEW_ROWS:
                assert torch.equal(whole, default(x)), f"{rows} rows go through oneDNN as without the flag"

        x3 = torch.randn(2, 3, 45, generator=generator)  # 6 rows through a 3-D input
        assert torch.equal(first(x3), kernel(x3.reshape(6, 45), weight, bias).view(2, 3, 7))
        x3 = torch.randn(2, FLOAT32_FEW_ROWS, 45, generator=generator)  # twice the limit's rows through a 3-D input
        assert torch.equal(first(x3), default[0][0](x3))
        strided = torch.randn(45, 4, generator=generator).T  # non-contiguous rows are made contiguous, not refused
        assert torch.equal(first(strided), kernel(strided.contiguous(), weight, bias))
        empty = first(torch.empty(0, 45))
        assert empty.shape == (0, 7)


def test_a_weight_changed_in_place_is_used_at_once_with_the_flag(kernel: FewRows) -> None:
    model = tied_model(5)
    prepack(model, float32_few_rows=True)
    layer = model[0][0]
    with torch.no_grad():
        few, many = torch.randn(2, 45), torch.randn(FLOAT32_FEW_ROWS + 3, 45)
        before_few, before_many = layer(few), layer(many)
        layer.weight.mul_(2)
        layer.bias.add_(1)
        after_few, after_many = layer(few), layer(many)
        assert not torch.equal(before_few, after_few) and not torch.equal(before_many, after_many)
        assert torch.equal(after_few, kernel(few, layer.weight.detach(), layer.bias.detach()))
        assert_float32_product(after_many, many, layer.weight.detach(), layer.bias.detach())


def test_without_the_flag_prepack_is_the_default_path() -> None:
    """Default and explicit False: the same bits at every row count, the few-row counts included."""
    model = tied_model(6)
    explicit = copy.deepcopy(model)
    prepack(model)
    prepack(explicit, float32_few_rows=False)
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for rows in range(1, 12):
            x = torch.randn(rows, 45, generator=generator)
            assert torch.equal(model(x), explicit(x)), rows


def test_the_flag_leaves_other_dtypes_alone() -> None:
    """Bfloat16 layers keep bfloat16's products (the flag is float32's); float16 layers are not wrapped at all."""
    bf16 = tied_model(7).to(torch.bfloat16)
    bf16_flagged = copy.deepcopy(bf16)
    prepack(bf16)
    prepack(bf16_flagged, float32_few_rows=True)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for rows in (1, 4, FLOAT32_FEW_ROWS, 9):
            x = torch.randn(rows, 45, generator=generator).bfloat16()
            out = bf16_flagged(x)
            assert out.dtype == torch.bfloat16 and torch.equal(out, bf16(x)), rows

    half = tied_model(8).half()
    plain = copy.deepcopy(half)
    assert prepack(half, float32_few_rows=True) == 0
    assert not any(isinstance(m, PackedLinear) for m in half.modules())
    x = torch.randn(3, 45).half()
    with torch.no_grad():
        assert torch.equal(half(x), plain(x))


def test_a_flagged_layer_still_trains() -> None:
    """With autograd on, gradients flow to the float32 weights at a few rows too."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(33, 5))
    prepack(model, float32_few_rows=True)
    x = torch.randn(3, 33)
    out = model(x)
    assert out.requires_grad
    out.sum().backward()
    grad = model[0].weight.grad
    assert grad is not None and grad.shape == (5, 33)
    torch.testing.assert_close(grad, x.sum(0).expand(5, 33))


# ---------------------------------------------------------------------------------------------------------------
# The loader and the worker setting
# ---------------------------------------------------------------------------------------------------------------


def test_the_loader_with_the_option_is_close_to_the_default_model(tiny_model_dir: Path) -> None:
    """Prompts of up to FLOAT32_FEW_ROWS tokens: logits close to the default model's. Longer prompts: every product has
    more rows than FLOAT32_FEW_ROWS, so the logits are the default model's bit for bit."""
    model, _ = load_few_rows(tiny_model_dir)
    default, _ = load(tiny_model_dir)
    assert LoadOptions().float32_few_rows is False
    assert model.dtype == torch.float32
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    assert packed and all(m.float32_few_rows for m in packed)
    assert not any(getattr(m, "float32_few_rows", False) for m in default.modules())
    vocab = model.config.vocab_size
    rng = random.Random(13)
    with torch.no_grad():
        for length in (1, 2, 5, FLOAT32_FEW_ROWS):
            ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(length)]])
            ours, theirs = model(ids).logits, default(ids).logits
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
            assert int(ours[0, -1].argmax()) == int(theirs[0, -1].argmax())
        for length in (FLOAT32_FEW_ROWS + 1, 20, 70):
            ids = torch.tensor([[rng.randrange(3, vocab) for _ in range(length)]])
            assert torch.equal(model(ids).logits, default(ids).logits), f"a {length}-token prompt"


def test_the_loader_without_prepack_ignores_the_option(tiny_model_dir: Path) -> None:
    model, _ = load_few_rows(tiny_model_dir, prepack=False)
    default, _ = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache", prepack=False))
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, default(ids).logits)


def test_the_setting_parses_from_the_environment_and_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMQ_FLOAT32_FEW_ROWS", raising=False)
    assert Settings(_env_file=None).float32_few_rows is False  # type: ignore[call-arg]
    for text, value in (("true", True), ("TRUE", True), ("1", True), ("yes", True), ("false", False), ("0", False)):
        monkeypatch.setenv("LLMQ_FLOAT32_FEW_ROWS", text)
        assert Settings(_env_file=None).float32_few_rows is value, text  # type: ignore[call-arg]
    monkeypatch.setenv("LLMQ_FLOAT32_FEW_ROWS", "maybe")
    with pytest.raises(ValidationError):
        Settings(_env_file=None)  # type: ignore[call-arg]
    monkeypatch.delenv("LLMQ_FLOAT32_FEW_ROWS")
    flagged = Settings(_env_file=None, _cli_parse_args=["--float32-few-rows"])  # type: ignore[call-arg]
    assert flagged.float32_few_rows is True
    assert Settings(_env_file=None, _cli_parse_args=[]).float32_few_rows is False  # type: ignore[call-arg]


# ---------------------------------------------------------------------------------------------------------------
# The engine with the option
# ---------------------------------------------------------------------------------------------------------------


def assert_full_answer(deltas: list[Any], request_id: str, n: int, prompt_length: int, vocab: int) -> None:
    tokens = tokens_of(deltas)
    assert len(tokens) == n, f"{request_id}: {len(tokens)} tokens of {n}"
    assert all(0 <= token < vocab for token in tokens), f"{request_id}: a token outside the vocabulary"
    assert all(d.request_id == request_id for d in deltas)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == Finish.LENGTH
    assert deltas[-1].prompt_tokens == prompt_length


async def test_the_engine_reports_the_kernel_only_when_asked(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load_few_rows(llama_dir)
    flagged = await make_engine(llama_dir, model=model, tokenizer=tokenizer)
    assert flagged.counters.paths["few_rows"] == "compiled"
    default = await make_engine(llama_dir)
    assert "few_rows" not in default.counters.paths


async def test_a_busy_engine_with_the_option_answers_every_request_in_full(
    tiny_model_dir: Path, make_engine: Any
) -> None:
    """Eight requests at once, short prompts (whole prefills of a few rows) and long ones, lengths staggered so
    steps go from more than FLOAT32_FEW_ROWS rows to fewer: every one answered in full, first token `generate`'s."""
    model, tokenizer = load_few_rows(tiny_model_dir)
    reference, _ = load(tiny_model_dir)
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer, max_batch_tokens=64)
    assert engine.counters.paths["few_rows"] == "compiled"
    vocab = engine.vocab_size
    rng = random.Random(23)
    lengths = [1, 3, 6, 7, 15, 40, 90, 150]
    news = [30, 4, 22, 9, 17, 1, 26, 12]
    workload = [([rng.randrange(3, vocab) for _ in range(length)], n) for length, n in zip(lengths, news, strict=True)]
    streams = [
        engine.submit(EngineRequest(f"b{i}", input_ids=ids, params=greedy(n, ignore_eos=True)))
        for i, (ids, n) in enumerate(workload)
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for index, ((ids, n), deltas) in enumerate(zip(workload, results, strict=True)):
        assert_full_answer(deltas, f"b{index}", n, len(ids), vocab)
        assert tokens_of(deltas)[0] == reference_greedy(reference, ids, 1)[0], f"request {index}"
    await wait_until(lambda: engine.stats().running == engine.stats().waiting == 0)
    stats = engine.stats()
    assert stats.kv_blocks_reserved == 0
    assert stats.requests_finished == {"length": len(workload)}


async def test_lone_requests_with_the_option_start_with_generates_token(llama_dir: Path, make_engine: Any) -> None:
    """One at a time (every decode step one row: the kernel): the first token is `generate`'s, most whole
    answers are too, and a rerun gives the same tokens."""
    model, tokenizer = load_few_rows(llama_dir)
    reference, _ = load(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer, prefix_sharing=False)
    vocab = engine.vocab_size
    rng = random.Random(29)
    lengths = [1, 2, 6, 7, 16, 33, 100]
    identical = 0
    for index, length in enumerate(lengths):
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        tokens = tokens_of(await collect(engine.submit(EngineRequest(f"l{index}", input_ids=ids, params=greedy(10)))))
        expected = reference_greedy(reference, ids, 10)
        assert tokens and tokens[0] == expected[0], f"a {length}-token prompt: {tokens[:3]} vs {expected[:3]}"
        identical += tokens == expected
        again = await collect(engine.submit(EngineRequest(f"again{index}", input_ids=ids, params=greedy(10))))
        assert tokens_of(again) == tokens, f"a {length}-token prompt: not deterministic alone"
    assert identical >= len(lengths) // 2, f"only {identical} of {len(lengths)} answers equal generate's"


async def test_cancel_mid_stream_with_the_option_leaves_others_whole(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load_few_rows(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer)
    vocab = engine.vocab_size
    long = engine.submit(EngineRequest("long", input_ids=list(range(3, 40)), params=greedy(600, ignore_eos=True)))
    others = [
        engine.submit(EngineRequest(f"o{i}", input_ids=[6 + i, 7, 8], params=greedy(20 + i, ignore_eos=True)))
        for i in range(3)
    ]
    first = await anext(long)
    assert first.token_ids and first.finish_reason is None
    await wait_until(lambda: engine.stats().kv_blocks_used > 0)
    assert engine.cancel("long")
    rest = await collect(long)
    assert rest[-1].finish_reason == Finish.CANCELLED
    assert len(tokens_of([first, *rest])) < 600
    for i, deltas in enumerate(await asyncio.gather(*(collect(s) for s in others))):
        assert_full_answer(deltas, f"o{i}", 20 + i, 3, vocab)
    await wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.idle)
    assert engine.stats().kv_blocks_reserved == 0
    assert not engine.cancel("long")
    after = await collect(engine.submit(EngineRequest("after", input_ids=[9, 10], params=greedy(7, ignore_eos=True))))
    assert_full_answer(after, "after", 7, 2, vocab)


async def test_where_the_kernel_cannot_be_built_the_engine_keeps_onednn(
    llama_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No kernel (as on a CPU without AVX2): `few_rows` reads `fallback`, and the outputs are the default float32
    path's, bitwise `generate`'s."""
    monkeypatch.setattr(cpu_kernels, "few_rows", lambda dtype=torch.bfloat16: None)
    model, tokenizer = load_few_rows(llama_dir)
    reference, _ = load(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer, max_batch_tokens=64)
    assert engine.counters.paths["few_rows"] == "fallback"
    workload = mixed_prompts(engine.vocab_size, count=6, seed=37)
    streams = [
        engine.submit(EngineRequest(f"f{i}", input_ids=ids, params=greedy(n))) for i, (ids, n) in enumerate(workload)
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for index, ((ids, n), deltas) in enumerate(zip(workload, results, strict=True)):
        assert tokens_of(deltas) == reference_greedy(reference, ids, n), f"request {index}"


async def test_the_default_float32_engine_is_still_generate_bitwise(llama_dir: Path, make_engine: Any) -> None:
    reference, _ = load(llama_dir)
    engine = await make_engine(llama_dir, max_batch_tokens=64)
    assert "few_rows" not in engine.counters.paths
    workload = mixed_prompts(engine.vocab_size, count=6, seed=41)
    streams = [
        engine.submit(EngineRequest(f"d{i}", input_ids=ids, params=greedy(n))) for i, (ids, n) in enumerate(workload)
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for index, ((ids, n), deltas) in enumerate(zip(workload, results, strict=True)):
        assert tokens_of(deltas) == reference_greedy(reference, ids, n), f"request {index}"
