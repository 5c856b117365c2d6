"""Black-box tests of bfloat16 on CPU (`LLMQ_DTYPE=bfloat16`), written from its documented contract only.

The contract under test:

- `cpu_kernels.few_rows()` gives `FewRows(x, weight, bias)`: `x @ weight.T + bias` for contiguous bfloat16 CPU
  tensors, bfloat16 `[rows, out]`, summed in float32 and rounded once; a row's output does not depend on the other
  rows of the call; anything else is refused with ValueError.
- `prepack` wraps bfloat16 linears as `PackedLinear`: up to `few_rows_limit(torch.bfloat16)` rows (6 on a CPU with
  AMX, 32 without) through the few-row kernel, more through oneDNN at `row_bucket` rows.
- `cpu_kernels.load(torch.bfloat16)` is the paged decode kernel over a bfloat16 cache (float32 query and out), the
  float32 attention over the widened cache; `load(torch.float16)` is None.
- The loader loads bfloat16 where the CPU multiplies it natively, else float32 with exactly one warning.
- The engine serves bfloat16 models (`paged_decode: compiled`, `decoder_layers: lean`): every request gets exactly
  `max_new_tokens` with `ignore_eos`, its first token is `generate`'s; float32 stays bitwise `generate`'s.

References are computed in float64 from the very bfloat16 numbers the kernels are given.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from tests.engine.conftest import load, reference_greedy
from tests.engine.test_engine import collect, greedy, mixed_prompts, tokens_of
from tests.polling import wait_until
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import DecodeRows, FewRows, PagedDecode
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import PackedLinear, few_rows_limit, prepack, row_bucket
from worker.engine.types import EngineRequest, Finish, GenerationParams

BFLOAT16_FEW_ROWS = few_rows_limit(torch.bfloat16)  # 6 with AMX, 32 without

NATIVE = cpu_kernels.native_bfloat16()
native = pytest.mark.skipif(not NATIVE, reason="this CPU has no native bfloat16 products (AVX-512 BF16)")
LOADER_LOGGER = "worker.engine.loader"


def load_bf16(folder: Path, **options: Any) -> tuple[Any, Any]:
    return load_model(str(folder), LoadOptions(dtype="bfloat16", cache_dir=folder / "cache", **options))


@pytest.fixture(scope="module")
def few_rows() -> FewRows:
    if not NATIVE:
        pytest.skip("no native bfloat16 here")
    kernel = cpu_kernels.few_rows()
    assert kernel is not None, "few_rows() must build where native_bfloat16() is True"
    return kernel


@pytest.fixture(scope="module")
def bf16_decode() -> PagedDecode:
    kernel = cpu_kernels.load(torch.bfloat16)
    assert kernel is not None, "the bfloat16 paged decode kernel must build where there is a C compiler"
    return kernel


def exact_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def assert_rounded_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Float32 sums (error at most a small multiple of eps times the sum of |terms|), then one bfloat16 rounding
    (half an ulp: 2^-9 relative, 2^-8 with slack)."""
    exact = exact_product(x, weight, bias)
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = exact.abs() * 2**-8 + magnitude * 1e-5 + 1e-30
    error = (out.double() - exact).abs()
    worst = int((error - bound).argmax())
    assert bool((error <= bound).all()), (
        f"few_rows off by {error.flatten()[worst].item():.3g} (bound {bound.flatten()[worst].item():.3g}) "
        f"at flat index {worst}: got {out.flatten()[worst].item()}, exact {exact.flatten()[worst].item()}"
    )


# ---------------------------------------------------------------------------------------------------------------
# The few-row kernel
# ---------------------------------------------------------------------------------------------------------------


@native
@pytest.mark.parametrize("in_features", [1, 2, 31, 33, 63, 1000])
@pytest.mark.parametrize("out_features", [1, 3, 5, 67])
@pytest.mark.parametrize("biased", [False, True], ids=["nobias", "bias"])
def test_few_rows_matches_the_exact_product_at_odd_widths(
    few_rows: FewRows, in_features: int, out_features: int, biased: bool
) -> None:
    """Input widths that are not a multiple of 32 (a masked tail), output widths that are not a multiple of 4 (a
    short last block), and 67 columns (more than 16 blocks: the threaded path), for every row count it serves."""
    generator = torch.Generator().manual_seed(in_features * 100 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = (torch.randn(out_features, generator=generator) * 3).bfloat16() if biased else None
    for rows in range(1, BFLOAT16_FEW_ROWS + 3):
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        out = few_rows(x, weight, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features) and out.is_contiguous()
        assert_rounded_product(out, x, weight, bias)


@native
def test_few_rows_is_exact_where_float32_sums_are(few_rows: FewRows) -> None:
    """Small integers: every product and partial sum is exact in float32 and the result fits a bfloat16, so the
    output is the exact answer bit for bit (the bias added before the one rounding)."""
    generator = torch.Generator().manual_seed(5)
    for in_features, out_features in ((37, 6), (64, 9), (1, 1), (129, 4)):
        weight = torch.randint(-3, 4, (out_features, in_features), generator=generator).bfloat16()
        bias = torch.randint(-8, 9, (out_features,), generator=generator).bfloat16()
        for rows in (1, 4, 5, BFLOAT16_FEW_ROWS):
            x = torch.randint(-1, 2, (rows, in_features), generator=generator).bfloat16()
            expected = exact_product(x, weight, bias)
            assert bool((expected.abs() <= 256).all())  # exactly representable in bfloat16
            assert torch.equal(few_rows(x, weight, bias).double(), expected), (in_features, out_features, rows)
            assert torch.equal(few_rows(x, weight, None).double(), exact_product(x, weight, None))


@native
@pytest.mark.parametrize(("in_features", "out_features"), [(33, 5), (576, 67), (1000, 3)])
def test_few_rows_gives_each_row_the_same_bits_whatever_else_is_in_the_call(
    few_rows: FewRows, in_features: int, out_features: int
) -> None:
    """A row alone, in any batch of 1..BFLOAT16_FEW_ROWS+2 rows, in any position: the same bits."""
    generator = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    pool = torch.randn(BFLOAT16_FEW_ROWS + 2, in_features, generator=generator).bfloat16()
    alone = torch.stack([few_rows(pool[i : i + 1].contiguous(), weight, bias)[0] for i in range(pool.shape[0])])
    rng = random.Random(in_features)
    for count in range(1, pool.shape[0] + 1):
        for _ in range(3):
            chosen = rng.sample(range(pool.shape[0]), count)
            out = few_rows(pool[chosen].contiguous(), weight, bias)
            assert torch.equal(out, alone[chosen]), (count, chosen)


@native
def test_few_rows_propagates_nan_and_inf_to_their_own_outputs_only(few_rows: FewRows) -> None:
    in_features, out_features = 33, 6
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(out_features, in_features, generator=generator).abs().bfloat16() + 0.5
    x = torch.randn(5, in_features, generator=generator).abs().bfloat16() + 0.25
    clean = few_rows(x, weight, None)
    assert bool(clean.isfinite().all())

    poisoned = x.clone()
    poisoned[1, 32] = float("nan")  # the last element: the masked tail of the width
    poisoned[3, 0] = float("inf")  # positive weights: +inf
    poisoned[4, 10] = float("-inf")
    out = few_rows(poisoned, weight, None)
    assert bool(out[1].isnan().all()), "a NaN input makes its row NaN"
    assert bool((out[3] == float("inf")).all()), "an +inf input times positive weights is +inf"
    assert bool((out[4] == float("-inf")).all())
    for row in (0, 2):
        assert torch.equal(out[row], clean[row]), "other rows are untouched by a NaN or inf next to them"

    inf_weight = weight.clone()
    inf_weight[2, 32] = float("inf")
    zero_there = x.clone()
    zero_there[0, 32] = 0.0  # 0 * inf = NaN
    out = few_rows(zero_there, inf_weight, None)
    assert bool(out[0, 2].isnan())
    assert bool((out[1:, 2] == float("inf")).all())
    keep = [0, 1, 3, 4, 5]
    assert torch.equal(out[1:, keep], clean[1:, keep])
    nan_bias = torch.zeros(out_features).bfloat16()
    nan_bias[4] = float("nan")
    out = few_rows(x, weight, nan_bias)
    assert bool(out[:, 4].isnan().all()) and bool(out[:, [0, 1, 2, 3, 5]].isfinite().all())


@native
def test_few_rows_refuses_what_it_cannot_read(few_rows: FewRows) -> None:
    weight = torch.randn(8, 40).bfloat16()
    x = torch.randn(3, 40).bfloat16()
    bias = torch.randn(8).bfloat16()
    refused: list[tuple[str, tuple[Any, ...]]] = [
        ("float32 rows", (x.float(), weight, None)),
        ("float32 weight", (x, weight.float(), None)),
        ("float32 bias", (x, weight, bias.float())),
        ("float16 rows", (x.half(), weight, None)),
        ("transposed rows", (torch.randn(40, 3).bfloat16().T, weight, None)),
        ("transposed weight", (x, torch.randn(40, 8).bfloat16().T, None)),
        ("strided bias", (x, weight, torch.randn(16).bfloat16()[::2])),
        ("narrow rows", (torch.randn(3, 39).bfloat16(), weight, None)),
        ("wide rows", (torch.randn(3, 41).bfloat16(), weight, None)),
        ("1-D rows", (torch.randn(40).bfloat16(), weight, None)),
        ("3-D rows", (torch.randn(1, 3, 40).bfloat16(), weight, None)),
        ("short bias", (x, weight, torch.randn(7).bfloat16())),
        ("2-D bias", (x, weight, torch.randn(1, 8).bfloat16())),
    ]
    for what, arguments in refused:
        with pytest.raises(ValueError):
            few_rows(*arguments)
            pytest.fail(f"few_rows accepted {what}")


# ---------------------------------------------------------------------------------------------------------------
# bfloat16 linears through prepack
# ---------------------------------------------------------------------------------------------------------------


@native
def test_a_packed_bfloat16_linear_routes_rows_as_documented() -> None:
    """Up to `few_rows_limit` rows: the few-row kernel's bits; more: oneDNN's product at `row_bucket` rows, its extra
    rows dropped. Any leading shape; tied layers stay one module; a weight changed in place is used at once."""
    torch.manual_seed(3)
    shared = nn.Linear(45, 7, bias=True)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Linear(7, 45, bias=False), nn.Sequential(shared)).to(
        torch.bfloat16
    )
    assert prepack(model) == 2
    first, last = model[0][0], model[2][0]
    assert type(first) is PackedLinear and first is last and type(model[1]) is PackedLinear
    kernel = cpu_kernels.few_rows()
    assert kernel is not None
    weight, bias = first.weight.detach(), first.bias.detach()
    with torch.no_grad():
        for rows in (0, 1, 2, BFLOAT16_FEW_ROWS, BFLOAT16_FEW_ROWS + 1, 9, 17, 33, 100):
            x = torch.randn(rows, 45).bfloat16()
            out = first(x)
            assert out.shape == (rows, 7) and out.dtype == torch.bfloat16
            if rows == 0:
                continue
            if rows <= BFLOAT16_FEW_ROWS:
                expected = kernel(x, weight, bias)
            else:
                padded = functional.pad(x, (0, 0, 0, row_bucket(rows) - rows))
                expected = functional.linear(padded, weight, bias)[:rows]
            assert torch.equal(out, expected), rows
            assert_rounded_product(out, x, weight, bias)
        x3 = torch.randn(2, 3, 45).bfloat16()  # 6 rows through a 3-D input
        assert torch.equal(first(x3), kernel(x3.reshape(6, 45), weight, bias).view(2, 3, 7))
        x_strided = torch.randn(45, 4).bfloat16().T  # non-contiguous rows are made contiguous, not refused
        assert torch.equal(first(x_strided), kernel(x_strided.contiguous(), weight, bias))
        before = first(torch.ones(1, 45).bfloat16())
        first.weight.mul_(2)
        after = first(torch.ones(1, 45).bfloat16())
        assert not torch.equal(before, after)
        assert torch.equal(after, kernel(torch.ones(1, 45).bfloat16(), first.weight.detach(), first.bias.detach()))


@native
def test_a_packed_bfloat16_linear_still_trains() -> None:
    """With autograd on, the plain product runs: gradients flow to bfloat16 weights."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(33, 5)).to(torch.bfloat16)
    prepack(model)
    x = torch.randn(3, 33).bfloat16()
    out = model(x)
    assert out.requires_grad
    out.float().sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.shape == (5, 33)
    torch.testing.assert_close(model[0].weight.grad.float(), x.float().sum(0).expand(5, 33), rtol=2**-7, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------------
# The bfloat16 paged decode kernel
# ---------------------------------------------------------------------------------------------------------------


def scattered_bf16_step(
    lengths: list[int], heads: int, kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeRows, list[torch.Tensor]]:
    """Keys and values scattered over a bfloat16 cache as pages leave them; query rows shuffled among rows that are
    not decode rows."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    cache_rows = sum(lengths) + 17
    keys = torch.randn(cache_rows, kv_heads, head_dim, generator=generator).bfloat16()
    values = (torch.randn(cache_rows, kv_heads, head_dim, generator=generator) * 2).bfloat16()
    free = list(range(cache_rows))
    rng.shuffle(free)
    reads = [torch.tensor([free.pop() for _ in range(length)], dtype=torch.int64) for length in lengths]
    tokens = len(lengths) + 2
    query_rows = rng.sample(range(tokens), len(lengths))
    query = torch.randn(tokens, heads, head_dim, generator=generator)
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    rows = DecodeRows(
        torch.tensor(query_rows, dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64),
        torch.cat(reads),
    )
    return query, keys, values, rows, reads


def exact_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """`query` `[heads, d]` over `keys`/`values` `[length, kv_heads, d]` (widened exactly), in float64."""
    group = query.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # [length, heads, d]: head h reads kv head h // group
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", query.double(), k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v).float()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(6, 2, 24), (9, 3, 7), (4, 1, 300), (8, 2, 48), (2, 2, 1), (12, 4, 64), (4, 2, 100), (14, 2, 128), (4, 2, 320)],
    ids=["gqa-24", "gqa3-7", "mqa-300", "gqa-48", "mha-1", "gqa-64", "gqa-100", "gqa7-128", "gqa-320"],
)
def test_bf16_decode_kernel_matches_exact_attention(
    bf16_decode: PagedDecode, heads: int, kv_heads: int, head_dim: int
) -> None:
    assert bf16_decode.cache_dtype == torch.bfloat16
    lengths = [1, 1031, 2, 17, 1500, 33]
    query, keys, values, rows, reads = scattered_bf16_step(lengths, heads, kv_heads, head_dim, seed=head_dim + heads)
    out = torch.full_like(query, 123.0)
    scale = 0.7 * head_dim**-0.5
    bf16_decode(query, keys, values, rows, scale, out)
    for position, read in zip(rows.query_rows.tolist(), reads, strict=True):
        expected = exact_attention(query[position], keys[read], values[read], scale)
        torch.testing.assert_close(out[position], expected, rtol=1e-5, atol=1e-5)
    untouched = sorted(set(range(query.shape[0])) - set(rows.query_rows.tolist()))
    assert bool((out[untouched] == 123.0).all()), "rows that are not decode rows are left alone"

    # the float32 kernel over the widened cache: the same attention
    float32_kernel = cpu_kernels.load(torch.float32)
    assert float32_kernel is not None
    wide = torch.full_like(query, 123.0)
    float32_kernel(query, keys.float(), values.float(), rows, scale, wide)
    torch.testing.assert_close(out, wide, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 1000, 1777])
@pytest.mark.parametrize("head_dim", [24, 64])
def test_bf16_decode_kernel_for_one_request(bf16_decode: PagedDecode, length: int, head_dim: int) -> None:
    """A lone decode row (the unthreaded path), a length of one (softmax of one score: the value itself) and long
    ones, around a 16-key block."""
    query, keys, values, rows, reads = scattered_bf16_step([length], 6, 3, head_dim, seed=length)
    out = torch.zeros_like(query)
    bf16_decode(query, keys, values, rows, head_dim**-0.5, out)
    position, read = rows.query_rows.tolist()[0], reads[0]
    expected = exact_attention(query[position], keys[read], values[read], head_dim**-0.5)
    torch.testing.assert_close(out[position], expected, rtol=1e-5, atol=1e-5)
    if length == 1:  # attention over one key is its value, widened exactly
        group = 2
        widened = values[read[0]].float().repeat_interleave(group, dim=0)
        torch.testing.assert_close(out[position], widened, rtol=1e-6, atol=0)


def test_bf16_decode_kernel_refuses_mismatched_inputs(bf16_decode: PagedDecode) -> None:
    query, keys, values, rows, _ = scattered_bf16_step([3, 5], 4, 2, 16, seed=1)
    out = torch.empty_like(query)
    with pytest.raises(ValueError):
        bf16_decode(query, keys.float(), values.float(), rows, 0.25, out)  # float32 cache for the bf16 kernel
    with pytest.raises(ValueError):
        bf16_decode(query, keys, values.half(), rows, 0.25, out)
    with pytest.raises(ValueError):
        bf16_decode(query.bfloat16(), keys, values, rows, 0.25, out.bfloat16())  # queries stay float32
    with pytest.raises(ValueError):
        bf16_decode(query, keys[:4], values[:4], rows, 0.25, out)  # rows past the cache
    with pytest.raises(ValueError):
        three_heads = query[:, :3].contiguous()
        bf16_decode(three_heads, keys, values, rows, 0.25, torch.empty_like(three_heads))  # 3 heads, 2 KV heads
    with pytest.raises(ValueError):
        bf16_decode(query, keys.transpose(1, 2), values.transpose(1, 2), rows, 0.25, out)  # non-contiguous
    assert cpu_kernels.load(torch.float16) is None
    float32_kernel = cpu_kernels.load(torch.float32)
    assert float32_kernel is not None and float32_kernel.cache_dtype == torch.float32
    with pytest.raises(ValueError):
        float32_kernel(query, keys, values, rows, 0.25, out)  # a bfloat16 cache for the float32 kernel


# ---------------------------------------------------------------------------------------------------------------
# The loader
# ---------------------------------------------------------------------------------------------------------------


async def assert_greedy_equals_generate(engine: Any, reference: Any, workload: list[tuple[list[int], int]]) -> None:
    """Every request of `workload` (prompt ids, tokens), run together greedily, gives `reference`'s `generate`
    tokens."""
    streams = [
        engine.submit(EngineRequest(f"f{i}", input_ids=ids, params=greedy(n))) for i, (ids, n) in enumerate(workload)
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for index, ((ids, n), deltas) in enumerate(zip(workload, results, strict=True)):
        assert tokens_of(deltas) == reference_greedy(reference, ids, n), f"request {index}"


def loader_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOADER_LOGGER and r.levelno >= logging.WARNING]


async def test_without_native_bf16_the_loader_warns_once_per_load_and_serves_exact_float32(
    llama_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fallback is float32 in every parameter, with one warning each load; its engine is float32's: greedy
    outputs equal float32 `generate`'s bit for bit."""
    monkeypatch.setattr(cpu_kernels, "native_bfloat16", lambda: False)
    with caplog.at_level(logging.WARNING, logger=LOADER_LOGGER):
        model, tokenizer = load_bf16(llama_dir)
        assert len(loader_warnings(caplog)) == 1
        load_bf16(llama_dir, prepack=False)
        assert len(loader_warnings(caplog)) == 2, "one warning per load, not one per process"
    message = loader_warnings(caplog)[0].getMessage()
    assert "bfloat16" in message and "float32" in message
    assert model.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert any(type(m) is PackedLinear for m in model.modules()), "float32 is pre-packed as usual"

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOADER_LOGGER):
        float32_model, _ = load_model(str(llama_dir), LoadOptions(dtype="float32", cache_dir=llama_dir / "cache"))
        auto_model, _ = load(llama_dir)
    assert loader_warnings(caplog) == [], "no warning where bfloat16 was not asked for"
    assert float32_model.dtype == auto_model.dtype == torch.float32

    monkeypatch.undo()
    reference, _ = load(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer, max_batch_tokens=64)
    workload = mixed_prompts(engine.vocab_size, count=8, seed=21)
    await assert_greedy_equals_generate(engine, reference, workload)


@native
def test_with_native_bf16_the_loader_loads_bf16_silently(llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOADER_LOGGER):
        model, _ = load_bf16(llama_dir)
        plain, _ = load_bf16(llama_dir, prepack=False)
    assert loader_warnings(caplog) == []
    assert model.dtype == plain.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert sum(type(m) is PackedLinear for m in model.modules()) > 0
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())


# ---------------------------------------------------------------------------------------------------------------
# The engine in bfloat16
# ---------------------------------------------------------------------------------------------------------------


def assert_full_answer(deltas: list[Any], request_id: str, n: int, prompt_length: int, vocab: int) -> None:
    tokens = tokens_of(deltas)
    assert len(tokens) == n, f"{request_id}: {len(tokens)} tokens of {n}"
    assert all(0 <= token < vocab for token in tokens), f"{request_id}: a token outside the vocabulary"
    assert all(d.request_id == request_id for d in deltas)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == Finish.LENGTH
    assert deltas[-1].prompt_tokens == prompt_length


@native
async def test_a_busy_bf16_engine_answers_every_request_in_full(tiny_model_dir: Path, make_engine: Any) -> None:
    """Many requests of mixed lengths (one to several pages, a few exactly on page edges), some joining a batch that
    is already decoding, chunked prefills beside decode rows: none lost, each exactly max_new_tokens long."""
    model, tokenizer = load_bf16(tiny_model_dir)
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer, max_batch_tokens=64)
    paths = engine.counters.paths
    assert paths["paged_decode"] == "compiled" and paths["decoder_layers"] == "lean"
    assert paths["few_rows"] == "compiled"
    vocab = engine.vocab_size
    rng = random.Random(17)
    workload = mixed_prompts(vocab, count=20, seed=13)
    workload += [([rng.randrange(3, vocab) for _ in range(length)], n) for length, n in ((16, 5), (32, 17), (250, 9))]
    first_wave, second_wave = workload[:12], workload[12:]
    tasks = [
        asyncio.ensure_future(
            collect(engine.submit(EngineRequest(f"r{i}", input_ids=ids, params=greedy(n, ignore_eos=True))))
        )
        for i, (ids, n) in enumerate(first_wave)
    ]
    await wait_until(lambda: engine.stats().decode_tokens > 0)  # the first wave is decoding
    for offset, (ids, n) in enumerate(second_wave):
        index = len(first_wave) + offset
        tasks.append(
            asyncio.ensure_future(
                collect(engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n, ignore_eos=True))))
            )
        )
    results = await asyncio.gather(*tasks)
    for index, ((ids, n), deltas) in enumerate(zip(workload, results, strict=True)):
        assert_full_answer(deltas, f"r{index}", n, len(ids), vocab)
    await wait_until(lambda: engine.stats().running == engine.stats().waiting == 0)
    stats = engine.stats()
    assert stats.kv_blocks_reserved == 0
    assert stats.requests_finished == {"length": len(workload)}


@native
async def test_lone_bf16_requests_start_with_generates_token(llama_dir: Path, make_engine: Any) -> None:
    """One at a time, prompts of 1 token to several pages: the first token always equals bfloat16 `generate`'s;
    the same request run twice gives the same tokens."""
    model, tokenizer = load_bf16(llama_dir)
    reference, _ = load_bf16(llama_dir)
    # no prefix sharing: a rerun computes its whole prompt again, as the first run did
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer, prefix_sharing=False)
    vocab = engine.vocab_size
    rng = random.Random(29)
    lengths = [1, 2, 5, 6, 7, 15, 16, 17, 31, 33, 64, 100, 300, 700]
    prompts = [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]
    identical = 0
    for index, ids in enumerate(prompts):
        deltas = await collect(engine.submit(EngineRequest(f"l{index}", input_ids=ids, params=greedy(12))))
        tokens = tokens_of(deltas)
        expected = reference_greedy(reference, ids, 12)
        assert tokens and tokens[0] == expected[0], f"prompt of {len(ids)} tokens: {tokens[:3]} vs {expected[:3]}"
        identical += tokens == expected
        if index % 4 == 0:
            again = await collect(engine.submit(EngineRequest(f"again{index}", input_ids=ids, params=greedy(12))))
            assert tokens_of(again) == tokens, f"prompt of {len(ids)} tokens: not deterministic"
    assert identical >= len(prompts) // 2, f"only {identical} of {len(prompts)} requests equal generate's"


@native
async def test_cancel_mid_stream_in_bf16_frees_the_cache(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load_bf16(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer)
    long = engine.submit(EngineRequest("long", input_ids=list(range(3, 40)), params=greedy(600, ignore_eos=True)))
    other = engine.submit(EngineRequest("other", input_ids=[6, 7, 8], params=greedy(25, ignore_eos=True)))
    first = await anext(long)
    assert first.token_ids and first.finish_reason is None
    await wait_until(lambda: engine.stats().kv_blocks_used > 0)
    assert engine.cancel("long")
    rest = await collect(long)
    assert rest[-1].finish_reason == Finish.CANCELLED
    assert len(tokens_of([first, *rest])) < 600
    assert_full_answer(await collect(other), "other", 25, 3, engine.vocab_size)
    await wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.idle)
    assert engine.stats().kv_blocks_reserved == 0
    assert not engine.cancel("long")
    after = await collect(engine.submit(EngineRequest("after", input_ids=[9, 10], params=greedy(7, ignore_eos=True))))
    assert_full_answer(after, "after", 7, 2, engine.vocab_size)


@native
async def test_a_bf16_model_without_prepack_is_served(tiny_model_dir: Path, make_engine: Any) -> None:
    """prepack=False: plain bfloat16 linears. Still served in full; the first token is `generate`'s."""
    model, tokenizer = load_bf16(tiny_model_dir, prepack=False)
    assert model.dtype == torch.bfloat16 and not any(isinstance(m, PackedLinear) for m in model.modules())
    reference, _ = load_bf16(tiny_model_dir, prepack=False)
    engine = await make_engine(tiny_model_dir, model=model, tokenizer=tokenizer)
    assert engine.counters.paths["paged_decode"] == "compiled"
    workload = mixed_prompts(engine.vocab_size, count=6, seed=31)
    for index, (ids, n) in enumerate(workload):
        request = EngineRequest(f"p{index}", input_ids=ids, params=greedy(n, ignore_eos=True))
        deltas = await collect(engine.submit(request))
        assert_full_answer(deltas, f"p{index}", n, len(ids), engine.vocab_size)
        with torch.no_grad():
            first = int(reference(torch.tensor([ids])).logits[0, -1].argmax())
        assert tokens_of(deltas)[0] == first, f"request {index}"
    streams = [
        engine.submit(EngineRequest(f"b{i}", input_ids=ids, params=greedy(n, ignore_eos=True)))
        for i, (ids, n) in enumerate(workload)
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for index, ((ids, n), deltas) in enumerate(zip(workload, results, strict=True)):
        assert_full_answer(deltas, f"b{index}", n, len(ids), engine.vocab_size)


async def test_float32_engine_still_equals_generate_bitwise(tiny_model_dir: Path, make_engine: Any) -> None:
    """Float32 unchanged by the bfloat16 work: batched greedy outputs are `generate`'s, every token."""
    reference, _ = load(tiny_model_dir)
    engine = await make_engine(tiny_model_dir, max_batch_tokens=64)
    assert "few_rows" not in engine.counters.paths
    workload = mixed_prompts(engine.vocab_size, count=10, seed=41)
    workload.append((list(range(3, 3 + 200)), 20))  # several pages
    await assert_greedy_equals_generate(engine, reference, workload)


@native
async def test_per_row_features_work_on_bf16_logits(llama_dir: Path, make_engine: Any) -> None:
    """Logprobs, prompt logprobs, seeded sampling and penalties next to plain greedy rows, in one bfloat16 batch:
    every request answered in full, log-probabilities finite and consistent with the tokens chosen."""
    model, tokenizer = load_bf16(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer, max_batch_tokens=64)
    vocab = engine.vocab_size
    workload = mixed_prompts(vocab, count=8, seed=51)
    kinds = [
        greedy(0, ignore_eos=True, logprobs=3),
        GenerationParams(temperature=0.9, top_p=0.95, seed=7, ignore_eos=True, logprobs=2),
        greedy(0, ignore_eos=True, prompt_logprobs=2),
        GenerationParams(temperature=1.1, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
    ]
    params = [replace(kinds[i % len(kinds)], max_new_tokens=n) for i, (_, n) in enumerate(workload)]
    streams = [
        engine.submit(EngineRequest(f"x{i}", input_ids=ids, params=p))
        for i, ((ids, _), p) in enumerate(zip(workload, params, strict=True))
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for index, ((ids, n), p, deltas) in enumerate(zip(workload, params, results, strict=True)):
        assert_full_answer(deltas, f"x{index}", n, len(ids), vocab)
        tokens = tokens_of(deltas)
        if p.logprobs is not None:
            logprobs = [entry for d in deltas for entry in (d.logprobs or [])]
            assert len(logprobs) == n, f"x{index}: {len(logprobs)} logprobs for {n} tokens"
            for token, entry in zip(tokens, logprobs, strict=True):
                assert math.isfinite(entry.logprob) and entry.logprob <= 1e-6
                assert len(entry.top) == p.logprobs
                values = [value for _, value in entry.top]
                assert values == sorted(values, reverse=True) and all(math.isfinite(v) for v in values)
                if p.greedy:  # the greedy token is a most likely one (ties allowed)
                    assert entry.logprob == pytest.approx(values[0], abs=1e-6), f"x{index}: token {token}"
        if p.prompt_logprobs is not None:
            scored = deltas[0].prompt
            assert scored is not None and scored.token_ids == ids and len(scored.logprobs) == len(ids)
            assert scored.logprobs[0] is None
            for entry in scored.logprobs[1:]:
                assert entry is not None and math.isfinite(entry.logprob) and entry.logprob <= 1e-6
                assert len(entry.top) == 2


@native
async def test_a_bf16_engine_without_the_few_row_kernel_falls_back_to_onednn(
    llama_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the few-row kernel cannot be built (`few_rows()` None), every product runs in oneDNN at its padded row
    count, the engine says so (`few_rows: fallback`) and still serves every request in full."""
    model, tokenizer = load_bf16(llama_dir)
    monkeypatch.setattr(cpu_kernels, "few_rows", lambda dtype=torch.bfloat16: None)
    layer = next(m for m in model.modules() if type(m) is PackedLinear)
    with torch.no_grad():
        x = torch.randn(3, layer.in_features).bfloat16()
        padded = functional.pad(x, (0, 0, 0, row_bucket(3) - 3))
        assert torch.equal(layer(x), functional.linear(padded, layer.weight, layer.bias)[:3])
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer, max_batch_tokens=64)
    assert engine.counters.paths["few_rows"] == "fallback"
    workload = mixed_prompts(engine.vocab_size, count=6, seed=61)
    streams = [
        engine.submit(EngineRequest(f"o{i}", input_ids=ids, params=greedy(n, ignore_eos=True)))
        for i, (ids, n) in enumerate(workload)
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for index, ((ids, n), deltas) in enumerate(zip(workload, results, strict=True)):
        assert_full_answer(deltas, f"o{index}", n, len(ids), engine.vocab_size)
