"""Black-box tests of the few-row kernels' row limits, written from the documented contract only (the docstrings of
`worker/engine/prepack.py` and `cpu_kernels`, docs/engine.md "Bfloat16 on CPU" and "Float32 few-row kernel
(opt-in)", CHANGELOG.md's "Unreleased" section, `bench/few_rows.py`'s usage).

The contract under test:

- `prepack.few_rows_limit(dtype)` (cached) is `FEW_ROWS` (6) for bfloat16 with AMX, else
  `FEW_ROWS_BFLOAT16_WITHOUT_AMX` (32); `FEW_ROWS_FLOAT32_AVX512` (16) for float32 with AVX-512, else `FEW_ROWS`;
  it reads `cpu_kernels.amx()` and `cpu_kernels.avx512()`.
- `prepack(model)`: a bfloat16 product of up to the limit's rows gives `cpu_kernels.few_rows(torch.bfloat16)`'s
  bits, beyond it torch's linear on the rows padded to `row_bucket(rows)`. With `float32_few_rows=True` the same
  for float32 (`few_rows(torch.float32)`; beyond: `packed_product` on the packed weight); without it float32 never
  takes the kernel.
- The kernels are batch invariant for every row count up to the limit: `x @ weight.T + bias`, bfloat16 rounded
  once from float32 sums, float32 within float32 rounding.
- `cpu_kernels.few_rows(dtype, source)` builds another version of the kernel file; `python -m bench.few_rows`
  prints one line per row count, then one JSON line (`other_ms`, `other_equal_bits` with `--kernel-source`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.engine import prepack as prepack_module
from worker.engine.kernels import cpu_kernels
from worker.engine.prepack import PackedLinear, few_rows_limit, packed_product, prepack, row_bucket

REPO = Path(__file__).resolve().parents[2]
KERNELS = Path(cpu_kernels.__file__).resolve().parent
DTYPES = (torch.bfloat16, torch.float32)

needs_bfloat16 = pytest.mark.skipif(
    not cpu_kernels.native_bfloat16(),
    reason="this CPU has no AVX-512 BF16: bfloat16 few-row products are documented for such CPUs only",
)


def _kernel(dtype: torch.dtype) -> cpu_kernels.FewRows:
    """The shipped few-row kernel for `dtype`, or a skip naming why it is missing here."""
    if dtype == torch.bfloat16 and not cpu_kernels.native_bfloat16():
        pytest.skip("this CPU has no AVX-512 BF16: no bfloat16 few-row kernel")
    kernel = cpu_kernels.few_rows(dtype)
    if kernel is None:
        pytest.skip(f"the {dtype} few-row kernel cannot be built here (no AVX2+FMA/AVX-512 or no compiler)")
    return kernel


def _dtype_params() -> list[pytest.ParameterSet]:
    """Both dtypes, bfloat16 marked to skip on a CPU without AVX-512 BF16."""
    return [
        pytest.param(torch.bfloat16, id="bfloat16", marks=needs_bfloat16),
        pytest.param(torch.float32, id="float32"),
    ]


def _random(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Reproducible random `[rows, cols]` in `dtype` (drawn in float32, then converted)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator).to(dtype).contiguous()


def _one_linear(in_features: int, out_features: int, dtype: torch.dtype, seed: int) -> nn.Sequential:
    """A model of one biased linear layer in `dtype`, with random weight and bias."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=True)).to(dtype)
    model.eval()
    return model


def _prepacked(model: nn.Sequential, *, float32_few_rows: bool = False) -> PackedLinear:
    """Prepacks `model` (one layer) and returns its `PackedLinear`."""
    swapped = prepack(model, float32_few_rows=float32_few_rows)
    if swapped == 0:
        pytest.skip("prepack is a no-op here (no oneDNN)")
    assert swapped == 1
    layer = model[0]
    assert isinstance(layer, PackedLinear)
    return layer


def _same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Asserts equal dtype, shape and bits, saying where they first differ."""
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    if not torch.equal(actual, expected):
        where = (actual != expected).nonzero()[0].tolist()
        diff = int((actual != expected).sum())
        raise AssertionError(f"{what}: {diff} elements differ, first at {where}")


@pytest.fixture
def fresh_limit() -> Iterator[None]:
    """Clears `few_rows_limit`'s cache before and after, so a patched CPU never leaks into other tests."""
    few_rows_limit.cache_clear()
    yield
    few_rows_limit.cache_clear()


# --- the limits under each CPU ---------------------------------------------------------------------------------


def test_limit_constants_are_the_documented_values() -> None:
    """`FEW_ROWS` 6, `FEW_ROWS_BFLOAT16_WITHOUT_AMX` 32, `FEW_ROWS_FLOAT32_AVX512` 16, as the docs give them."""
    assert prepack_module.FEW_ROWS == 6
    assert prepack_module.FEW_ROWS_BFLOAT16_WITHOUT_AMX == 32
    assert prepack_module.FEW_ROWS_FLOAT32_AVX512 == 16


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
@pytest.mark.parametrize("avx512", [False, True], ids=["no-avx512", "avx512"])
def test_limit_under_each_cpu_combination(
    monkeypatch: pytest.MonkeyPatch, fresh_limit: None, amx: bool, avx512: bool
) -> None:
    """Each CPU combination (through `cpu_kernels.amx()` / `avx512()`) gives the documented limit per dtype."""
    try:
        with monkeypatch.context() as patch:
            patch.setattr(cpu_kernels, "amx", lambda: amx)
            patch.setattr(cpu_kernels, "avx512", lambda: avx512)
            few_rows_limit.cache_clear()
            bfloat16_limit = few_rows_limit(torch.bfloat16)
            float32_limit = few_rows_limit(torch.float32)
    finally:
        few_rows_limit.cache_clear()
    assert bfloat16_limit == (prepack_module.FEW_ROWS if amx else prepack_module.FEW_ROWS_BFLOAT16_WITHOUT_AMX)
    assert float32_limit == (prepack_module.FEW_ROWS_FLOAT32_AVX512 if avx512 else prepack_module.FEW_ROWS)


def test_limit_is_cached_and_restored(monkeypatch: pytest.MonkeyPatch, fresh_limit: None) -> None:
    """A cached limit outlives a later CPU patch until the cache is cleared; cleared, the real CPU's comes back."""
    real = {dtype: few_rows_limit(dtype) for dtype in DTYPES}
    amx, avx512 = cpu_kernels.amx(), cpu_kernels.avx512()
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "amx", lambda: not amx)
        patch.setattr(cpu_kernels, "avx512", lambda: not avx512)
        assert {dtype: few_rows_limit(dtype) for dtype in DTYPES} == real, "few_rows_limit is not cached"
        few_rows_limit.cache_clear()
        flipped = {dtype: few_rows_limit(dtype) for dtype in DTYPES}
        assert flipped != real, "few_rows_limit does not read cpu_kernels.amx()/avx512()"
    few_rows_limit.cache_clear()
    assert {dtype: few_rows_limit(dtype) for dtype in DTYPES} == real


def test_real_limit_matches_this_cpu() -> None:
    """Unpatched, the limits follow this CPU's own `amx()` and `avx512()`."""
    few_rows_limit.cache_clear()
    expected_bfloat16 = 6 if cpu_kernels.amx() else 32
    expected_float32 = 16 if cpu_kernels.avx512() else 6
    assert few_rows_limit(torch.bfloat16) == expected_bfloat16
    assert few_rows_limit(torch.float32) == expected_float32


# --- routing at the boundary -----------------------------------------------------------------------------------


def _spread_rows(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows whose magnitudes span a few powers of ten, so that two summation orders disagree more often."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=generator) * torch.exp(2 * torch.randn(rows, cols, generator=generator))
    return values.to(dtype).contiguous()


def _both_ways(layer: PackedLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented references for `x` through `layer`: the few-row kernel's bits and oneDNN's (bfloat16:
    torch's linear on the rows padded to `row_bucket`; float32: `packed_product` on the packed weight)."""
    weight, bias = layer.weight.detach(), layer.bias.detach()
    rows = x.shape[0]
    with torch.no_grad():
        few = _kernel(x.dtype)(x, weight, bias)
        if x.dtype == torch.bfloat16:
            padded = torch.cat([x, x.new_zeros(row_bucket(rows) - rows, x.shape[1])])
            onednn = F.linear(padded, weight, bias)[:rows]
        else:
            onednn = packed_product(x, layer.packed_weight(), layer.bias)
    return few, onednn


@pytest.mark.parametrize("dtype", _dtype_params())
def test_routing_at_the_limit(dtype: torch.dtype) -> None:
    """Through `prepack` (the flag set for float32): up to the limit the kernel's bits, one row more oneDNN's. At
    the limit and one past it the input is drawn (up to 20 tries) where the two ways' bits differ."""
    _kernel(dtype)
    limit = few_rows_limit(dtype)
    layer = _prepacked(_one_linear(512, 256, dtype, seed=1), float32_few_rows=dtype == torch.float32)
    for rows in (1, 2, limit - 1, limit, limit + 1):
        for attempt in range(20):
            x = _spread_rows(rows, 512, dtype, seed=1000 * rows + attempt)
            few, onednn = _both_ways(layer, x)
            if rows < limit - 1 or not torch.equal(few, onednn):
                break
        else:
            pytest.skip(f"{dtype}: kernel and oneDNN agreed bitwise at {rows} rows on 20 inputs, routing unobservable")
        with torch.no_grad():
            actual = layer(x)
        expected, way = (few, "the few-row kernel") if rows <= limit else (onednn, "oneDNN")
        _same_bits(actual, expected, f"{dtype}, {rows} rows (limit {limit}) should be {way}'s")


def test_float32_without_the_flag_never_takes_the_kernel() -> None:
    """Float32 prepacked without the flag gives oneDNN's packed bits at every row count up to the limit and past."""
    limit = few_rows_limit(torch.float32)
    layer = _prepacked(_one_linear(512, 96, torch.float32, seed=3))
    assert layer.few_rows_weight() is None
    for rows in range(1, limit + 2):
        x = _random(rows, 512, torch.float32, seed=300 + rows)
        with torch.no_grad():
            actual = layer(x)
            expected = packed_product(x, layer.packed_weight(), layer.bias)
        _same_bits(actual, expected, f"float32 default, {rows} rows")


def test_float32_flag_keeps_the_dense_weight_for_the_kernel() -> None:
    """With the flag the few-row product runs on the layer's own dense weight (no copy, no memory added)."""
    _kernel(torch.float32)
    layer = _prepacked(_one_linear(45, 7, torch.float32, seed=4), float32_few_rows=True)
    dense = layer.few_rows_weight()
    assert dense is not None
    assert dense.data_ptr() == layer.weight.data_ptr()


# --- batch invariance up to the limit --------------------------------------------------------------------------


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T + bias` in float64 from the very numbers the kernel is given."""
    return x.double() @ weight.double().T + bias.double()


def _check_close(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Bfloat16: within one bfloat16 rounding (plus float32 sums) of the exact product; float32: within float32's."""
    exact = _reference(x, weight, bias)
    if actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.double(), exact, rtol=2**-8, atol=1e-5)
    else:
        scale = (x.double().abs() @ weight.double().abs().T + bias.double().abs()).max().item()
        torch.testing.assert_close(actual.double(), exact, rtol=0, atol=scale * 1e-6)


@pytest.mark.parametrize("dtype", _dtype_params())
def test_kernel_batch_invariance_up_to_the_limit(dtype: torch.dtype) -> None:
    """Every row of every call of 1..limit rows (in 45, out 7, bias) has the bits of that row alone."""
    kernel = _kernel(dtype)
    limit = few_rows_limit(dtype)
    weight = _random(7, 45, dtype, seed=11)
    bias = _random(1, 7, dtype, seed=12)[0].contiguous()
    rows = _random(limit, 45, dtype, seed=13)
    others = _random(limit, 45, dtype, seed=14)
    alone = torch.cat([kernel(rows[i : i + 1].contiguous(), weight, bias) for i in range(limit)])
    _check_close(alone, rows, weight, bias)
    for count in range(1, limit + 1):
        _same_bits(kernel(rows[:count].contiguous(), weight, bias), alone[:count], f"{dtype}, first {count} rows")
        for position in {0, count // 2, count - 1}:
            batch = others[:count].clone()
            batch[position] = rows[0]
            out = kernel(batch, weight, bias)
            _same_bits(out[position], alone[0], f"{dtype}, row 0 at {position} of {count} among other rows")
            _check_close(out, batch, weight, bias)


@pytest.mark.parametrize("dtype", _dtype_params())
def test_prepacked_layer_batch_invariance_up_to_the_limit(dtype: torch.dtype) -> None:
    """Through `prepack` (the flag set for float32) a row's output has the same bits at every count up to the
    limit, and those are the kernel's."""
    kernel = _kernel(dtype)
    limit = few_rows_limit(dtype)
    layer = _prepacked(_one_linear(45, 7, dtype, seed=21), float32_few_rows=dtype == torch.float32)
    probe = _random(1, 45, dtype, seed=22)
    others = _random(limit, 45, dtype, seed=23)
    with torch.no_grad():
        alone = layer(probe)
        _same_bits(alone, kernel(probe, layer.weight.detach(), layer.bias.detach()), f"{dtype}, one row")
        for count in range(1, limit + 1):
            batch = others[:count].clone()
            batch[count - 1] = probe[0]
            _same_bits(layer(batch)[count - 1 :], alone, f"{dtype}, probe last of {count} rows")


# --- another source, and the bench ---------------------------------------------------------------------------

COMMENT = "\n/* test_few_row_limits_blackbox: a copy of the shipped source with this comment appended */\n"


def _commented_copy(folder: Path, name: str) -> Path:
    """A copy of the shipped kernel `name` with a comment appended, beside copies of the kernels' headers."""
    for header in KERNELS.glob("*.h"):
        shutil.copy(header, folder / header.name)
    copy = folder / name
    copy.write_text((KERNELS / name).read_text() + COMMENT)
    return copy


@pytest.mark.parametrize("dtype", _dtype_params())
def test_kernel_from_another_source_gives_the_same_bits(tmp_path: Path, dtype: torch.dtype) -> None:
    """`few_rows(dtype, source)` built from a commented copy gives the shipped kernel's bits up to the limit."""
    shipped = _kernel(dtype)
    name = "few_rows_float32.c" if dtype == torch.float32 else "few_rows.c"
    other = cpu_kernels.few_rows(dtype, _commented_copy(tmp_path, name))
    assert other is not None, f"{name} copied with its headers did not build"
    limit = few_rows_limit(dtype)
    weight = _random(7, 45, dtype, seed=31)
    bias = _random(1, 7, dtype, seed=32)[0].contiguous()
    for count in range(1, limit + 1):
        x = _random(count, 45, dtype, seed=33 + count)
        _same_bits(other(x, weight, bias), shipped(x, weight, bias), f"{dtype}, another build, {count} rows")


def _bench(*extra: str) -> tuple[list[str], dict[str, object]]:
    """Runs `python -m bench.few_rows --quick --dtype float32 --rows 1,3 --rounds 1` (plus `extra`): its lines
    before the last, and the last parsed as JSON (checked to follow one `rows N:` line per row count)."""
    command = [sys.executable, "-m", "bench.few_rows", "--quick", "--dtype", "float32", "--rows", "1,3"]
    result = subprocess.run(
        [*command, "--rounds", "1", *extra], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines, "bench.few_rows printed nothing"
    report = json.loads(lines[-1])
    assert isinstance(report, dict)
    counts = [line.split(":")[0].split()[1] for line in lines[:-1] if line.startswith("rows ")]
    assert counts == ["1", "3"], lines
    return lines[:-1], report


def _check_rows(report: dict[str, object], with_other: bool) -> None:
    """`rows` holds counts 1 and 3, each with positive ms and their ratio (and `other_ms` where another ran)."""
    rows = report["rows"]
    assert isinstance(rows, dict)
    assert set(rows) == {"1", "3"}
    for count, figures in rows.items():
        assert isinstance(figures, dict), count
        expected = {"few_rows_ms", "onednn_ms", "few_rows_over_onednn"} | ({"other_ms"} if with_other else set())
        assert set(figures) == expected, (count, figures)
        for key in expected:
            assert isinstance(figures[key], int | float) and figures[key] > 0, (count, key, figures)
        ratio = figures["few_rows_ms"] / figures["onednn_ms"]
        assert figures["few_rows_over_onednn"] == pytest.approx(ratio, rel=0.05, abs=0.01), (count, figures)


def test_bench_json_with_another_kernel_source(tmp_path: Path) -> None:
    """With `--kernel-source` (a commented copy, alone in its folder: the bench supplies the headers): one line per
    row count, then JSON with `other_ms` per count and `other_equal_bits` true."""
    _kernel(torch.float32)
    source = tmp_path / "copy"
    source.mkdir()
    copy = source / "few_rows_float32.c"
    copy.write_text((KERNELS / "few_rows_float32.c").read_text() + COMMENT)
    lines, report = _bench("--kernel-source", str(copy))
    assert any(str(copy) in line for line in lines), f"no line names the other source: {lines}"
    _check_rows(report, with_other=True)
    assert report["other_equal_bits"] is True


def test_bench_json_without_another_kernel_source() -> None:
    """Without `--kernel-source`: no `other_ms`, no `other_equal_bits`."""
    _kernel(torch.float32)
    lines, report = _bench()
    assert not any("kernel's bits" in line for line in lines), lines
    _check_rows(report, with_other=False)
    assert "other_equal_bits" not in report
