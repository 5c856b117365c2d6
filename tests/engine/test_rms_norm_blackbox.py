"""Black-box tests of the native RMSNorm (`worker.engine.kernels.cpu_kernels.rms_norm`) and its use by the lean layers.

The contract under test: `rms_norm(width)` hands out a native `RmsNorm` only where it reproduces `torch.rms_norm`
bit for bit for rows of that width (else None, with a warning on the module's logger), and a handed-out one gives
exactly torch's bits (NaN where torch gives NaN, and the same sign of zero) for contiguous float32 CPU rows, refuses
everything else with ValueError, never touches its inputs and does not depend on torch's thread count.
"""

from __future__ import annotations

import logging
import math
import platform
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from worker.engine import lean_layers
from worker.engine.kernels import cpu_kernels

LOGGER = "worker.engine.kernels.cpu_kernels"
X86 = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
CAPABILITY = torch.backends.cpu.get_cpu_capability()
NATIVE_EXPECTED = X86 and CAPABILITY in {"AVX2", "AVX512"}
FLT_MAX = torch.finfo(torch.float32).max
NAN = float("nan")
INF = float("inf")

# odd, prime, powers of two, just under/over multiples of 8/16/32/64/128, model widths, large
WIDTHS = [
    *range(1, 18),
    23, 31, 32, 33, 47, 48, 49, 63, 64, 65, 96, 97, 127, 128, 129, 191, 255, 256, 257, 383, 511, 512, 513,
    576, 960, 1000, 1009, 1023, 1024, 1025, 2047, 2048, 2049, 2880, 3072, 4093, 4096, 4097, 5120, 8191, 8192,
    8193, 16383, 16384,
]  # fmt: skip
WIDE_WIDTHS = [w for w in WIDTHS if w >= 8]
ROW_COUNTS = [1, 2, 7, 63, 64, 65]


# ------------------------------------------------------------------------------------------------ helpers


def native(width: int) -> cpu_kernels.RmsNorm:
    """The native RMSNorm for `width`; a failure where x86 AVX2/AVX512 promises one, else a skip."""
    kernel = cpu_kernels.rms_norm(width)
    if kernel is None:
        if NATIVE_EXPECTED and width >= 8:
            pytest.fail(f"no native RMSNorm for width {width} on {CAPABILITY}")
        pytest.skip(f"no native RMSNorm for width {width} here")
    assert isinstance(kernel, cpu_kernels.RmsNorm)
    return kernel


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def assert_bitwise(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit, except that any NaN matches any NaN."""
    assert isinstance(out, torch.Tensor)
    assert out.dtype == torch.float32
    assert out.device.type == "cpu"
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    not_nan = ~expected.isnan()
    # assert_close takes -0.0 == 0.0: the bits must agree too
    assert torch.equal(bits(out)[not_nan], bits(expected)[not_nan]), "signs of zero differ from torch's"


def check(kernel: cpu_kernels.RmsNorm, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's output is torch's, its inputs keep their bits, and it is a tensor of its own."""
    x_before, weight_before = x.clone(), weight.clone()
    expected = reference(x, weight, eps)
    out = kernel(x, weight, eps)
    assert_bitwise(out, expected)
    assert torch.equal(bits(x), bits(x_before)), "rms_norm modified x"
    assert torch.equal(bits(weight), bits(weight_before)), "rms_norm modified weight"
    assert out.is_contiguous()
    if out.numel():
        storage = out.untyped_storage().data_ptr()
        assert storage != x.untyped_storage().data_ptr()
        assert storage != weight.untyped_storage().data_ptr()
    return out


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def normal_rows(rows: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(rows, width, generator=gen(seed), dtype=torch.float64) * scale
    return x.to(torch.float32)


def mixed_rows(rows: int, width: int, seed: int, spread: float = 6.0, scale: float = 1.0) -> torch.Tensor:
    """Rows whose entries span many orders of magnitude, where the order of summation shows in the last bits."""
    g = gen(seed)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    x = x * torch.exp(torch.randn(rows, width, generator=g, dtype=torch.float64) * spread) * scale
    return x.to(torch.float32)


def weight_for(width: int, seed: int) -> torch.Tensor:
    return torch.randn(width, generator=gen(seed + 7919)) * 0.5 + 1.0


def no_native_warning(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    """`rms_norm`'s per-width cache emptied before and after, so later tests get the real kernels back."""
    cpu_kernels.rms_norm.cache_clear()
    try:
        yield
    finally:
        cpu_kernels.rms_norm.cache_clear()


@pytest.fixture
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ availability


@pytest.mark.skipif(not NATIVE_EXPECTED, reason="native path only promised on x86 with AVX2/AVX512")
def test_native_available_for_every_width_from_8_on_avx() -> None:
    missing = [w for w in WIDE_WIDTHS if cpu_kernels.rms_norm(w) is None]
    assert missing == []
    assert all(isinstance(cpu_kernels.rms_norm(w), cpu_kernels.RmsNorm) for w in WIDE_WIDTHS)


def test_cached_per_width() -> None:
    for width in (1, 8, 64, 65, 4096):
        first = cpu_kernels.rms_norm(width)
        assert cpu_kernels.rms_norm(width) is first


@pytest.mark.parametrize("width", [0, -1, -8, -4096])
def test_width_below_one_has_no_native(width: int) -> None:
    assert cpu_kernels.rms_norm(width) is None


def test_whatever_is_handed_out_for_small_widths_is_exact() -> None:
    # widths 1..7 may legitimately be refused; what is handed out must be exact, even for rows the self-check
    # never saw (wide dynamic range, many rows)
    for width in range(1, 8):
        kernel = cpu_kernels.rms_norm(width)
        if kernel is None:
            continue
        for seed, rows in enumerate((1, 63, 64, 65, 300)):
            check(kernel, mixed_rows(rows, width, seed), weight_for(width, seed), 1e-6)
            check(kernel, normal_rows(rows, width, seed + 50), weight_for(width, seed), 1e-5)


# ------------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("width", WIDTHS)
def test_matches_torch_bitwise(width: int) -> None:
    """The native kernel where it is handed out; where it is declined (allowed below width 8 on x86), the torch
    fallback the lean layers then run, held to the same checks."""
    kernel: Any = cpu_kernels.rms_norm(width)
    if kernel is None:
        assert not (NATIVE_EXPECTED and width >= 8), f"no native RMSNorm for width {width}"
        kernel = lean_layers._rms_norm(width, torch.float32)
        assert not isinstance(kernel, cpu_kernels.RmsNorm)
    for rows in ROW_COUNTS:
        seed = width * 1000 + rows
        weight = weight_for(width, seed)
        check(kernel, normal_rows(rows, width, seed), weight, 1e-6)
        check(kernel, mixed_rows(rows, width, seed + 1), weight, 1e-5)
        check(kernel, normal_rows(rows, width, seed + 2, scale=3.0) + 5.0, weight, 1e-6)  # far from zero-mean


@pytest.mark.parametrize(("rows", "width"), [(1000, 8), (1000, 64), (1000, 576), (1000, 2048), (257, 8192),
                                             (100_000, 8), (129, 16384)])  # fmt: skip
def test_many_rows(rows: int, width: int) -> None:
    kernel = native(width)
    check(kernel, mixed_rows(rows, width, rows + width), weight_for(width, 3), 1e-6)


@pytest.mark.parametrize("scale", [1e-20, 1e-19, 1e-12, 1e-6, 1e-3, 1.0, 1e3, 1e6, 1e12, 1e17, 1e18, 1e19, 1e20, 1e30,
                                   3e38])  # fmt: skip
@pytest.mark.parametrize("width", [8, 64, 127, 4096])
def test_scales_including_overflowing_and_underflowing_squares(scale: float, width: int) -> None:
    kernel = native(width)
    for rows in (3, 65):
        check(kernel, normal_rows(rows, width, rows, scale=scale), weight_for(width, 1), 1e-6)
        check(kernel, mixed_rows(rows, width, rows + 1, spread=2.0, scale=scale), weight_for(width, 2), 1e-6)


@pytest.mark.parametrize("factor", [0.5, 0.9, 0.99, 0.999, 1.0, 1.001, 1.01, 1.1, 2.0])
@pytest.mark.parametrize("width", [8, 33, 64, 1000, 4096])
def test_sum_of_squares_around_float_max(factor: float, width: int) -> None:
    # every square fits, but their sum lands right at float32's maximum: the summation order decides inf or not
    kernel = native(width)
    base = math.sqrt(FLT_MAX / width) * factor
    noise = torch.randn(66, width, generator=gen(width), dtype=torch.float64) * 1e-4
    x = (base * (1.0 + noise)).clamp(max=FLT_MAX).to(torch.float32)
    x[1::2] = -x[1::2]
    check(kernel, x, weight_for(width, 5), 1e-6)


@pytest.mark.parametrize("width", [8, 17, 64, 4096])
def test_rows_of_zeros(width: int) -> None:
    kernel = native(width)
    weight = weight_for(width, 0)
    for rows in (1, 64, 65):
        zeros = torch.zeros(rows, width)
        out = check(kernel, zeros, weight, 1e-6)
        assert not out.isnan().any()
        check(kernel, -zeros, weight, 1e-6)  # negative zeros keep their sign
        check(kernel, zeros, weight, 0.0)  # 0 * rsqrt(0): NaN, as torch
        check(kernel, zeros, -weight, 1e-6)
    mixed = normal_rows(70, width, 4)
    mixed[::3] = 0.0
    mixed[1::5] = -0.0
    check(kernel, mixed, weight, 1e-6)
    check(kernel, mixed, weight, 0.0)


@pytest.mark.parametrize("width", [8, 16, 63, 64, 1024])
def test_denormals(width: int) -> None:
    kernel = native(width)
    weight = weight_for(width, 1)
    tiny = torch.finfo(torch.float32).smallest_normal
    for rows in (2, 65):
        check(kernel, normal_rows(rows, width, 1, scale=1e-40), weight, 1e-6)
        check(kernel, normal_rows(rows, width, 2, scale=1e-40), weight, 0.0)
        check(kernel, normal_rows(rows, width, 3, scale=1e-44), weight, 1e-45)
        x = normal_rows(rows, width, 4)
        x[:, ::2] = tiny / 7.0  # denormals between normal values
        check(kernel, x, weight, 1e-6)
        check(kernel, x, weight * 1e-39, 1e-6)  # denormal weights


@pytest.mark.parametrize("width", [8, 9, 64, 65, 1000, 4096])
def test_nan_and_inf_in_x(width: int) -> None:
    kernel = native(width)
    weight = weight_for(width, 2)
    x = normal_rows(130, width, width)
    specials = [
        (0, 0, NAN), (1, width - 1, NAN), (2, width // 2, INF), (3, 0, -INF), (63, width - 1, INF),
        (64, 0, NAN), (65, width // 3, -INF), (129, width - 1, NAN),
    ]  # fmt: skip
    for row, col, value in specials:
        x[row, col] = value
    x[4, 0], x[4, width - 1] = INF, -INF
    x[5] = INF
    x[6] = NAN
    x[7] = FLT_MAX
    out = check(kernel, x, weight, 1e-6)
    assert out[10:60].isfinite().all()  # rows without specials stay finite
    check(kernel, x, weight, 0.0)
    check(kernel, x, torch.zeros(width), 1e-6)  # inf * 0


@pytest.mark.parametrize("width", [8, 15, 64, 65, 4096])
def test_nan_inf_and_zeros_in_weight(width: int) -> None:
    kernel = native(width)
    x = mixed_rows(70, width, width, spread=2.0)
    x[3] = 0.0
    for special in (NAN, INF, -INF, 0.0, -0.0):
        weight = weight_for(width, 3)
        weight[:: max(1, width // 4)] = special
        check(kernel, x, weight, 1e-6)
    check(kernel, x, torch.zeros(width), 1e-6)
    check(kernel, x, -torch.zeros(width), 1e-6)
    check(kernel, x, torch.full((width,), NAN), 1e-6)
    check(kernel, x, torch.full((width,), FLT_MAX), 1e-6)


EPSILONS = [0.0, -0.0, -1e-6, -1.0, -INF, 1e-50, 1e-45, 1e-40, 1e-30, 1e-12, 1e-6, 1e-5, 0.1, 1.0 / 3.0, 1.0, 1e10,
            1e30, 1e38, 1e39, INF, NAN]  # fmt: skip


@pytest.mark.parametrize("eps", EPSILONS)
@pytest.mark.parametrize("width", [8, 64, 129, 4096])
def test_eps_negative_zero_tiny_dominant_and_nonfinite(eps: float, width: int) -> None:
    # eps is rounded to float32 by torch: 1e-50 is 0 there and 1e39 is inf
    kernel = native(width)
    weight = weight_for(width, 4)
    for rows in (2, 65):
        check(kernel, normal_rows(rows, width, rows), weight, eps)
        check(kernel, normal_rows(rows, width, rows, scale=1e-4), weight, eps)  # mean square near a negative eps
        check(kernel, normal_rows(rows, width, rows, scale=1e-20), weight, eps)  # eps dominates
        check(kernel, torch.zeros(rows, width), weight, eps)


@pytest.mark.parametrize("width", [8, 64, 4096])
def test_zero_rows(width: int) -> None:
    kernel = native(width)
    out = check(kernel, torch.empty(0, width), weight_for(width, 0), 1e-6)
    assert out.shape == (0, width)


# ------------------------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("width", [8, 64, 1000, 4096])
def test_repeated_calls_are_deterministic(width: int) -> None:
    kernel = native(width)
    x, weight = mixed_rows(200, width, 11), weight_for(width, 11)
    first = kernel(x, weight, 1e-6)
    for _ in range(4):
        assert torch.equal(bits(kernel(x, weight, 1e-6)), bits(first))
    assert_bitwise(first, reference(x, weight, 1e-6))


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 128, 1000])
@pytest.mark.parametrize("width", [8, 64, 2048])
def test_independent_of_torch_thread_count(rows: int, width: int) -> None:
    kernel = native(width)
    x, weight = mixed_rows(rows, width, rows), weight_for(width, rows)
    expected = reference(x, weight, 1e-6)
    outs = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        out = kernel(x, weight, 1e-6)
        assert_bitwise(out, expected)
        outs.append(out)
    assert torch.equal(bits(outs[0]), bits(outs[1]))


def test_concurrent_calls_from_python_threads() -> None:
    kernel = native(256)
    cases = [(mixed_rows(65 + i, 256, 100 + i), weight_for(256, i)) for i in range(8)]
    expected = [reference(x, w, 1e-6) for x, w in cases]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda case: kernel(case[0], case[1], 1e-6), cases * 3))
    for i, out in enumerate(outs):
        assert_bitwise(out, expected[i % len(cases)])


# ------------------------------------------------------------------------------------------------ inputs and outputs


def test_output_is_a_new_tensor_each_call() -> None:
    kernel = native(64)
    weight = weight_for(64, 0)
    x1, x2 = normal_rows(70, 64, 1), normal_rows(70, 64, 2)
    out1 = kernel(x1, weight, 1e-6)
    kept = out1.clone()
    out2 = kernel(x2, weight, 1e-6)
    assert out1.untyped_storage().data_ptr() != out2.untyped_storage().data_ptr()
    assert torch.equal(bits(out1), bits(kept)), "a later call overwrote an earlier output"
    out1.fill_(123.0)  # writing the output touches neither input nor the other output
    assert_bitwise(out2, reference(x2, weight, 1e-6))
    assert_bitwise(kernel(x1, weight, 1e-6), kept)


def test_contiguous_views_are_accepted() -> None:
    width = 64
    kernel = native(width)
    weight = weight_for(width, 0)
    big = mixed_rows(10, width, 5)
    rows_2_to_5 = big[2:5]
    assert rows_2_to_5.is_contiguous() and rows_2_to_5.storage_offset() == 2 * width
    check(kernel, rows_2_to_5, weight, 1e-6)
    check(kernel, big[9:], weight, 1e-6)

    flat = mixed_rows(1, 70 * width + 3, 6).view(-1)
    for offset in (1, 2, 3):  # start not aligned to any vector width
        x = flat[offset : offset + 70 * width].view(70, width)
        check(kernel, x, weight, 1e-6)
    unaligned_weight = weight_for(width + 1, 1)[1:]
    assert unaligned_weight.is_contiguous()
    check(kernel, big, unaligned_weight, 1e-6)

    one_row = torch.as_strided(flat, (1, width), (12345, 1), 3)  # size-1 dim: contiguous whatever its stride
    assert one_row.is_contiguous()
    check(kernel, one_row, weight, 1e-6)


def test_x_sharing_storage_with_weight() -> None:
    width = 64
    kernel = native(width)
    buffer = normal_rows(66, width, 8).view(-1)
    weight = buffer[:width]
    x = buffer.view(66, width)  # row 0 is the weight itself
    check(kernel, x, weight, 1e-6)


def test_inference_mode_and_parameter_weight() -> None:
    width = 128
    kernel = native(width)
    weight = torch.nn.Parameter(weight_for(width, 9))
    x = mixed_rows(65, width, 9)
    with torch.no_grad():
        expected = reference(x, weight, 1e-6)
        assert_bitwise(kernel(x, weight, 1e-6), expected)
    with torch.inference_mode():
        xi = x.clone()
        assert_bitwise(kernel(xi, weight.detach(), 1e-6), expected)
    assert torch.equal(bits(weight.detach()), bits(weight_for(width, 9)))


# ------------------------------------------------------------------------------------------------ refusals


def refused(kernel: cpu_kernels.RmsNorm, x: torch.Tensor, weight: torch.Tensor) -> None:
    x_before = x.clone() if x.device.type == "cpu" else None
    weight_before = weight.clone() if weight.device.type == "cpu" else None
    with pytest.raises(ValueError):
        kernel(x, weight, 1e-6)
    if x_before is not None:
        assert torch.equal(x, x_before)
    if weight_before is not None:
        assert torch.equal(weight, weight_before)


@pytest.mark.parametrize("width", [8, 64, 4096])
def test_non_contiguous_refused(width: int) -> None:
    kernel = native(width)
    weight = weight_for(width, 0)
    wide = normal_rows(70, 2 * width, 1)
    every_other = wide[:, ::2]
    assert every_other.shape == (70, width) and not every_other.is_contiguous()
    refused(kernel, every_other, weight)
    refused(kernel, wide[:, :width], weight)  # left half: rows stride 2*width
    refused(kernel, wide[:, width:], weight)
    transposed = normal_rows(width, 70, 2).t()
    assert transposed.shape == (70, width) and not transposed.is_contiguous()
    refused(kernel, transposed, weight)
    refused(kernel, normal_rows(70, width, 3), weight_for(2 * width, 0)[::2])
    refused(kernel, normal_rows(70, width, 3), torch.tensor([1.5]).expand(width))
    refused(kernel, normal_rows(140, width, 4)[::2], weight)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.complex64])
def test_other_dtypes_refused(dtype: torch.dtype) -> None:
    width = 64
    kernel = native(width)
    x, weight = normal_rows(4, width, 0), weight_for(width, 0)
    refused(kernel, x.to(dtype), weight)
    refused(kernel, x, weight.to(dtype))
    refused(kernel, x.to(dtype), weight.to(dtype))


def test_non_cpu_refused() -> None:
    width = 64
    kernel = native(width)
    x, weight = normal_rows(4, width, 0), weight_for(width, 0)
    refused(kernel, x.to("meta"), weight)
    refused(kernel, x, weight.to("meta"))
    refused(kernel, x.to("meta"), weight.to("meta"))


def test_wrong_rank_and_width_refused() -> None:
    width = 64
    kernel = native(width)
    weight = weight_for(width, 0)
    refused(kernel, normal_rows(1, width, 0).view(width), weight)  # 1-D
    refused(kernel, normal_rows(6, width, 0).view(2, 3, width), weight)  # 3-D
    refused(kernel, normal_rows(6, width, 0).view(1, 1, 6, width), weight)
    refused(kernel, torch.tensor(1.0), weight)
    refused(kernel, normal_rows(4, width, 0), weight_for(width + 1, 0))
    refused(kernel, normal_rows(4, width, 0), weight_for(width - 1, 0))
    refused(kernel, normal_rows(4, width, 0), weight.view(1, width))  # 2-D weight
    refused(kernel, normal_rows(4, width + 1, 0), weight)


def test_zero_dim_weight_refused_with_value_error() -> None:
    """Found by this suite: a 0-d weight raised IndexError before the shape check."""
    width = 64
    kernel = native(width)
    refused(kernel, normal_rows(4, width, 0), torch.tensor(1.0))


def test_a_kernel_refuses_rows_of_another_width_than_it_was_checked_on() -> None:
    """Found by this suite: the kernel for width 64 took rows of width 7, where torch sums in another order."""
    kernel = native(64)
    for width in (7, 63, 65, 128):
        refused(kernel, normal_rows(4, width, 0), weight_for(width, 0))


# ------------------------------------------------------------------------------------------------ property


SPECIAL_VALUES = [NAN, INF, -INF, 0.0, -0.0, 1e-45, -1e-40, FLT_MAX, -FLT_MAX, 1e20]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    width=st.one_of(st.sampled_from(WIDTHS), st.integers(min_value=1, max_value=3000)),
    rows=st.sampled_from([1, 2, 3, 31, 63, 64, 65, 66, 127, 128, 129]),
    log_scale=st.integers(min_value=-22, max_value=20),
    spread=st.sampled_from([0.0, 0.5, 2.0, 6.0]),
    eps=st.one_of(
        st.sampled_from([1e-6, 1e-5, 0.0, -1e-6, 1e-50, 1e39]),
        st.floats(min_value=-1e-3, max_value=10.0, allow_nan=False),
    ),
    weight_kind=st.sampled_from(["random", "ones", "zeros", "wide", "negative"]),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
    specials=st.lists(st.tuples(st.integers(min_value=0, max_value=10**7), st.sampled_from(SPECIAL_VALUES)),
                      max_size=4),
)  # fmt: skip
def test_property_matches_torch(
    width: int,
    rows: int,
    log_scale: int,
    spread: float,
    eps: float,
    weight_kind: str,
    seed: int,
    specials: list[tuple[int, float]],
) -> None:
    kernel = cpu_kernels.rms_norm(width)
    if kernel is None:
        assert not (NATIVE_EXPECTED and width >= 8), f"no native RMSNorm for width {width}"
        return
    x = mixed_rows(rows, width, seed, spread=spread, scale=10.0**log_scale)
    flat = x.view(-1)
    for index, value in specials:
        flat[index % flat.numel()] = value
    weights = {
        "random": weight_for(width, seed),
        "ones": torch.ones(width),
        "zeros": torch.zeros(width),
        "wide": mixed_rows(1, width, seed + 1, spread=4.0).view(width),
        "negative": -weight_for(width, seed).abs(),
    }
    check(kernel, x, weights[weight_kind], eps)


# ------------------------------------------------------------------------------------------------ fallback


@pytest.mark.usefixtures("fresh_kernels")
def test_missing_compiler_gives_none_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "llmq-no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert cpu_kernels.rms_norm(64) is None
    assert cpu_kernels.rms_norm(4096) is None
    records = no_native_warning(caplog)
    assert records, "no warning says why there is no native RMSNorm"
    text = " ".join(r.getMessage() for r in records)
    assert "llmq-no-such-cc" in text or "No such file" in text or "not found" in text.lower()
    assert not any((tmp_path / "cache").rglob("*.so")), "a library appeared without a compiler"


@pytest.mark.usefixtures("fresh_kernels")
def test_failing_compiler_gives_none_and_warns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for i, compiler in enumerate(("false", "true")):  # fails; "succeeds" without writing a library
        cpu_kernels.rms_norm.cache_clear()
        caplog.clear()
        monkeypatch.setenv("CC", compiler)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache{i}"))
        caplog.set_level(logging.WARNING, logger=LOGGER)
        assert cpu_kernels.rms_norm(64) is None, compiler
        assert no_native_warning(caplog), compiler


@pytest.mark.usefixtures("fresh_kernels")
def test_unusable_cache_dir_gives_none_and_warns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_dir))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert cpu_kernels.rms_norm(64) is None
    assert no_native_warning(caplog)


@pytest.mark.usefixtures("fresh_kernels")
@pytest.mark.skipif(not NATIVE_EXPECTED, reason="native path only promised on x86 with AVX2/AVX512")
def test_builds_into_xdg_cache_and_recovers_after_fallback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "llmq-no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "missing"))
    assert cpu_kernels.rms_norm(64) is None

    monkeypatch.delenv("CC")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu_kernels.rms_norm.cache_clear()
    kernel = cpu_kernels.rms_norm(64)
    assert kernel is not None
    assert list((tmp_path / "cache" / "llmq" / "kernels").iterdir()), "nothing built under $XDG_CACHE_HOME"
    check(kernel, mixed_rows(70, 64, 1), weight_for(64, 1), 1e-6)


@pytest.mark.usefixtures("fresh_kernels")
def test_refused_small_widths_warn_and_handed_out_ones_do_not(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    for width in range(1, 9):
        caplog.clear()
        kernel = cpu_kernels.rms_norm(width)
        records = no_native_warning(caplog)
        if kernel is None:
            assert records, f"width {width}: None without a warning"
            assert any(str(width) in r.getMessage() for r in records)
        else:
            assert not records, f"width {width}: handed out, yet warned"
            check(kernel, mixed_rows(65, width, width), weight_for(width, width), 1e-6)


# ------------------------------------------------------------------------------------------------ lean layers


@pytest.mark.parametrize("width", [8, 64, 576, 4096])
def test_lean_layers_use_native_for_float32(width: int) -> None:
    norm = lean_layers._rms_norm(width, torch.float32)
    kernel = cpu_kernels.rms_norm(width)
    if kernel is not None:
        assert norm is kernel
    elif NATIVE_EXPECTED:
        pytest.fail(f"no native RMSNorm for width {width}")
    x, weight = mixed_rows(65, width, width), weight_for(width, width)
    assert_bitwise(norm(x, weight, 1e-6), reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_lean_layers_other_dtypes_use_the_library_arithmetic(dtype: torch.dtype) -> None:
    """Float32 inside, rounded to the rows' dtype, then times the weight: `LlamaRMSNorm.forward`'s steps."""
    width = 64
    norm = lean_layers._rms_norm(width, dtype)
    assert not isinstance(norm, cpu_kernels.RmsNorm)
    x = mixed_rows(65, width, 1, spread=1.0).to(dtype)
    weight = weight_for(width, 1).to(dtype)
    out = norm(x, weight, 1e-6)
    library = LlamaRMSNorm(width, eps=1e-6).to(dtype)
    library.weight = torch.nn.Parameter(weight)
    expected = library(x)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.usefixtures("fresh_kernels")
def test_lean_layers_float32_fallback_without_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "llmq-no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    width = 64
    norm = lean_layers._rms_norm(width, torch.float32)
    assert not isinstance(norm, cpu_kernels.RmsNorm)
    x, weight = mixed_rows(65, width, 2), weight_for(width, 2)
    x[0, 0] = NAN
    assert_bitwise(norm(x, weight, 1e-6), reference(x, weight, 1e-6))
    x3 = x.view(5, 13, width)  # torch's path takes any leading shape
    assert_bitwise(norm(x3, weight, 1e-5), torch.rms_norm(x3, (width,), weight, 1e-5))
