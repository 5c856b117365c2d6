"""Black-box tests of row buckets: every float32 CPU product is padded to one of a bounded set of row counts.

The claim under test: oneDNN keeps native state per input shape, so every product hands it `row_bucket(rows)` rows
(0 -> 0; the next power of two up to 16; beyond, the next multiple of an eighth of the largest power of two below
`rows`), at most 1/8 padding beyond 16 rows and 45 distinct counts for 1..512. Padding is invisible: outputs have
the caller's rows, are contiguous and equal the unpadded `F.linear` (2-D, 3-D, 0 or 5,000 rows, non-contiguous
views, with or without bias), and a row's output does not depend on the rows that share its product. The engine,
whatever the workload (many prompt lengths, staggered arrivals, budgets of 16 to 300 tokens, cancels, seeded
sampling, int8), hands oneDNN only counts in `{bucket(r) for r in 1..max_batch_tokens}`, and greedy outputs equal
`model.generate` on a model loaded without pre-packing (the library's own products, so no padded product of ours
stands on both sides of a comparison).

Every row count oneDNN sees is recorded by wrapping `worker.engine.prepack._linear_pointwise`, the one seam the
contract names. Expected buckets come from `expected_bucket`, written here from the contract (not `row_bucket`), and
from literal tables; the engine tests also record each step's own (unpadded) token count, and check the workload
really had counts outside the bucket set, so they would fail if padding were removed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional

from testing.tiny_models import save_tiny_model
from tests.engine.conftest import reference_greedy
from tests.engine.test_cpu_engine_blackbox import one_thread  # noqa: F401  (fixture: torch on one thread)
from worker.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    Finish,
    GenerationParams,
    LoadOptions,
    load_model,
    prepack,
)
from worker.engine.prepack import PackedLinear, StackedLinears, row_bucket
from worker.engine.quantize import Int8Linear

pytestmark = [
    pytest.mark.skipif(not prepack.available(), reason="needs torch with oneDNN"),
    pytest.mark.usefixtures("one_thread"),  # torch on one thread: benchmarks run beside the tests
]

FAST = settings(max_examples=40, deadline=None, database=None)
TENSORS = settings(max_examples=25, deadline=None, database=None)
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
IN_FEATURES = 64  # a multiple of 16, so `Int8Linear` takes it too
OUT_FEATURES = 48


def expected_bucket(rows: int) -> int:
    """The contract's bucket, written out plainly: no bit tricks shared with the code under test."""
    if rows <= 0:
        return 0
    if rows <= 16:
        power = 1
        while power < rows:
            power *= 2
        return power
    below = 16
    while below * 2 < rows:  # the largest power of two strictly below `rows`
        below *= 2
    step = below // 8
    return (rows + step - 1) // step * step


def expected_set(max_rows: int) -> set[int]:
    return {expected_bucket(rows) for rows in range(1, max_rows + 1)}


# The buckets a step of 1..37 rows may use, by hand: powers of two to 16, even counts to 32, then 36 and 40.
BUCKETS_UP_TO_37 = {1, 2, 4, 8, 16, 18, 20, 22, 24, 26, 28, 30, 32, 36, 40}


@contextmanager
def recording() -> Iterator[list[int]]:
    """The row count of every call to oneDNN's linear product, from any thread, while the block runs."""
    seen: list[int] = []
    original = prepack._linear_pointwise

    def record(*args: Any, **kwargs: Any) -> Any:
        seen.append(int(args[0].shape[0]))
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepack, "_linear_pointwise", record)
        yield seen


def check_calls(seen: list[int], rows: int) -> None:
    """The product of `rows` rows reached oneDNN, at its bucket only (none at all is also fine for 0 rows)."""
    if rows == 0:
        assert set(seen) <= {0}, seen
    else:
        assert seen and set(seen) == {expected_bucket(rows)}, (rows, seen)


def make_linear(bias: bool, seed: int, out_features: int = OUT_FEATURES) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(IN_FEATURES, out_features, bias=bias)


def make_input(rows: int, layout: str, seed: int) -> torch.Tensor:
    """`rows` rows of IN_FEATURES, in `layout`: a plain 2-D tensor, a 3-D one, or one of three non-contiguous
    views (a column slice of wider rows, every other row, a transpose)."""
    generator = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return torch.randn(rows, IN_FEATURES, generator=generator)
    if layout == "3d":  # rows split over two leading dimensions where it divides, else [1, rows, in]
        leading = (3, rows // 3) if rows % 3 == 0 and rows else (1, rows)
        return torch.randn(*leading, IN_FEATURES, generator=generator)
    if layout == "column_slice":
        return torch.randn(rows, IN_FEATURES + 9, generator=generator)[:, 5 : 5 + IN_FEATURES]
    if layout == "row_stride":
        return torch.randn(2 * rows, IN_FEATURES, generator=generator)[::2]
    if layout == "transposed":
        return torch.randn(IN_FEATURES, rows, generator=generator).t()
    raise ValueError(layout)


LAYOUTS = ["contiguous", "3d", "column_slice", "row_stride", "transposed"]


# ---------------------------------------------------------------------------------------------------- row_bucket


@pytest.mark.parametrize(
    ("rows", "bucket"),
    [
        (0, 0), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16),
        (17, 18), (18, 18), (19, 20), (32, 32), (33, 36), (64, 64), (65, 72), (100, 104),
        (128, 128), (129, 144), (300, 320), (512, 512), (513, 576), (5000, 5120),
    ],
)  # fmt: skip
def test_row_bucket_table(rows: int, bucket: int) -> None:
    assert row_bucket(rows) == bucket
    assert expected_bucket(rows) == bucket  # the reference used below agrees with the contract's examples


def test_first_sixteen_are_powers_of_two_and_45_counts_to_512() -> None:
    assert [row_bucket(rows) for rows in range(1, 17)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8
    assert len({row_bucket(rows) for rows in range(1, 513)}) == 45


def test_eight_buckets_per_doubling_beyond_16() -> None:
    for power in (2**k for k in range(4, 16)):
        buckets = {row_bucket(rows) for rows in range(power + 1, 2 * power + 1)}
        step = power // 8
        assert buckets == {power + step * i for i in range(1, 9)}, power


@pytest.mark.parametrize(
    ("max_rows", "size", "largest"), [(16, 5, 16), (37, 15, 40), (128, 29, 128), (300, 39, 320), (512, 45, 512)]
)
def test_bucket_sets_of_batch_budgets(max_rows: int, size: int, largest: int) -> None:
    buckets = {row_bucket(rows) for rows in range(1, max_rows + 1)}
    assert buckets == expected_set(max_rows)
    assert len(buckets) == size and max(buckets) == largest
    if max_rows == 37:
        assert buckets == BUCKETS_UP_TO_37


@FAST
@given(st.integers(min_value=0, max_value=10**12))
def test_bucket_properties(rows: int) -> None:
    bucket = row_bucket(rows)
    assert type(bucket) is int
    assert bucket == expected_bucket(rows)
    assert bucket >= rows
    if rows > 16:
        assert (bucket - rows) * 8 <= rows  # at most an eighth of the rows is padding
    assert row_bucket(bucket) == bucket  # idempotent: a bucket runs at itself


@FAST
@given(st.integers(min_value=0, max_value=10**7), st.integers(min_value=0, max_value=10**7))
def test_bucket_is_monotonic(a: int, b: int) -> None:
    low, high = sorted((a, b))
    assert row_bucket(low) <= row_bucket(high)


def test_monotonic_and_idempotent_over_every_count_to_4096() -> None:
    buckets = [row_bucket(rows) for rows in range(4097)]
    assert all(x <= y for x, y in itertools.pairwise(buckets))
    assert all(row_bucket(bucket) == bucket for bucket in set(buckets))


@pytest.mark.parametrize(
    ("rows", "bucket"), [(10**9, 1_006_632_960), (2**40, 2**40), (2**40 + 1, 2**40 + 2**37), (10**18, 14 * 2**56)]
)
def test_very_large_counts_stay_exact(rows: int, bucket: int) -> None:
    assert row_bucket(rows) == bucket
    assert (bucket - rows) * 8 <= rows


@FAST
@given(st.integers(min_value=-(10**12), max_value=-1))
def test_negative_counts_map_to_zero(rows: int) -> None:
    """Observed: a negative count is treated like 0 (no padding, no error). A ValueError would do as well; what
    must not happen is a negative or positive bucket, which would pad (or cut) a product."""
    try:
        bucket = row_bucket(rows)
    except ValueError:
        return
    assert bucket == 0


# ---------------------------------------------------------------------------------------------------- products


@TENSORS
@given(
    rows=st.one_of(st.integers(0, 40), st.integers(41, 700)),
    layout=st.sampled_from(LAYOUTS),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_linear_equals_unpadded_product(rows: int, layout: str, bias: bool, seed: int) -> None:
    linear = make_linear(bias, seed)
    packed = PackedLinear.wrap(linear)
    x = make_input(rows, layout, seed)
    with torch.no_grad(), recording() as seen:
        out = packed(x)
    reference = functional.linear(x, linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
    assert out.shape == (*x.shape[:-1], OUT_FEATURES)
    assert out.is_contiguous()
    torch.testing.assert_close(out, reference, **TOLERANCE)
    check_calls(seen, rows)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("layout", ["contiguous", "3d", "row_stride"])
def test_five_thousand_rows(layout: str, bias: bool) -> None:
    linear = make_linear(bias, seed=11)
    packed = PackedLinear.wrap(linear)
    x = make_input(5000, layout, seed=12)
    with torch.no_grad(), recording() as seen:
        out = packed(x)
        reference = functional.linear(x, linear.weight, linear.bias)
    assert out.shape == (*x.shape[:-1], OUT_FEATURES) and out.is_contiguous()
    torch.testing.assert_close(out, reference, **TOLERANCE)
    assert set(seen) == {5120}


@pytest.mark.parametrize("shape", [(0, IN_FEATURES), (0, 5, IN_FEATURES), (4, 0, IN_FEATURES)])
def test_zero_rows(shape: tuple[int, ...]) -> None:
    packed = PackedLinear.wrap(make_linear(True, seed=3))
    with torch.no_grad(), recording() as seen:
        out = packed(torch.empty(shape))
    assert out.shape == (*shape[:-1], OUT_FEATURES) and out.is_contiguous()
    assert set(seen) <= {0}


@TENSORS
@given(batch=st.integers(1, 300), data=st.data(), bias=st.booleans())
def test_a_row_does_not_depend_on_its_batch(batch: int, data: st.DataObject, bias: bool) -> None:
    index = data.draw(st.integers(0, batch - 1), label="index")
    linear = make_linear(bias, seed=batch)
    packed = PackedLinear.wrap(linear)
    x = make_input(batch, "contiguous", seed=batch + 1)
    with torch.no_grad(), recording() as seen:
        together = packed(x)
        alone = packed(x[index : index + 1])
    torch.testing.assert_close(alone[0], together[index], **TOLERANCE)
    assert seen == [expected_bucket(batch), 1]


@TENSORS
@given(
    rows=st.integers(0, 400),
    bias=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stacked_linears_equal_each_layers_product(rows: int, bias: bool, strided: bool, seed: int) -> None:
    """q/k/v-like widths (64, 16, 16) stacked into one product: side by side, each layer's own `F.linear`."""
    linears = [make_linear(bias, seed + i, width) for i, width in enumerate((64, 16, 16))]
    stacked = StackedLinears([PackedLinear.wrap(linear) for linear in linears])
    x = make_input(rows, "row_stride" if strided else "contiguous", seed)
    with torch.no_grad(), recording() as seen:
        out = stacked(x)
        reference = torch.cat([functional.linear(x, linear.weight, linear.bias) for linear in linears], dim=-1)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, reference, **TOLERANCE)
    check_calls(seen, rows)


@TENSORS
@given(rows=st.integers(0, 200), bias=st.booleans(), three_d=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_linear_is_int8_to_32_rows_then_padded_float32(rows: int, bias: bool, three_d: bool, seed: int) -> None:
    linear = make_linear(bias, seed)
    quantized = Int8Linear.wrap(linear)
    x = make_input(rows, "3d" if three_d else "contiguous", seed)
    with torch.no_grad(), recording() as seen:
        out = quantized(x)
        reference = functional.linear(x, linear.weight, linear.bias)
    assert out.shape == (*x.shape[:-1], OUT_FEATURES) and out.is_contiguous() and out.dtype == torch.float32
    if rows <= 32:
        assert seen == []  # the int8 kernel, not oneDNN
        torch.testing.assert_close(out, reference, rtol=0.02, atol=0.05)  # int8 weights, bfloat16 activations
    else:
        check_calls(seen, rows)
        torch.testing.assert_close(out, reference, **TOLERANCE)


def test_products_under_autograd_keep_their_rows() -> None:
    """With autograd on, the layer may fall back to the plain product; whatever path it takes, the output is the
    caller's rows, equal to `F.linear`, and anything handed to oneDNN is still a bucket."""
    linear = make_linear(True, seed=5)
    packed = PackedLinear.wrap(linear)
    x = make_input(37, "contiguous", seed=6).requires_grad_()
    with recording() as seen:
        out = packed(x)
    torch.testing.assert_close(out, functional.linear(x, linear.weight, linear.bias), **TOLERANCE)
    assert out.shape == (37, OUT_FEATURES)
    assert set(seen) <= {40}


# ---------------------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    saved: dict[str, Path] = {}

    def folder(arch: str) -> Path:
        if arch not in saved:
            saved[arch] = save_tiny_model(tmp_path_factory.mktemp(f"buckets-{arch}"), arch, max_positions=512)
        return saved[arch]

    return folder


@pytest.fixture(scope="module")
def references(folders: Callable[[str], Path]) -> Callable[[str, list[int], int], list[int]]:
    """`model.generate`'s greedy tokens on a model loaded without pre-packing, by (arch, prompt, tokens), cached."""
    models: dict[str, Any] = {}
    cache: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def reference(arch: str, ids: list[int], max_new_tokens: int) -> list[int]:
        if arch not in models:
            folder = folders(arch)
            models[arch], _ = load_model(str(folder), LoadOptions(cache_dir=folder / "cache", prepack=False))
        key = (arch, tuple(ids), max_new_tokens)
        if key not in cache:
            cache[key] = reference_greedy(models[arch], ids, max_new_tokens)
        return cache[key]

    return reference


@dataclass
class Served:
    """What an engine run handed oneDNN, the token count of each of its steps, and what each request got."""

    onednn_rows: list[int] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    greedy: list[tuple[list[int], int, list[int], Finish | None]] = field(default_factory=list)
    others: list[tuple[str, int, list[int], Finish | None]] = field(default_factory=list)


def vocab_of(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


def workload(vocab: int, seed: int, count: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens): prompts of `count` distinct lengths from 1 to 150; ids avoid the specials."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, *rng.sample(range(4, 151), count - 3)]
    rng.shuffle(lengths)
    return [([rng.randrange(3, vocab) for _ in range(length)], rng.randint(1, 14)) for length in lengths]


async def drain(stream: Any) -> tuple[list[int], Finish | None]:
    tokens: list[int] = []
    finish = None
    async for delta in stream:
        tokens.extend(delta.token_ids)
        finish = delta.finish_reason
    return tokens, finish


async def serve(folder: Path, quantize: str, max_batch_tokens: int, jobs: list[tuple[list[int], int]]) -> Served:
    """Runs `jobs` greedily with staggered arrivals, plus a request cancelled mid-stream and two seeded sampled
    ones, recording every oneDNN row count and every step's token count (the embedding's input)."""
    model, tokenizer = load_model(str(folder), LoadOptions(cache_dir=folder / "cache", quantize=quantize))
    served = Served()
    embedding = model.get_input_embeddings()
    embedding.register_forward_hook(lambda _module, inputs, _out: served.step_tokens.append(inputs[0].numel()))
    config = EngineConfig(kv_cache_tokens=8192, page_size=16, max_batch_tokens=max_batch_tokens)
    with recording() as seen:
        engine = await Engine(model, tokenizer, config).start()
        try:
            served.onednn_rows = seen
            await serve_on(engine, jobs, served)
        finally:
            await engine.close()
    return served


async def serve_on(engine: Engine, jobs: list[tuple[list[int], int]], served: Served) -> None:
    def greedy(n: int, **kwargs: Any) -> GenerationParams:
        return GenerationParams(max_new_tokens=n, temperature=0, **kwargs)

    long = engine.submit(EngineRequest("long", input_ids=[5, 6, 7, 8, 9], params=greedy(400, ignore_eos=True)))
    sampled = [
        engine.submit(
            EngineRequest(
                f"seeded{i}",
                input_ids=[10 + i] * (7 + 13 * i),
                params=GenerationParams(max_new_tokens=9, temperature=1.1, top_p=0.9, seed=7 + i, ignore_eos=True),
            )
        )
        for i in range(2)
    ]
    tasks = []
    for index, (ids, n) in enumerate(jobs):
        stream = engine.submit(EngineRequest(f"g{index}", input_ids=ids, params=greedy(n)))
        tasks.append(asyncio.ensure_future(drain(stream)))
        if index % 3 == 2:  # later requests join a batch already decoding
            await asyncio.sleep(0.01)
    first = await anext(long)
    assert engine.cancel("long")
    rest_tokens, rest_finish = await drain(long)
    served.others.append(("long", 400, list(first.token_ids) + rest_tokens, rest_finish))
    for i, stream in enumerate(sampled):
        served.others.append((f"seeded{i}", 9, *await drain(stream)))
    for (ids, n), (tokens, finish) in zip(jobs, await asyncio.gather(*tasks), strict=True):
        served.greedy.append((ids, n, tokens, finish))


def check_row_counts(served: Served, max_batch_tokens: int) -> None:
    allowed = expected_set(max_batch_tokens)
    observed = set(served.onednn_rows)
    assert observed, "the engine's products went through oneDNN"
    assert observed <= allowed, sorted(observed - allowed)
    assert max(observed) <= expected_bucket(max_batch_tokens)
    # The workload itself had step sizes outside the bucket set: unpadded, they would have reached oneDNN.
    assert set(served.step_tokens) - allowed, sorted(set(served.step_tokens))
    assert max(served.step_tokens) <= max_batch_tokens


def check_others(served: Served) -> None:
    (_, _, long_tokens, long_finish), *sampled = served.others
    assert long_finish == Finish.CANCELLED and 1 <= len(long_tokens) < 400
    for _, n, tokens, finish in sampled:
        assert len(tokens) == n and finish == Finish.LENGTH


@pytest.mark.parametrize(
    ("arch", "max_batch_tokens"),
    [("llama", 16), ("llama", 37), ("llama", 128), ("llama", 300), ("qwen2", 37), ("mistral", 128)],
)
async def test_engine_hands_onednn_only_buckets_and_matches_generate(
    folders: Callable[[str], Path], references: Callable[..., list[int]], arch: str, max_batch_tokens: int
) -> None:
    folder = folders(arch)
    jobs = workload(vocab_of(folder), seed=max_batch_tokens, count=14)
    served = await serve(folder, "none", max_batch_tokens, jobs)
    check_row_counts(served, max_batch_tokens)
    check_others(served)
    for ids, n, tokens, finish in served.greedy:
        assert tokens == references(arch, ids, n), (len(ids), n)
        assert finish in (Finish.EOS, Finish.LENGTH)


@pytest.mark.parametrize("max_batch_tokens", [37, 128])
async def test_int8_engine_hands_onednn_only_buckets(folders: Callable[[str], Path], max_batch_tokens: int) -> None:
    """int8 steps of more than 32 rows (and the float32 output head at every step) use the padded float32 path."""
    folder = folders("llama")
    jobs = workload(vocab_of(folder), seed=100 + max_batch_tokens, count=14)
    served = await serve(folder, "int8", max_batch_tokens, jobs)
    check_row_counts(served, max_batch_tokens)
    assert max(served.onednn_rows) > 32, "some steps took the float32 path"
    check_others(served)
    for _ids, n, tokens, finish in served.greedy:
        assert finish in (Finish.EOS, Finish.LENGTH)
        assert 1 <= len(tokens) <= n and (finish == Finish.EOS or len(tokens) == n)


async def test_long_workload_stays_in_the_hand_written_bucket_set(
    folders: Callable[[str], Path], references: Callable[..., list[int]]
) -> None:
    """Three waves of requests of many lengths through a 37-token budget: the row counts oneDNN ever meets are the
    15 written out by hand, whatever the steps' own token counts were."""
    folder = folders("llama")
    jobs = [job for wave in range(3) for job in workload(vocab_of(folder), seed=1000 + wave, count=12)]
    served = await serve(folder, "none", 37, jobs)
    assert set(served.onednn_rows) <= BUCKETS_UP_TO_37, sorted(set(served.onednn_rows) - BUCKETS_UP_TO_37)
    assert len(set(served.step_tokens) - BUCKETS_UP_TO_37) >= 3, sorted(set(served.step_tokens))
    # Each step's projections met its own bucket, not one padded-to-maximum shape. (How many distinct step sizes a
    # run has depends on how arrivals interleave with steps, so the check follows the steps the run really had.)
    assert {expected_bucket(tokens) for tokens in served.step_tokens} <= set(served.onednn_rows)
    check_others(served)
    for ids, n, tokens, _finish in served.greedy:
        assert tokens == references("llama", ids, n), (len(ids), n)
