"""The native float32 decoder-layer halves (`kernels/decoder_layer_float32.c`), which the lean layers run for steps
of up to `FEW_ROWS` rows in the float32 few-row mode: before attention, the torch ops' bits exactly; after it, the
torch ops' result within SiLU's last bit; what they refuse; and the engine with them, beside the torch ops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from tests.engine.conftest import record_rows
from tests.engine.test_engine import collect, greedy, mixed_prompts, tokens_of
from worker.engine import lean_layers
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import AttentionIn, DecoderLayer, FewRows, RmsNorm
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import FEW_ROWS
from worker.engine.types import EngineRequest

EPS = 1e-5


def _kernels(width: int) -> tuple[DecoderLayer, FewRows, RmsNorm]:
    layer, few_rows, norm = (
        cpu_kernels.decoder_layer(width),
        cpu_kernels.few_rows(torch.float32),
        cpu_kernels.rms_norm(width),
    )
    assert layer is not None and few_rows is not None and norm is not None, "all build on CI's x86 CPU"
    return layer, few_rows, norm


def _rotary(rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(rows).unsqueeze(1) * torch.rand(head_dim // 2).repeat(2)
    sin = angles.sin()
    return angles.cos(), torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)


# SmolLM2's layer (576 wide, 9 query heads and 3 KV heads of 64, MLP 1536), and a small odd one.
SHAPES = [(576, 9, 3, 64, 1536), (72, 3, 1, 24, 100)]


@pytest.mark.parametrize(("width", "heads", "kv_heads", "head_dim", "intermediate"), SHAPES)
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
def test_before_attention_it_gives_the_torch_ops_bits(
    width: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, biased: bool
) -> None:
    """RMSNorm, q/k/v by the few-row kernel, rotary as `x * cos + roll(x) * signed_sin`: what the lean layer's torch
    ops compute, bit for bit, at every row count it serves."""
    layer, few_rows, norm = _kernels(width)
    torch.manual_seed(width + biased)
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    weights = tuple(torch.randn(out, width) * 0.1 for out in widths)
    biases = tuple(torch.randn(out) if biased else None for out in widths)
    norm_weight = torch.randn(width)
    for rows in range(1, FEW_ROWS + 1):
        hidden = torch.randn(rows, width) * 3
        cos, signed_sin = _rotary(rows, head_dim)
        got = layer.attention_in(hidden, (norm_weight, EPS), weights, biases, cos, signed_sin)
        normed = norm(hidden, norm_weight, EPS)
        qkv = torch.cat([few_rows(normed, w, b) for w, b in zip(weights, biases, strict=True)], dim=1)
        rotated = qkv[:, : widths[0] + widths[1]].view(rows, -1, head_dim)
        turned = torch.roll(rotated, head_dim // 2, dims=-1).mul_(signed_sin.unsqueeze(1))
        expected = torch.cat([(rotated * cos.unsqueeze(1)).add_(turned).view(rows, -1), qkv[:, -widths[2] :]], 1)
        assert torch.equal(got, expected), rows


@pytest.mark.parametrize(("width", "heads", "kv_heads", "head_dim", "intermediate"), SHAPES)
def test_after_attention_it_is_the_torch_ops_within_silus_last_bit(
    width: int, heads: int, kv_heads: int, head_dim: int, intermediate: int
) -> None:
    """Output projection plus residual, RMSNorm, SiLU(gate) * up, down plus residual: the C library's `expf` in
    SiLU may round differently from torch's vector exp, nothing else differs; a row's result is its own whatever
    rows share the call."""
    layer, few_rows, norm = _kernels(width)
    torch.manual_seed(width)
    output = (torch.randn(width, heads * head_dim) * 0.1, torch.randn(width))
    weights = (torch.randn(intermediate, width) * 0.1, torch.randn(intermediate, width) * 0.1)
    down = torch.randn(width, intermediate) * 0.1
    norm_weight = torch.randn(width)
    attended, residual = torch.randn(FEW_ROWS, heads * head_dim), torch.randn(FEW_ROWS, width) * 3
    got = layer.attention_out(attended, residual, output, (norm_weight, EPS), (*weights, down), (None, None, None))
    hidden = few_rows(attended, *output).add_(residual)
    normed = norm(hidden, norm_weight, EPS)
    gated = functional.silu(few_rows(normed, weights[0], None)).mul_(few_rows(normed, weights[1], None))
    expected = few_rows(gated, down, None).add_(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for row in range(FEW_ROWS):
        alone = layer.attention_out(
            attended[row : row + 1], residual[row : row + 1], output, (norm_weight, EPS), (*weights, down),
            (None, None, None),
        )  # fmt: skip
        assert torch.equal(alone[0], got[row])


def test_they_refuse_what_does_not_fit() -> None:
    layer, _, _ = _kernels(576)
    hidden, norm = torch.randn(2, 576), (torch.ones(576), EPS)
    weights = (torch.randn(576, 576), torch.randn(192, 576), torch.randn(192, 576))
    none = (None, None, None)
    cos, signed_sin = _rotary(2, 64)
    layer.attention_in(hidden, norm, weights, none, cos, signed_sin)  # fits
    wrong: list[tuple[str, Any]] = [
        ("rows of another width", (torch.randn(2, 570), norm, weights, none, cos, signed_sin)),
        ("non-contiguous rows", (torch.randn(576, 2).T, norm, weights, none, cos, signed_sin)),
        ("bfloat16 rows", (hidden.bfloat16(), norm, weights, none, cos, signed_sin)),
        ("a weight of another input width", (hidden, norm, (weights[0], weights[1][:, :500], weights[2]), none,
                                             cos, signed_sin)),
        ("v wider than k", (hidden, norm, (*weights[:2], torch.randn(256, 576)), none, cos, signed_sin)),
        ("a bias of another width", (hidden, norm, weights, (torch.randn(5), None, None), cos, signed_sin)),
        ("a rotary table per another row count", (hidden, norm, weights, none, *_rotary(3, 64))),
        ("a head size q's width is no multiple of", (hidden, norm, weights, none, *_rotary(2, 60))),
        ("a norm weight of another width", (hidden, (torch.ones(575), EPS), weights, none, cos, signed_sin)),
    ]  # fmt: skip
    for what, arguments in wrong:
        with pytest.raises(ValueError):
            layer.attention_in(*arguments)
            pytest.fail(what)
    attended, output = torch.randn(2, 576), (torch.randn(576, 576), None)
    mlp = (torch.randn(1536, 576), torch.randn(1536, 576), torch.randn(576, 1536))
    layer.attention_out(attended, hidden, output, norm, mlp, none)  # fits
    with pytest.raises(ValueError):
        layer.attention_out(attended[:1], hidden, output, norm, mlp, none)
    with pytest.raises(ValueError):
        layer.attention_out(attended, hidden, output, norm, (mlp[0], mlp[1][:100], mlp[2]), none)
    with pytest.raises(ValueError):
        layer.attention_out(attended, hidden, output, norm, (*mlp[:2], mlp[2].T), none)


async def _run(engine: Any, workload: list[tuple[list[int], int]]) -> list[tuple[list[int], list[float]]]:
    """Each request alone: its greedy tokens and their logprobs."""
    results = []
    for index, (ids, n) in enumerate(workload):
        deltas = await collect(engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n, logprobs=0))))
        results.append((tokens_of(deltas), [entry.logprob for delta in deltas for entry in delta.logprobs or []]))
    return results


async def test_the_few_row_engine_runs_them_for_a_few_rows_beside_the_torch_ops(
    tiny_model_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded with `float32_few_rows` (llama, and qwen2 with q/k/v biases): decode steps take the native halves,
    prompts of more than `FEW_ROWS` tokens the torch ops; tokens equal and logprobs within float32 rounding of the
    same engine on the torch ops alone. The default float32 engine never takes them."""
    rows_seen = record_rows(monkeypatch, AttentionIn, "__call__")
    options = LoadOptions(cache_dir=tiny_model_dir / "cache", float32_few_rows=True)
    model, tokenizer = load_model(str(tiny_model_dir), options)
    workload = [*mixed_prompts(model.config.vocab_size, count=4, seed=5), ([5, 6, 7], 9)]
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    assert engine.counters.paths["decoder_layer"] == "compiled"  # `llmq:engine_path{component="decoder_layer"}`
    native = await _run(engine, workload)
    assert rows_seen and max(rows_seen) <= FEW_ROWS
    assert rows_seen.count(1) >= sum(n - 1 for _, n in workload) * model.config.num_hidden_layers

    monkeypatch.setattr(lean_layers, "_native_layer", lambda layer, width: None)
    rows_seen.clear()
    torch_ops = await _run(await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer), workload)
    assert not rows_seen
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(native, torch_ops, strict=True):
        assert tokens == expected_tokens
        torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-4)

    monkeypatch.undo()
    rows_seen = record_rows(monkeypatch, AttentionIn, "__call__")
    default, _ = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache"))
    engine = await make_engine(tiny_model_dir, model=default, tokenizer=tokenizer)
    await _run(engine, workload[-1:])
    assert not rows_seen and "decoder_layer" not in engine.counters.paths


def test_a_layer_is_bound_once_and_again_when_a_weight_is_replaced(llama_dir: Path) -> None:
    """The lean layer's halves check its weights once; a parameter replaced, or its storage swapped through `.data`,
    binds them again (so the native code never reads a freed tensor), while a weight changed in place keeps the
    binding and is read as it is now."""
    model, _ = load_model(str(llama_dir), LoadOptions(cache_dir=llama_dir / "cache", float32_few_rows=True))
    layer = model.get_decoder().layers[0]
    native = lean_layers._native_layer(layer, model.config.hidden_size)
    assert native is not None
    first = native.halves()
    assert native.halves() == first  # nothing changed: the same bound halves

    hidden = torch.randn(1, model.config.hidden_size)
    cos, signed_sin = _rotary(1, layer.self_attn.head_dim)
    before = first[0](hidden, cos, signed_sin)
    with torch.no_grad():
        layer.self_attn.q_proj.weight.mul_(2)  # in place: same binding, new values
    assert native.halves() == first
    assert not torch.equal(first[0](hidden, cos, signed_sin), before)

    layer.mlp.up_proj.weight = torch.nn.Parameter(layer.mlp.up_proj.weight.detach().clone())
    replaced = native.halves()
    assert replaced[1] is not first[1]
    layer.self_attn.v_proj.weight.data = layer.self_attn.v_proj.weight.detach().clone()
    assert native.halves()[0] is not replaced[0]
