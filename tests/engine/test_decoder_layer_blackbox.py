"""Black-box tests of the native decoder layer's whole-layer decode step (`DecoderLayer.decode_step`).

Written against the public surface only (`cpu_kernels.decoder_layer`, its halves, `DecodeRows` / `DecodeWrites`,
`PagedDecode`) and checked against references computed here: a float64 layer in plain torch ops, and the
composition of the separately exposed kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from testing.tiny_models import save_tiny_model
from worker.engine import lean_layers
from worker.engine.core import Engine, EngineConfig
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import (
    AttentionIn,
    AttentionOut,
    DecoderLayer,
    DecodeRows,
    DecodeWrites,
)
from worker.engine.loader import LoadOptions, load_model
from worker.engine.types import EngineRequest, GenerationParams

BF16_REASON = "this CPU has no AVX-512 BF16: the bfloat16 decoder layer is not offered"
DTYPES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(
        torch.bfloat16,
        id="bfloat16",
        marks=pytest.mark.skipif(not cpu_kernels.native_bfloat16(), reason=BF16_REASON),
    ),
]


@dataclass(frozen=True)
class Shape:
    """A layer's sizes."""

    width: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim


SMOLLM = Shape(width=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536)
ODD = Shape(width=40, heads=6, kv_heads=2, head_dim=8, intermediate=72)  # q_out 48 != width, 3 heads per kv head
SHAPES = [pytest.param(SMOLLM, id="576x9x3"), pytest.param(ODD, id="40x6x2")]


@dataclass
class Layer:
    """Random weights of one layer, in the kernel's dtype (the float64 reference reads the same values)."""

    shape: Shape
    dtype: torch.dtype
    norm_in: torch.Tensor
    eps_in: float
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    qkv_bias: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm_post: torch.Tensor
    eps_post: float
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    mlp_bias: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]

    def halves(self, kernel: DecoderLayer) -> tuple[AttentionIn, AttentionOut]:
        """The layer bound to `kernel`."""
        attention_in = kernel.bind_in((self.norm_in, self.eps_in), self.qkv, self.qkv_bias, self.shape.head_dim)
        attention_out = kernel.bind_out((self.o, self.o_bias), (self.norm_post, self.eps_post), self.mlp, self.mlp_bias)
        return attention_in, attention_out


def make_layer(shape: Shape, dtype: torch.dtype, biases: bool, generator: torch.Generator) -> Layer:
    """Weights scaled so that every activation stays near 1 (a realistic range for both dtypes)."""

    def weight(out: int, inp: int) -> torch.Tensor:
        return (torch.randn(out, inp, generator=generator, dtype=torch.float64) / math.sqrt(inp)).to(dtype)

    def bias(out: int) -> torch.Tensor | None:
        return (0.2 * torch.randn(out, generator=generator, dtype=torch.float64)).to(dtype) if biases else None

    def norm(width: int) -> torch.Tensor:
        return (1 + 0.2 * torch.randn(width, generator=generator, dtype=torch.float64)).to(dtype)

    s = shape
    return Layer(
        shape=s,
        dtype=dtype,
        norm_in=norm(s.width),
        eps_in=1e-5,
        qkv=(weight(s.q_out, s.width), weight(s.kv_out, s.width), weight(s.kv_out, s.width)),
        qkv_bias=(bias(s.q_out), bias(s.kv_out), bias(s.kv_out)),
        o=weight(s.width, s.q_out),
        o_bias=bias(s.width),
        norm_post=norm(s.width),
        eps_post=1e-6,
        mlp=(weight(s.intermediate, s.width), weight(s.intermediate, s.width), weight(s.width, s.intermediate)),
        mlp_bias=(bias(s.intermediate), bias(s.intermediate), bias(s.width)),
    )


@dataclass
class Step:
    """A decode step's inputs: `rows` hidden rows, their rotary tables, a cache and where to write/read."""

    hidden: torch.Tensor
    cos: torch.Tensor
    signed_sin: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    writes: DecodeWrites
    scale: float


def rotary(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`cos` and `signed_sin` (`[rows, head_dim]`, the sine's first half negated) for `positions`, in `dtype`."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    return cos.to(dtype).contiguous(), signed_sin.to(dtype).contiguous()


def make_step(
    shape: Shape,
    dtype: torch.dtype,
    rows: int,
    generator: torch.Generator,
    *,
    cache_rows: int = 200,
    max_length: int = 40,
    shuffle: bool = True,
    cross_reads: bool = False,
) -> Step:
    """A step of `rows` decode rows: each row writes a distinct cache row and attends a random set of cache rows
    that includes its own new one (and, with `cross_reads`, other rows' new ones too)."""
    hidden = torch.randn(rows, shape.width, generator=generator, dtype=torch.float64).to(dtype)
    positions = torch.randint(0, 4000, (rows,), generator=generator)
    cos, signed_sin = rotary(positions, shape.head_dim, dtype)
    keys = torch.randn(cache_rows, shape.kv_heads, shape.head_dim, generator=generator, dtype=torch.float64)
    values = torch.randn(cache_rows, shape.kv_heads, shape.head_dim, generator=generator, dtype=torch.float64)
    order = torch.randperm(cache_rows, generator=generator)
    write_index = order[:rows].clone()
    pool = order[rows:]
    query_rows = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
    spans: list[torch.Tensor] = []
    for i in range(rows):
        own = int(write_index[int(query_rows[i])])
        length = int(torch.randint(1, max_length + 1, (1,), generator=generator))
        others = pool[torch.randperm(pool.numel(), generator=generator)[: length - 1]]
        extra = write_index[torch.arange(rows) != int(query_rows[i])] if cross_reads else others[:0]
        span = torch.cat([others, extra, torch.tensor([own])])
        spans.append(span[torch.randperm(span.numel(), generator=generator)])
    lengths = torch.tensor([span.numel() for span in spans], dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    decode = DecodeRows(query_rows.to(torch.int64), starts, lengths, torch.cat(spans).to(torch.int64))
    return Step(
        hidden=hidden.contiguous(),
        cos=cos,
        signed_sin=signed_sin,
        keys=keys.to(dtype).contiguous(),
        values=values.to(dtype).contiguous(),
        writes=DecodeWrites(decode, write_index.to(torch.int64)),
        scale=shape.head_dim**-0.5,
    )


def kernel_for(shape: Shape, dtype: torch.dtype) -> DecoderLayer:
    """The native layer, or a skip where it does not build here."""
    kernel = cpu_kernels.decoder_layer(shape.width, dtype)
    if kernel is None:
        pytest.skip(f"the native decoder layer does not build here for width {shape.width} in {dtype}")
    return kernel


def run_step(kernel: DecoderLayer, layer: Layer, step: Step) -> torch.Tensor:
    """`decode_step` on `step` (its cache mutated in place)."""
    return kernel.decode_step(
        layer.halves(kernel), step.hidden, step.cos, step.signed_sin, (step.keys, step.values), step.writes, step.scale
    )


# ----------------------------------------------------------------------------------------------- float64 reference


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x @ weight.double().T
    return out if bias is None else out + bias.double()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Standard rotate-half rotary on `[rows, heads, head_dim]` with the unsigned sine."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def reference(layer: Layer, step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole layer in float64 from the step's (pre-call) inputs: `(out, k_new, v_new, attended)`; `k_new` and
    `v_new` are `[rows, kv_heads, head_dim]`."""
    s = layer.shape
    rows = step.hidden.shape[0]
    hidden = step.hidden.double()
    cos = step.cos.double()
    half = s.head_dim // 2
    sin = torch.cat([-step.signed_sin[:, :half].double(), step.signed_sin[:, half:].double()], dim=-1)
    n = _rms(hidden, layer.norm_in.double(), layer.eps_in)
    q = _linear(n, layer.qkv[0], layer.qkv_bias[0]).view(rows, s.heads, s.head_dim)
    k = _linear(n, layer.qkv[1], layer.qkv_bias[1]).view(rows, s.kv_heads, s.head_dim)
    v = _linear(n, layer.qkv[2], layer.qkv_bias[2]).view(rows, s.kv_heads, s.head_dim)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    keys, values = step.keys.double().clone(), step.values.double().clone()
    keys[step.writes.write_index] = k
    values[step.writes.write_index] = v
    decode = step.writes.rows
    attended = torch.zeros(rows, s.heads, s.head_dim, dtype=torch.float64)
    group = s.heads // s.kv_heads
    for i in range(rows):
        row = int(decode.query_rows[i])
        start, length = int(decode.starts[i]), int(decode.lengths[i])
        cache_rows = decode.index[start : start + length]
        key = keys[cache_rows].repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, length, head_dim]
        value = values[cache_rows].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.einsum("hd,hld->hl", q[row], key) * step.scale
        attended[row] = torch.einsum("hl,hld->hd", scores.softmax(-1), value)
    flat = attended.reshape(rows, s.q_out)
    h = hidden + _linear(flat, layer.o, layer.o_bias)
    n2 = _rms(h, layer.norm_post.double(), layer.eps_post)
    gate = _linear(n2, layer.mlp[0], layer.mlp_bias[0])
    up = _linear(n2, layer.mlp[1], layer.mlp_bias[1])
    out = h + _linear(functional.silu(gate) * up, layer.mlp[2], layer.mlp_bias[2])
    return out, k, v, flat


def assert_close_to(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    """Every element within `tolerance` of `want`, relative to `want`'s largest magnitude."""
    error = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} > {tolerance} * {scale:.3g}"


def relative_norm_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


# --------------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("biases", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6])
def test_decode_step_matches_float64_layer(shape: Shape, dtype: torch.dtype, biases: bool, rows: int) -> None:
    """The whole layer agrees with a float64 reference at 1..6 rows, GQA, shuffled query rows, random lengths."""
    kernel = kernel_for(shape, dtype)
    generator = torch.Generator().manual_seed(1000 * rows + 10 * shape.width + biases + (dtype == torch.bfloat16))
    layer = make_layer(shape, dtype, biases, generator)
    step = make_step(shape, dtype, rows, generator)
    want, k_new, v_new, _ = reference(layer, step)
    out = run_step(kernel, layer, step)
    assert out.shape == (rows, shape.width) and out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    written = step.writes.write_index
    if dtype == torch.float32:
        assert_close_to(out, want, 2e-5, "layer output")
        assert_close_to(out - step.hidden, want - step.hidden.double(), 5e-5, "layer update (output - residual)")
        assert_close_to(step.keys[written], k_new, 2e-5, "written keys")
        assert_close_to(step.values[written], v_new, 2e-5, "written values")
    else:
        # bfloat16 rounds every elementwise result (8 bits of mantissa: 2^-9 relative per rounding)
        assert_close_to(out, want, 0.03, "layer output")
        assert relative_norm_error(out, want) < 0.01
        assert relative_norm_error(out - step.hidden.double(), want - step.hidden.double()) < 0.03
        assert relative_norm_error(step.keys[written], k_new) < 0.02
        assert relative_norm_error(step.values[written], v_new) < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_attention_sees_other_rows_new_keys(dtype: torch.dtype) -> None:
    """Every row's key and value are written before any row attends: a span that reads another row's write row
    sees that row's new key and value."""
    shape = ODD
    kernel = kernel_for(shape, dtype)
    generator = torch.Generator().manual_seed(77)
    layer = make_layer(shape, dtype, True, generator)
    step = make_step(shape, dtype, 6, generator, cross_reads=True, max_length=8)
    want, _, _, _ = reference(layer, step)
    out = run_step(kernel, layer, step)
    assert_close_to(out, want, 2e-5 if dtype == torch.float32 else 0.03, "layer output")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_step_writes_only_the_write_rows(shape: Shape, dtype: torch.dtype) -> None:
    """The new keys and values land exactly at `write_index` (bitwise those of the first half) and every other
    cache row keeps its bits."""
    kernel = kernel_for(shape, dtype)
    generator = torch.Generator().manual_seed(5)
    layer = make_layer(shape, dtype, True, generator)
    step = make_step(shape, dtype, 5, generator)
    keys_before, values_before = step.keys.clone(), step.values.clone()
    attention_in, _ = layer.halves(kernel)
    qkv = attention_in(step.hidden, step.cos, step.signed_sin)
    run_step(kernel, layer, step)
    written = step.writes.write_index
    untouched = torch.ones(step.keys.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(step.keys[untouched], keys_before[untouched])
    assert torch.equal(step.values[untouched], values_before[untouched])
    k_new = qkv[:, shape.q_out : shape.q_out + shape.kv_out].reshape(-1, shape.kv_heads, shape.head_dim)
    v_new = qkv[:, shape.q_out + shape.kv_out :].reshape(-1, shape.kv_heads, shape.head_dim)
    assert torch.equal(step.keys[written], k_new)
    assert torch.equal(step.values[written], v_new)


def composed(kernel: DecoderLayer, layer: Layer, step: Step) -> torch.Tensor:
    """AttentionIn, the cache write, PagedDecode (float32 queries and output) and AttentionOut, one call each."""
    s = layer.shape
    paged = cpu_kernels.load(layer.dtype)
    assert paged is not None
    attention_in, attention_out = layer.halves(kernel)
    qkv = attention_in(step.hidden, step.cos, step.signed_sin)
    rows = qkv.shape[0]
    step.keys[step.writes.write_index] = qkv[:, s.q_out : s.q_out + s.kv_out].reshape(rows, s.kv_heads, s.head_dim)
    step.values[step.writes.write_index] = qkv[:, s.q_out + s.kv_out :].reshape(rows, s.kv_heads, s.head_dim)
    query = qkv[:, : s.q_out].float().reshape(rows, s.heads, s.head_dim).contiguous()
    attended = torch.zeros_like(query)
    paged(query, step.keys, step.values, step.writes.rows, step.scale, attended)
    return attention_out(attended.reshape(rows, s.q_out).to(layer.dtype).contiguous(), step.hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_decode_step_equals_composition_bitwise(shape: Shape, dtype: torch.dtype, rows: int) -> None:
    """decode_step has the bits of its halves around the cache write and PagedDecode, called in turn."""
    kernel = kernel_for(shape, dtype)
    generator = torch.Generator().manual_seed(rows + 31)
    layer = make_layer(shape, dtype, rows % 2 == 1, generator)
    step = make_step(shape, dtype, rows, generator)
    twin = Step(step.hidden, step.cos, step.signed_sin, step.keys.clone(), step.values.clone(), step.writes, step.scale)
    out = run_step(kernel, layer, step)
    want = composed(kernel, layer, twin)
    assert torch.equal(step.keys, twin.keys) and torch.equal(step.values, twin.values)
    assert torch.equal(out, want), f"max difference {(out.double() - want.double()).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_other_scale(dtype: torch.dtype) -> None:
    """The attention uses the scale it is given (not 1/sqrt(head_dim))."""
    shape = ODD
    kernel = kernel_for(shape, dtype)
    generator = torch.Generator().manual_seed(9)
    layer = make_layer(shape, dtype, False, generator)
    step = make_step(shape, dtype, 4, generator)
    step.scale = 1.7
    want, _, _, _ = reference(layer, step)
    out = run_step(kernel, layer, step)
    assert_close_to(out, want, 2e-5 if dtype == torch.float32 else 0.03, "layer output")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_step_rows_are_independent(shape: Shape, dtype: torch.dtype) -> None:
    """A row's output (and its cache write) is the same whichever rows share its step, and wherever it sits."""
    kernel = kernel_for(shape, dtype)
    generator = torch.Generator().manual_seed(123)
    layer = make_layer(shape, dtype, True, generator)
    full = make_step(shape, dtype, 6, generator)
    decode = full.writes.rows
    keys0, values0 = full.keys.clone(), full.values.clone()
    out_full = run_step(kernel, layer, full)
    for subset in ([0], [3], [5, 1], [2, 4, 0], [1, 2, 3, 4, 5]):
        # the subset's rows in a new order, each keeping its span and its write row
        order = torch.tensor(subset)[torch.randperm(len(subset), generator=generator)]
        spans, lengths = [], []
        for old_row in order.tolist():
            i = int((decode.query_rows == old_row).nonzero())
            start, length = int(decode.starts[i]), int(decode.lengths[i])
            spans.append(decode.index[start : start + length])
            lengths.append(length)
        length_tensor = torch.tensor(lengths, dtype=torch.int64)
        rows = DecodeRows(
            torch.arange(len(subset)), torch.cumsum(length_tensor, 0) - length_tensor, length_tensor, torch.cat(spans)
        )
        step = Step(
            full.hidden[order].contiguous(),
            full.cos[order].contiguous(),
            full.signed_sin[order].contiguous(),
            keys0.clone(),
            values0.clone(),
            DecodeWrites(rows, full.writes.write_index[order].contiguous()),
            full.scale,
        )
        out = run_step(kernel, layer, step)
        diff = (out.double() - out_full[order].double()).abs().max().item()
        assert torch.equal(out, out_full[order]), f"rows {order.tolist()}: differ by {diff:.3g} from the full step"
        written = step.writes.write_index
        assert torch.equal(step.keys[written], full.keys[written])
        assert torch.equal(step.values[written], full.values[written])


# ------------------------------------------------------------------------------------------------------- refusals


def _writes(rows: int, write_index: list[int], index: list[int] | None = None) -> DecodeWrites:
    """One-entry spans: row i reads `index[i]` (its own write row by default)."""
    index = write_index if index is None else index
    decode = DecodeRows(
        torch.arange(rows), torch.arange(rows), torch.ones(rows, dtype=torch.int64), torch.tensor(index)
    )
    return DecodeWrites(decode, torch.tensor(write_index))


def _refusals(shape: Shape, dtype: torch.dtype, step: Step) -> dict[str, Callable[[], dict[str, Any]]]:
    """Named ways to break one argument of a valid step; each gives the keyword arguments to change."""
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    n, rows = step.keys.shape[0], step.hidden.shape[0]
    wide = (n, shape.kv_heads, shape.head_dim + 2)
    return {
        "keys one head too many": lambda: {"keys": torch.zeros(n, shape.kv_heads + 1, shape.head_dim, dtype=dtype)},
        "keys and values of other widths": lambda: {
            "keys": torch.zeros(wide, dtype=dtype),
            "values": torch.zeros(wide, dtype=dtype),
        },
        "values wider than keys": lambda: {"values": torch.zeros(wide, dtype=dtype)},
        "2-D cache": lambda: {
            "keys": torch.zeros(n, shape.kv_out, dtype=dtype),
            "values": torch.zeros(n, shape.kv_out, dtype=dtype),
        },
        "cache of another dtype": lambda: {"keys": step.keys.to(other), "values": step.values.to(other)},
        "keys of another dtype": lambda: {"keys": step.keys.to(other)},
        "non-contiguous values": lambda: {
            "values": torch.zeros(shape.kv_heads, n, shape.head_dim, dtype=dtype).transpose(0, 1)
        },
        "hidden of another dtype": lambda: {"hidden": step.hidden.to(other)},
        "hidden of another width": lambda: {"hidden": torch.zeros(rows, shape.width + 1, dtype=dtype)},
        "rotary of another dtype": lambda: {"cos": step.cos.to(other)},
        "rotary for fewer rows": lambda: {"cos": step.cos[:-1].contiguous(), "signed_sin": step.signed_sin[:-1]},
        "write row past the cache": lambda: {"writes": _writes(rows, [*range(rows - 1), n])},
        "read row past the cache": lambda: {"writes": _writes(rows, list(range(rows)), [*range(rows - 1), n + 5])},
        "write row past the shorter values": lambda: {
            "values": step.values[: n // 2].clone(),
            "writes": _writes(rows, [*range(rows - 1), n - 1]),
        },
        "writes for more rows than hidden": lambda: {"writes": _writes(rows + 1, list(range(rows + 1)))},
        "writes for fewer rows than hidden": lambda: {"writes": _writes(rows - 1, list(range(rows - 1)))},
    }


REFUSAL_NAMES = list(_refusals(ODD, torch.float32, make_step(ODD, torch.float32, 3, torch.Generator())).keys())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("refusal", REFUSAL_NAMES)
def test_decode_step_refuses_and_writes_nothing(dtype: torch.dtype, refusal: str) -> None:
    """Each bad argument is refused with ValueError before any cache row is touched."""
    shape = ODD
    kernel = kernel_for(shape, dtype)
    generator = torch.Generator().manual_seed(3)
    layer = make_layer(shape, dtype, True, generator)
    step = make_step(shape, dtype, 3, generator, cache_rows=64)
    arguments: dict[str, Any] = {
        "hidden": step.hidden,
        "cos": step.cos,
        "signed_sin": step.signed_sin,
        "keys": step.keys,
        "values": step.values,
        "writes": step.writes,
    }
    arguments.update(_refusals(shape, dtype, step)[refusal]())
    keys, values = arguments["keys"], arguments["values"]
    keys_before, values_before = keys.clone(), values.clone()
    with pytest.raises(ValueError):
        kernel.decode_step(
            layer.halves(kernel),
            arguments["hidden"],
            arguments["cos"],
            arguments["signed_sin"],
            (keys, values),
            arguments["writes"],
            step.scale,
        )
    assert torch.equal(keys, keys_before) and torch.equal(values, values_before)


def test_decode_step_refuses_halves_of_another_width() -> None:
    """Halves bound on a wider layer are not this layer's: refused rather than read with this layer's width.
    (Bound wider, so that a read past this check would still lie within their tensors.)"""
    narrow, wide = ODD, Shape(width=64, heads=6, kv_heads=2, head_dim=8, intermediate=72)
    kernel, wide_kernel = kernel_for(narrow, torch.float32), kernel_for(wide, torch.float32)
    generator = torch.Generator().manual_seed(4)
    halves = make_layer(wide, torch.float32, True, generator).halves(wide_kernel)
    step = make_step(narrow, torch.float32, 2, generator, cache_rows=32)
    keys_before = step.keys.clone()
    with pytest.raises(ValueError):
        kernel.decode_step(
            halves, step.hidden, step.cos, step.signed_sin, (step.keys, step.values), step.writes, step.scale
        )
    assert torch.equal(step.keys, keys_before)


@pytest.mark.skipif(not cpu_kernels.native_bfloat16(), reason=BF16_REASON)
def test_decode_step_refuses_halves_of_another_dtype() -> None:
    """float32 halves handed to the bfloat16 layer are refused rather than their bytes read as bfloat16. (This
    direction only: it reads no further than the float32 tensors reach.)"""
    shape = ODD
    kernel, float_kernel = kernel_for(shape, torch.bfloat16), kernel_for(shape, torch.float32)
    generator = torch.Generator().manual_seed(6)
    halves = make_layer(shape, torch.float32, True, generator).halves(float_kernel)
    step = make_step(shape, torch.bfloat16, 2, generator, cache_rows=32)
    cos, signed_sin = step.cos.float(), step.signed_sin.float()  # as the float32 halves check them
    keys_before = step.keys.clone()
    with pytest.raises(ValueError):
        kernel.decode_step(halves, step.hidden, cos, signed_sin, (step.keys, step.values), step.writes, step.scale)
    assert torch.equal(step.keys, keys_before)


@pytest.mark.parametrize(
    ("case", "build"),
    [
        ("duplicate query rows", lambda: _writes_raw([0, 0, 2], [1, 2, 3])),
        ("query rows not 0..n-1", lambda: _writes_raw([0, 1, 3], [1, 2, 3])),
        ("fewer write rows than rows", lambda: _writes_raw([0, 1, 2], [1, 2])),
        ("more write rows than rows", lambda: _writes_raw([0, 1, 2], [1, 2, 3, 4])),
        ("negative write row", lambda: _writes_raw([2, 0, 1], [1, -2, 3])),
        ("write rows of int32", lambda: DecodeWrites(_rows([0, 1]), torch.tensor([1, 2], dtype=torch.int32))),
        ("2-D write rows", lambda: DecodeWrites(_rows([0, 1]), torch.tensor([[1, 2]]))),
        ("no rows", lambda: DecodeWrites(_rows([]), torch.tensor([], dtype=torch.int64))),
        ("negative query row", lambda: _rows([0, -1])),
        (
            "negative cache row",
            lambda: DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), torch.tensor([-3])),
        ),
        (
            "span past the index",
            lambda: DecodeRows(torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), torch.tensor([4, 5])),
        ),
        ("empty span", lambda: DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([4]))),
        (
            "negative start",
            lambda: DecodeRows(torch.tensor([0]), torch.tensor([-1]), torch.tensor([1]), torch.tensor([4])),
        ),
        (
            "lengths count mismatch",
            lambda: DecodeRows(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([4, 5])),
        ),
        (
            "float index",
            lambda: DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), torch.tensor([4.0])),
        ),
    ],
)
def test_decode_rows_and_writes_validate(case: str, build: Callable[[], object]) -> None:
    """Bad DecodeRows / DecodeWrites are refused at construction."""
    with pytest.raises(ValueError):
        build()


def _rows(query_rows: list[int]) -> DecodeRows:
    """Row i reads cache row 10 + i."""
    count = len(query_rows)
    return DecodeRows(
        torch.tensor(query_rows, dtype=torch.int64),
        torch.arange(count),
        torch.ones(count, dtype=torch.int64),
        torch.arange(10, 10 + count),
    )


def _writes_raw(query_rows: list[int], write_index: list[int]) -> DecodeWrites:
    return DecodeWrites(_rows(query_rows), torch.tensor(write_index, dtype=torch.int64))


def test_valid_decode_writes_accepted() -> None:
    """A shuffled permutation with distinct non-negative write rows is accepted as given."""
    writes = _writes_raw([2, 0, 1], [7, 0, 5])
    assert writes.write_index.tolist() == [7, 0, 5]
    assert writes.rows.query_rows.tolist() == [2, 0, 1]


# ----------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp(f"blackbox-{request.param}"), request.param)


async def _greedy(folder: Path, options: LoadOptions, prompt: list[int], new_tokens: int) -> tuple[list[int], Engine]:
    """A lone greedy request's tokens on a fresh engine (closed before returning)."""
    model, tokenizer = load_model(str(folder), options)
    engine = await Engine(
        model, tokenizer, EngineConfig(kv_cache_tokens=4096, page_size=16, max_batch_tokens=128)
    ).start()
    try:
        params = GenerationParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        async for delta in engine.submit(EngineRequest("lone", input_ids=prompt, params=params)):
            tokens.extend(delta.token_ids)
    finally:
        await engine.close()
    return tokens, engine


@pytest.mark.parametrize("mode", ["bfloat16", "float32-few-rows"])
async def test_engine_decode_step_matches_torch_layer(
    tiny_model: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone greedy request runs its decode steps through decode_step, and its tokens equal those of the engine
    without the native layer."""
    if mode == "bfloat16" and not cpu_kernels.native_bfloat16():
        pytest.skip(BF16_REASON)
    options = LoadOptions(
        cache_dir=tiny_model / "cache",
        **({"dtype": "bfloat16"} if mode == "bfloat16" else {"float32_few_rows": True}),
    )
    calls: list[int] = []
    original = DecoderLayer.decode_step

    def counting(self: DecoderLayer, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[1].shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "decode_step", counting)
    prompt, new_tokens = [5, 17, 42, 8, 99, 23, 61], 12
    native, engine = await _greedy(tiny_model, options, prompt, new_tokens)
    assert engine.counters.paths.get("decoder_layer") == "compiled", engine.counters.paths
    layers = 2
    assert len(native) == new_tokens
    # every step after the prefill is one decode row; the last token needs no step of its own
    assert len(calls) >= layers * (new_tokens - 2), calls
    assert set(calls) == {1}

    calls.clear()
    monkeypatch.setattr(lean_layers, "_native_layer", lambda layer, width: None)
    fallback, _ = await _greedy(tiny_model, options, prompt, new_tokens)
    assert calls == []
    assert native == fallback
