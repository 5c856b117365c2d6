"""The native decoder layer (`kernels/decoder_layer.c`), which the lean layers run for steps of up to `few_rows_limit`
rows in the float32 few-row mode and, built for bfloat16, in the bfloat16 mode: before attention, the torch ops' bits
exactly; after it, the torch ops' result within SiLU's last bit; a step of decode rows in one call, the bits of the
calls it replaces; what they refuse; and the engine with them, beside the torch ops, in both dtypes."""

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
from worker.engine.kernels.cpu_kernels import AttentionIn, DecoderLayer, DecodeRows, DecodeWrites, FewRows
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import few_rows_limit
from worker.engine.types import EngineRequest

EPS = 1e-5


BF16 = torch.bfloat16
native_bfloat16 = pytest.mark.skipif(
    not cpu_kernels.native_bfloat16(), reason="this CPU has no native bfloat16 products (AVX-512 BF16)"
)
DTYPES = [torch.float32, pytest.param(BF16, marks=native_bfloat16)]


def _kernels(width: int, dtype: torch.dtype = torch.float32) -> tuple[DecoderLayer, FewRows, Any]:
    """The layer, the few-row product and the lean layer's RMSNorm in `dtype`."""
    layer, few_rows = cpu_kernels.decoder_layer(width, dtype), cpu_kernels.few_rows(dtype)
    assert layer is not None and few_rows is not None, "both build on CI's x86 CPU (bfloat16 where it has AVX-512 BF16)"
    return layer, few_rows, lean_layers._rms_norm(width, dtype)


def _random(dtype: torch.dtype, *shape: int, scale: float = 0.1) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def _rotary(rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(rows).unsqueeze(1) * torch.rand(head_dim // 2).repeat(2)
    sin = angles.sin()
    return angles.cos(), torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)


# SmolLM2's layer (576 wide, 9 query heads and 3 KV heads of 64, MLP 1536), and a small odd one.
SHAPES = [(576, 9, 3, 64, 1536), (72, 3, 1, 24, 100)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("width", "heads", "kv_heads", "head_dim", "intermediate"), SHAPES)
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
def test_before_attention_it_gives_the_torch_ops_bits(
    width: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, biased: bool, dtype: torch.dtype
) -> None:
    """RMSNorm (bfloat16's rounds the normed rows, then weights them, as the library's), q/k/v by the few-row kernel,
    rotary as `x * cos + roll(x) * signed_sin`: what the lean layer's torch ops compute, bit for bit, at every row
    count it serves."""
    layer, few_rows, norm = _kernels(width, dtype)
    torch.manual_seed(width + biased)
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    weights = tuple(_random(dtype, out, width) for out in widths)
    biases = tuple(_random(dtype, out, scale=1.0) if biased else None for out in widths)
    norm_weight = _random(dtype, width, scale=1.0)
    for rows in range(1, few_rows_limit(dtype) + 1):
        hidden = _random(dtype, rows, width, scale=3.0)
        cos, signed_sin = (table.to(dtype) for table in _rotary(rows, head_dim))
        got = layer.attention_in(hidden, (norm_weight, EPS), weights, biases, cos, signed_sin)
        normed = norm(hidden, norm_weight, EPS)
        qkv = torch.cat([few_rows(normed, w, b) for w, b in zip(weights, biases, strict=True)], dim=1)
        rotated = qkv[:, : widths[0] + widths[1]].view(rows, -1, head_dim)
        turned = torch.roll(rotated, head_dim // 2, dims=-1).mul_(signed_sin.unsqueeze(1))
        expected = torch.cat([(rotated * cos.unsqueeze(1)).add_(turned).view(rows, -1), qkv[:, -widths[2] :]], 1)
        assert torch.equal(got, expected), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("width", "heads", "kv_heads", "head_dim", "intermediate"), SHAPES)
def test_after_attention_it_is_the_torch_ops_within_silus_last_bit(
    width: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, dtype: torch.dtype
) -> None:
    """Output projection plus residual, RMSNorm, SiLU(gate) * up, down plus residual, each rounded as its torch op
    rounds: the C library's `expf` in SiLU may round differently from torch's vector exp (in bfloat16 that moves an
    element only across a rounding boundary: none here), nothing else differs; a row's result is its own whatever
    rows share the call."""
    layer, few_rows, norm = _kernels(width, dtype)
    torch.manual_seed(width)
    output = (_random(dtype, width, heads * head_dim), _random(dtype, width, scale=1.0))
    weights = (_random(dtype, intermediate, width), _random(dtype, intermediate, width))
    down = _random(dtype, width, intermediate)
    norm_weight = _random(dtype, width, scale=1.0)
    rows = few_rows_limit(dtype)
    attended, residual = _random(dtype, rows, heads * head_dim, scale=1.0), _random(dtype, rows, width, scale=3)
    got = layer.attention_out(attended, residual, output, (norm_weight, EPS), (*weights, down), (None, None, None))
    hidden = few_rows(attended, *output).add_(residual)
    normed = norm(hidden, norm_weight, EPS)
    gated = functional.silu(few_rows(normed, weights[0], None)).mul_(few_rows(normed, weights[1], None))
    expected = few_rows(gated, down, None).add_(hidden)
    if dtype == BF16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for row in range(rows):
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


def _one_layer(
    width: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, biased: bool, dtype: torch.dtype
) -> Any:
    """Random weights of one layer, bound to the native halves."""
    layer, _, _ = _kernels(width, dtype)
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    halves = (
        layer.bind_in(
            (_random(dtype, width, scale=1.0), EPS),
            tuple(_random(dtype, out, width) for out in widths),
            tuple(_random(dtype, out, scale=1.0) if biased else None for out in widths),
            head_dim,
        ),
        layer.bind_out(
            (_random(dtype, width, widths[0]), _random(dtype, width, scale=1.0) if biased else None),
            (_random(dtype, width, scale=1.0), EPS),
            (_random(dtype, intermediate, width), _random(dtype, intermediate, width),
             _random(dtype, width, intermediate)),
            tuple(_random(dtype, out, scale=1.0) if biased else None for out in (intermediate, intermediate, width)),
        ),
    )  # fmt: skip
    return layer, halves


def _decode_rows(rows: int, cache_rows: int, generator: torch.Generator) -> DecodeWrites:
    """`rows` requests of random lengths over random cache rows, in a shuffled order, each ending at the row its
    new key is written to."""
    lengths = torch.randint(1, 40, (rows,), generator=generator)
    index = torch.randperm(cache_rows, generator=generator)[: int(lengths.sum())]
    starts = torch.cumsum(lengths, 0) - lengths
    order = torch.randperm(rows, generator=generator)
    decode = DecodeRows(order, starts, lengths, index)
    return DecodeWrites(decode, index[starts + lengths - 1][torch.argsort(order)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("width", "heads", "kv_heads", "head_dim", "intermediate"), SHAPES)
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
def test_a_step_of_decode_rows_in_one_call_gives_the_calls_bits(
    width: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, biased: bool, dtype: torch.dtype
) -> None:
    """`decode_step`: the half before attention, each row's key and value written to its cache row, the paged decode
    kernel (float32 queries and sums, rounded once to the cache's dtype), the half after, bit for bit as those calls
    in turn, at every row count it serves; cache rows other than the written ones untouched."""
    torch.manual_seed(width + biased)
    layer, halves = _one_layer(width, heads, kv_heads, head_dim, intermediate, biased, dtype)
    paged = cpu_kernels.load(dtype)
    assert paged is not None
    generator = torch.Generator().manual_seed(width)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    for rows in range(1, few_rows_limit(dtype) + 1):
        cache_rows = 40 * rows  # room for every request's longest span (39 rows)
        writes = _decode_rows(rows, cache_rows, generator)
        hidden = _random(dtype, rows, width, scale=3.0)
        cos, signed_sin = (table.to(dtype) for table in _rotary(rows, head_dim))
        keys, values = (_random(dtype, cache_rows, kv_heads, head_dim, scale=1.0) for _ in range(2))
        expected_keys, expected_values = keys.clone(), values.clone()
        qkv = halves[0](hidden, cos, signed_sin)
        expected_keys.view(cache_rows, -1).index_copy_(0, writes.write_index, qkv[:, q_width : q_width + kv_width])
        expected_values.view(cache_rows, -1).index_copy_(0, writes.write_index, qkv[:, q_width + kv_width :])
        sums = torch.empty(rows, heads, head_dim)
        query = qkv[:, :q_width].float().reshape(rows, heads, head_dim).contiguous()
        paged(query, expected_keys, expected_values, writes.rows, head_dim**-0.5, sums)
        expected = halves[1](sums.to(dtype).view(rows, -1), hidden)

        got = layer.decode_step(halves, hidden, cos, signed_sin, (keys, values), writes, head_dim**-0.5)
        assert torch.equal(got, expected), rows
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values), rows


def test_a_step_of_decode_rows_refuses_what_does_not_fit() -> None:
    torch.manual_seed(0)
    layer, halves = _one_layer(72, 3, 1, 24, 100, False, torch.float32)
    hidden, cos_sin = torch.randn(2, 72), _rotary(2, 24)
    cache = (torch.randn(100, 1, 24), torch.randn(100, 1, 24))
    writes = _decode_rows(2, 100, torch.Generator().manual_seed(0))
    layer.decode_step(halves, hidden, *cos_sin, cache, writes, 0.2)  # fits
    rows = writes.rows
    small = (torch.randn(50, 1, 24), torch.randn(50, 1, 24))
    _, other = _one_layer(72, 2, 1, 24, 100, False, torch.float32)
    wrong: list[tuple[str, Any]] = [
        ("three rows for a plan of two", (halves, torch.randn(3, 72), *_rotary(3, 24), cache, writes, 0.2)),
        ("a cache of another row width", (halves, hidden, *cos_sin, (cache[0][:, :, :12], cache[1][:, :, :12]),
                                          writes, 0.2)),
        ("a cache too short for its rows", (halves, hidden, *cos_sin, small, writes, 0.2)),
        ("a bfloat16 cache", (halves, hidden, *cos_sin, (cache[0].bfloat16(), cache[1].bfloat16()), writes, 0.2)),
        ("halves of two layers", ((halves[0], other[1]), hidden, *cos_sin, cache, writes, 0.2)),
    ]  # fmt: skip
    for what, arguments in wrong:
        with pytest.raises(ValueError):
            layer.decode_step(*arguments)
            pytest.fail(what)
    with pytest.raises(ValueError):  # a row attended twice, another never
        DecodeWrites(DecodeRows(torch.tensor([1, 1]), rows.starts, rows.lengths, rows.index), writes.write_index)
    with pytest.raises(ValueError):
        DecodeWrites(rows, torch.tensor([3, -1]))
    with pytest.raises(ValueError):
        DecodeWrites(rows, torch.tensor([3]))


def _record_whole_layers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Notes the row count of each `DecoderLayer.decode_step` call (a whole layer in one call) in the list returned."""
    calls: list[int] = []
    decode_step = DecoderLayer.decode_step

    def recorded(self: DecoderLayer, halves: Any, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return decode_step(self, halves, hidden, *args)

    monkeypatch.setattr(DecoderLayer, "decode_step", recorded)
    return calls


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
    """Loaded with `float32_few_rows` (llama, and qwen2 with q/k/v biases): steps of decode rows only take the whole
    layer in one call, other steps of up to `few_rows_limit` rows (a short prompt) the native halves, longer prompts the
    torch ops; tokens equal and logprobs within float32 rounding of the same engine on the torch ops alone. The
    default float32 engine never takes them."""
    rows_seen = record_rows(monkeypatch, AttentionIn, "__call__")
    whole_layers = _record_whole_layers(monkeypatch)
    options = LoadOptions(cache_dir=tiny_model_dir / "cache", float32_few_rows=True)
    model, tokenizer = load_model(str(tiny_model_dir), options)
    workload = [*mixed_prompts(model.config.vocab_size, count=4, seed=5), ([5, 6, 7], 9)]
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    assert engine.counters.paths["decoder_layer"] == "compiled"  # `llmq:engine_path{component="decoder_layer"}`
    native = await _run(engine, workload)
    assert 3 in rows_seen and max(rows_seen) <= few_rows_limit(torch.float32)  # the 3-token prompt, on the halves
    assert whole_layers and max(whole_layers) <= few_rows_limit(torch.float32)
    assert whole_layers.count(1) >= sum(n - 1 for _, n in workload) * model.config.num_hidden_layers

    monkeypatch.setattr(lean_layers, "_native_layer", lambda layer, width: None)
    rows_seen.clear()
    whole_layers.clear()
    torch_ops = await _run(await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer), workload)
    assert not rows_seen and not whole_layers
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


@native_bfloat16
def test_the_bfloat16_layer_refuses_float32_tensors() -> None:
    layer, _, _ = _kernels(72, BF16)
    hidden, cos_sin = torch.randn(2, 72), _rotary(2, 24)
    weights = (torch.randn(72, 72), torch.randn(24, 72), torch.randn(24, 72))
    with pytest.raises(ValueError, match="bfloat16"):
        layer.attention_in(hidden, (torch.ones(72), EPS), weights, (None, None, None), *cos_sin)
    bf16 = tuple(w.to(BF16) for w in weights)
    with pytest.raises(ValueError, match="bfloat16"):  # bfloat16 weights, float32 rows
        layer.attention_in(hidden, (torch.ones(72, dtype=BF16), EPS), bf16, (None, None, None), *cos_sin)


@native_bfloat16
async def test_a_bfloat16_engine_runs_it_for_a_few_rows_beside_the_torch_ops(
    tiny_model_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 model (llama, and qwen2 with q/k/v biases) takes the native layer for its steps of a few rows,
    with `llmq:engine_path{component="decoder_layer"}` saying so; its tokens follow the same engine on the torch ops
    (SiLU's last bit aside: none seen here) and its logprobs stay within bfloat16's rounding of them."""
    calls = _record_whole_layers(monkeypatch)
    model, tokenizer = load_model(str(tiny_model_dir), LoadOptions(dtype="bfloat16", cache_dir=tiny_model_dir / "c"))
    workload = [([5, 6, 7, 8, 9, 10, 11, 12], 12), ([40, 41], 10), ([100, 7, 9, 3, 1, 2, 60, 61, 62], 12)]
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    assert engine.counters.paths["decoder_layer"] == "compiled"
    native = await _run(engine, workload)
    assert calls.count(1) >= sum(n - 1 for _, n in workload) * model.config.num_hidden_layers

    monkeypatch.setattr(lean_layers, "_native_layer", lambda layer, width: None)
    calls.clear()
    torch_ops = await _run(await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer), workload)
    assert not calls
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(native, torch_ops, strict=True):
        assert tokens == expected_tokens
        torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=0.05)


@native_bfloat16
@pytest.mark.parametrize("limit", [6, 16])
async def test_a_bfloat16_engine_runs_the_native_layer_up_to_its_row_limit(
    tiny_model_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """Ten requests decoding together: their steps of decode rows run the whole layer in one call up to the limit
    (`few_rows_limit`: 32 rows for bfloat16 on a CPU without AMX, 6 with it), above it the torch ops; every request
    gets all its tokens either way."""
    monkeypatch.setattr(lean_layers, "few_rows_limit", lambda dtype: limit)
    calls = _record_whole_layers(monkeypatch)
    model, tokenizer = load_model(str(tiny_model_dir), LoadOptions(dtype="bfloat16", cache_dir=tiny_model_dir / "c"))
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    streams = [
        engine.submit(EngineRequest(f"r{index}", input_ids=[5 + index, 9, 11], params=greedy(8, ignore_eos=True)))
        for index in range(10)
    ]
    for stream in streams:
        assert len(tokens_of(await collect(stream))) == 8
    assert max(calls, default=0) <= limit
    assert (max(calls, default=0) == 10) == (limit >= 10)  # ten decode rows in one call only where the limit allows
