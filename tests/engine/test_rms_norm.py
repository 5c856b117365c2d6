"""The native RMSNorm: torch's bits for every width and row count it is handed out for, its refusals, and the
fallback to `torch.rms_norm` where it cannot be built or does not reproduce torch."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from worker.engine import lean_layers
from worker.engine.kernels import cpu_kernels

# torch's float sums are 8 floats wide in its x86 builds, which the native sum reproduces (checked on AVX2 and
# AVX-512 machines); elsewhere `rms_norm` may decline, which the fallback tests cover.
X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.fixture
def fresh() -> Iterator[None]:
    """`rms_norm` checks again for every width; the process-wide choices are back after the test."""
    cpu_kernels.rms_norm.cache_clear()
    yield
    cpu_kernels.rms_norm.cache_clear()


def _assert_bits(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not X86, reason="the native sum order is torch's x86 one")
@pytest.mark.parametrize("width", [8, 16, 64, 100, 576, 896, 960, 2048, 3072, 4095, 8192])
def test_native_rms_norm_gives_torch_bits(width: int) -> None:
    norm = cpu_kernels.rms_norm(width)
    assert norm is not None, f"width {width} must take the native path on x86"
    generator = torch.Generator().manual_seed(width + 1)
    weight = torch.randn(width, generator=generator)
    for rows in (1, 2, 15, 16, 33, 64, 200):  # 64 and more share rows among threads
        for scale in (1e-4, 1.0, 1e3):
            x = torch.randn(rows, width, generator=generator) * scale
            for eps in (1e-5, 1e-6):
                _assert_bits(norm(x, weight, eps), torch.rms_norm(x, (width,), weight, eps))


@pytest.mark.skipif(not X86, reason="the native sum order is torch's x86 one")
def test_native_rms_norm_matches_torch_on_odd_rows() -> None:
    """Zeros (only eps keeps it finite), a huge row whose squares overflow, NaN and inf: the same bits or NaNs."""
    width = 576
    norm = cpu_kernels.rms_norm(width)
    assert norm is not None
    x = torch.randn(6, width)
    x[0] = 0.0
    x[1] *= 1e25
    x[2, 17] = float("nan")
    x[3, 100] = float("inf")
    x[4] = 1e-30
    weight = torch.randn(width)
    weight[5] = 0.0
    _assert_bits(norm(x, weight, 1e-5), torch.rms_norm(x, (width,), weight, 1e-5))


@pytest.mark.skipif(not X86, reason="the native sum order is torch's x86 one")
def test_native_rms_norm_refuses_what_it_cannot_read() -> None:
    norm = cpu_kernels.rms_norm(64)
    assert norm is not None
    x, weight = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(ValueError, match="contiguous float32"):
        norm(x.double(), weight, 1e-5)
    with pytest.raises(ValueError, match="contiguous float32"):
        norm(torch.randn(64, 4).t(), weight, 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        norm(torch.randn(4, 32), weight, 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        norm(torch.randn(2, 4, 64), weight, 1e-5)


def test_rms_norm_is_withheld_where_it_does_not_reproduce_torch(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch whose RMSNorm rounds differently (here: one ulp up) gets its own back, with a warning."""
    library_rms_norm = torch.rms_norm

    def another_rounding(x: torch.Tensor, *args: object) -> torch.Tensor:
        out = library_rms_norm(x, *args)  # type: ignore[arg-type]
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(torch, "rms_norm", another_rounding)
    with caplog.at_level(logging.WARNING, logger="worker.engine.kernels.cpu_kernels"):
        assert cpu_kernels.rms_norm(576) is None
    assert "does not reproduce torch's for width 576" in caplog.text
    assert cpu_kernels.rms_norm(0) is None


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_without_a_working_compiler_rms_norm_falls_back_to_torch(
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    compiler: str,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc" if compiler == "missing" else "false")
    with caplog.at_level(logging.WARNING, logger="worker.engine.kernels.cpu_kernels"):
        assert cpu_kernels.rms_norm(64) is None
    assert "native RMSNorm kernel unavailable, using the torch path" in caplog.text
    norm = lean_layers._rms_norm(64, torch.float32)  # what the lean layers then run: torch's own
    x, weight = torch.randn(3, 64), torch.randn(64)
    _assert_bits(norm(x, weight, 1e-5), torch.rms_norm(x, (64,), weight, 1e-5))


def test_lean_layers_keep_the_library_rms_norm_for_other_dtypes() -> None:
    """In bfloat16 the library rounds the normed rows before the weight multiplies them; `torch.rms_norm` does not."""
    norm = lean_layers._rms_norm(64, torch.bfloat16)
    assert not isinstance(norm, cpu_kernels.RmsNorm)
    x, weight = torch.randn(300, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    library = LlamaRMSNorm(64, eps=1e-5)
    library.weight = torch.nn.Parameter(weight)
    _assert_bits(norm(x, weight, 1e-5), library(x))
    assert not torch.equal(norm(x, weight, 1e-5), torch.rms_norm(x, (64,), weight, 1e-5))
