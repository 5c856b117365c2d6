"""Black-box checks of the native float32 decoder-layer halves (`cpu_kernels.decoder_layer`) against float64 math
written from the documented behaviour: results at 1..6 rows, GQA and odd widths, biases, zero rows, large inputs,
NaN confinement, row independence, untouched inputs, refusals, and a few-rows engine reporting the compiled path."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from tests.engine.test_engine import collect, greedy, tokens_of
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import DecoderLayer
from worker.engine.loader import LoadOptions, load_model
from worker.engine.types import EngineRequest

EPS = 1e-5
# (width, heads, kv_heads, head_dim, intermediate)
SMALL = (64, 4, 2, 16, 40)
SMOL = (576, 9, 3, 64, 1536)

Biases = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _layer(width: int) -> DecoderLayer:
    layer = cpu_kernels.decoder_layer(width)
    assert layer is not None, f"decoder_layer({width}) builds on an x86 AVX2 CPU"
    return layer


def _rotary(rows: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    half = head_dim // 2
    angles = (torch.arange(rows).unsqueeze(1) + 3) * torch.rand(half, generator=gen).repeat(2)
    sin = angles.sin()
    return angles.cos(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def _in_params(shape: tuple[int, ...], biased: bool, gen: torch.Generator) -> tuple[Any, ...]:
    width, heads, kv_heads, head_dim, _ = shape
    outs = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    weights = tuple(torch.randn(out, width, generator=gen) * 0.1 for out in outs)
    biases: Biases = tuple(torch.randn(out, generator=gen) if biased else None for out in outs)  # type: ignore[assignment]
    norm_weight = torch.randn(width, generator=gen)
    return weights, biases, norm_weight


def _ref_in(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    biases: Biases,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    head_dim: int,
) -> torch.Tensor:
    """The documented attention_in, in float64."""
    h = hidden.double()
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    parts = []
    for w, b in zip(weights, biases, strict=True):
        y = n @ w.double().T
        parts.append(y if b is None else y + b.double())
    rows = hidden.shape[0]
    c, s = cos.double().unsqueeze(1), signed_sin.double().unsqueeze(1)
    rotated = []
    for part in parts[:2]:
        x = part.view(rows, -1, head_dim)
        rotated.append((x * c + torch.roll(x, head_dim // 2, -1) * s).reshape(rows, -1))
    return torch.cat([*rotated, parts[2]], dim=1)


def _out_params(shape: tuple[int, ...], biased: bool, gen: torch.Generator) -> tuple[Any, ...]:
    width, heads, _, head_dim, inter = shape
    o_w = torch.randn(width, heads * head_dim, generator=gen) * 0.05
    o_b = torch.randn(width, generator=gen) if biased else None
    norm_weight = torch.randn(width, generator=gen)
    mlp = (
        torch.randn(inter, width, generator=gen) * 0.1,
        torch.randn(inter, width, generator=gen) * 0.1,
        torch.randn(width, inter, generator=gen) * 0.1,
    )
    mlp_b = (None, None, None)
    return (o_w, o_b), norm_weight, mlp, mlp_b


def _ref_out(
    attended: torch.Tensor,
    residual: torch.Tensor,
    o_w: torch.Tensor,
    o_b: torch.Tensor | None,
    norm_weight: torch.Tensor,
    mlp: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """The documented attention_out, in float64."""
    h = residual.double() + attended.double() @ o_w.double().T
    if o_b is not None:
        h = h + o_b.double()
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    gate, up, down = (m.double() for m in mlp)
    return h + (functional.silu(n @ gate.T) * (n @ up.T)) @ down.T


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == expected.shape
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4 * max(scale, 1.0))


@pytest.mark.parametrize("shape", [SMALL, SMOL], ids=["w64-gqa", "w576"])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
def test_attention_in_matches_float64_at_each_row_count(shape: tuple[int, ...], biased: bool) -> None:
    """q|k|v after RMSNorm, projections (with or without biases) and per-head rotary on q and k only."""
    layer = _layer(shape[0])
    gen = torch.Generator().manual_seed(11 + biased)
    weights, biases, norm_weight = _in_params(shape, biased, gen)
    for rows in range(1, 7):
        hidden = torch.randn(rows, shape[0], generator=gen) * 2
        cos, signed_sin = _rotary(rows, shape[3], gen)
        got = layer.attention_in(hidden, (norm_weight, EPS), weights, biases, cos, signed_sin)
        _close(got, _ref_in(hidden, norm_weight, weights, biases, cos, signed_sin, shape[3]))


@pytest.mark.parametrize("shape", [SMALL, SMOL], ids=["w64-gqa", "w576"])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "o-bias"])
def test_attention_out_matches_float64_at_each_row_count(shape: tuple[int, ...], biased: bool) -> None:
    """residual + o-projection, RMSNorm, SiLU-gated MLP and its residual."""
    layer = _layer(shape[0])
    gen = torch.Generator().manual_seed(23 + biased)
    (o_w, o_b), norm_weight, mlp, mlp_b = _out_params(shape, biased, gen)
    for rows in range(1, 7):
        attended = torch.randn(rows, o_w.shape[1], generator=gen)
        residual = torch.randn(rows, shape[0], generator=gen) * 3
        got = layer.attention_out(attended, residual, (o_w, o_b), (norm_weight, EPS), mlp, mlp_b)
        _close(got, _ref_out(attended, residual, o_w, o_b, norm_weight, mlp))


def test_zero_and_large_rows_stay_finite_and_correct() -> None:
    """A zero hidden row normalises to zero (eps keeps it finite: q/k/v are then just the biases, rotated); rows of
    magnitude 1e6 stay finite and match float64."""
    width, _, _, head_dim, _ = SMALL
    layer = _layer(width)
    gen = torch.Generator().manual_seed(5)
    weights, biases, norm_weight = _in_params(SMALL, True, gen)
    hidden = torch.randn(3, width, generator=gen)
    hidden[0] = 0
    hidden[2] *= 1e6
    cos, signed_sin = _rotary(3, head_dim, gen)
    got = layer.attention_in(hidden, (norm_weight, EPS), weights, biases, cos, signed_sin)
    assert torch.isfinite(got).all()
    _close(got, _ref_in(hidden, norm_weight, weights, biases, cos, signed_sin, head_dim))

    (o_w, o_b), out_norm, mlp, mlp_b = _out_params(SMALL, False, gen)
    attended = torch.zeros(3, o_w.shape[1])
    residual = torch.randn(3, width, generator=gen)
    residual[0] = 0
    residual[2] *= 1e6
    out = layer.attention_out(attended, residual, (o_w, o_b), (out_norm, EPS), mlp, mlp_b)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros(width)), "zero in, zero out without biases"
    _close(out, _ref_out(attended, residual, o_w, o_b, out_norm, mlp))


def _case(seed: int, biased: bool, count: int) -> tuple[Any, Any, Any, tuple[torch.Tensor, ...]]:
    """The SMALL layer's kernel, its parameters before and after attention, and `count` rows of hidden states,
    attended outputs, cos and signed sin."""
    width, _, _, head_dim, _ = SMALL
    gen = torch.Generator().manual_seed(seed)
    before = _in_params(SMALL, biased, gen)
    after = _out_params(SMALL, biased, gen)
    hidden = torch.randn(count, width, generator=gen)
    attended = torch.randn(count, after[0][0].shape[1], generator=gen)
    return _layer(width), before, after, (hidden, attended, *_rotary(count, head_dim, gen))


def test_rows_are_independent_bitwise_and_nan_stays_in_its_row() -> None:
    """Each row computed alone equals it computed among 5 others, bit for bit; a NaN in one row's input leaves the
    other rows' outputs unchanged and finite."""
    layer, (weights, biases, norm_weight), ((o_w, o_b), out_norm, mlp, mlp_b), rows = _case(7, True, 6)
    hidden, attended, cos, signed_sin = rows

    def run_in(h: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return layer.attention_in(h, (norm_weight, EPS), weights, biases, c, s)

    def run_out(a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return layer.attention_out(a, r, (o_w, o_b), (out_norm, EPS), mlp, mlp_b)

    together_in, together_out = run_in(hidden, cos, signed_sin), run_out(attended, hidden)
    for row in range(6):
        pick = slice(row, row + 1)
        alone_in = run_in(hidden[pick].clone(), cos[pick].clone(), signed_sin[pick].clone())
        assert torch.equal(alone_in[0], together_in[row]), row
        assert torch.equal(run_out(attended[pick].clone(), hidden[pick].clone())[0], together_out[row]), row

    poisoned = hidden.clone()
    poisoned[2, 5] = float("nan")
    nan_in, nan_out = run_in(poisoned, cos, signed_sin), run_out(attended, poisoned)
    assert torch.isnan(nan_in[2]).any() and torch.isnan(nan_out[2]).any()
    keep = [0, 1, 3, 4, 5]
    assert torch.equal(nan_in[keep], together_in[keep])
    assert torch.equal(nan_out[keep], together_out[keep])


def test_inputs_are_not_modified() -> None:
    layer, (weights, biases, norm_weight), ((o_w, o_b), out_norm, mlp, _), rows = _case(9, True, 4)
    hidden, attended, cos, signed_sin = rows
    gen = torch.Generator().manual_seed(10)
    mlp_b = tuple(torch.randn(m.shape[0], generator=gen) for m in mlp)
    tensors = [hidden, attended, cos, signed_sin, norm_weight, out_norm, o_w, o_b, *weights, *biases, *mlp, *mlp_b]
    before = [t.clone() for t in tensors]
    qkv = layer.attention_in(hidden, (norm_weight, EPS), weights, biases, cos, signed_sin)
    out = layer.attention_out(attended, hidden, (o_w, o_b), (out_norm, EPS), mlp, mlp_b)
    for index, (t, saved) in enumerate(zip(tensors, before, strict=True)):
        assert torch.equal(t, saved), index
    assert qkv.data_ptr() != hidden.data_ptr() and out.data_ptr() != hidden.data_ptr()
    # with MLP biases too, still the documented math (gate/up/down biases added to their products)
    h = hidden.double() + attended.double() @ o_w.double().T + o_b.double()
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * out_norm.double()
    gate, up, down = (m.double() for m in mlp)
    gb, ub, db = (b.double() for b in mlp_b)
    expected = h + (functional.silu(n @ gate.T + gb) * (n @ up.T + ub)) @ down.T + db
    _close(out, expected)


def test_refusals() -> None:
    """Wrong shapes, a non-contiguous input and a non-float32 input raise ValueError."""
    layer, (weights, biases, norm_weight), ((o_w, o_b), out_norm, mlp, mlp_b), rows = _case(3, False, 2)
    hidden, attended, cos, signed_sin = rows
    width = SMALL[0]
    # sanity: the good call works
    assert layer.attention_in(hidden, (norm_weight, EPS), weights, biases, cos, signed_sin).shape == (2, 128)

    bad_in = {
        "wrong width": (torch.randn(2, width + 1), cos, signed_sin),
        "non-contiguous": (torch.randn(width, 2).T, cos, signed_sin),
        "float64": (hidden.double(), cos, signed_sin),
        "cos rows": (hidden, cos[:1].clone(), signed_sin),
    }
    for name, (h, c, s) in bad_in.items():
        with pytest.raises(ValueError):
            layer.attention_in(h, (norm_weight, EPS), weights, biases, c, s)
            pytest.fail(name)
    with pytest.raises(ValueError):
        layer.attention_in(hidden, (norm_weight, EPS), weights, (None, torch.randn(7), None), cos, signed_sin)
    bad_out = {
        "residual rows": (attended, torch.randn(3, width), mlp),
        "attended width": (torch.randn(2, o_w.shape[1] - 1), hidden, mlp),
        "transposed down": (attended, hidden, (mlp[0], mlp[1], mlp[2].T)),
        "float16": (attended.half(), hidden, mlp),
    }
    for name, (a, r, m) in bad_out.items():
        with pytest.raises(ValueError):
            layer.attention_out(a, r, (o_w, o_b), (out_norm, EPS), m, mlp_b)
            pytest.fail(name)


async def test_few_rows_engine_answers_greedy_requests_on_the_compiled_path(
    tiny_model_dir: Path, make_engine: Any
) -> None:
    """A model loaded with `float32_few_rows` runs the compiled decoder layer, and each greedy request gets exactly
    its max_new_tokens (or stops at EOS), same tokens whether run alone or side by side."""
    options = LoadOptions(cache_dir=tiny_model_dir / "cache", float32_few_rows=True)
    model, tokenizer = load_model(str(tiny_model_dir), options)
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    assert engine.counters.paths["decoder_layer"] == "compiled"
    prompts = [([5, 6, 7], 8), ([9, 10], 5), ([4], 6)]
    alone = []
    for index, (ids, n) in enumerate(prompts):
        deltas = await collect(engine.submit(EngineRequest(f"a{index}", input_ids=ids, params=greedy(n))))
        assert deltas and deltas[-1].finished
        tokens = tokens_of(deltas)
        assert 1 <= len(tokens) <= n
        if len(tokens) < n:
            assert deltas[-1].finish_reason == "stop"
        alone.append(tokens)
    streams = [
        engine.submit(EngineRequest(f"b{i}", input_ids=ids, params=greedy(n))) for i, (ids, n) in enumerate(prompts)
    ]
    together = await asyncio.gather(*(collect(stream) for stream in streams))
    assert [tokens_of(deltas) for deltas in together] == alone
    assert engine.counters.paths["decoder_layer"] == "compiled"
