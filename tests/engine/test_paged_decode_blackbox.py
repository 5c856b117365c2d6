"""Black-box tests of the native paged-decode kernel (`worker.engine.kernels.cpu_kernels`), from its contract only.

The contract: decode row i attends query row `query_rows[i]` over the cache rows `index[starts[i] : starts[i] +
lengths[i]]`; the result equals `scaled_dot_product_attention` on the gathered keys and values (grouped-query: query
head h reads KV head h // (heads // kv_heads)) within float32 tolerance; rows of `out` that are not decode rows are
left alone; invalid input raises ValueError.

The reference here is SDPA computed in float64 on the gathered rows and rounded to float32, so the kernel is held to
`torch.testing.assert_close`'s float32 defaults against an exact-as-possible answer.

The focus is the AVX-512 score path (head_dim a multiple of 16: 16 keys at a time, a transpose-and-add reduction, a
short last block that repeats its last key and stores only its own lanes under a mask) next to the older tiled path
(other head sizes). Whether this CPU has AVX-512 is read from /proc/cpuinfo (`HAS_AVX512`); every test is valid on a
CPU without it (both head-size families then take the tiled path), and only the one known AVX-512-only crash is
expected to fail conditionally on it. The machine they were written on lists avx512f (and bw, cd, dq, vl, ifma,
vbmi) in /proc/cpuinfo, so there both paths ran.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn import functional

from tests.engine.cpu_engine_support import Step
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import DecodeRows, PagedDecode


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


HAS_AVX512 = "avx512f" in _cpu_flags()
REPO = Path(__file__).resolve().parents[2]

# head sizes that take the 16-keys-at-a-time path on an AVX-512 CPU, and sizes that never do
BLOCKED_HEAD_DIMS = [16, 32, 48, 64, 80, 96, 112, 128, 256]
TILED_HEAD_DIMS = [1, 3, 8, 24, 40, 72, 100]


@pytest.fixture(scope="module")
def kernel() -> PagedDecode:
    built = cpu_kernels.load()
    assert built is not None, "the kernel must build on this machine (it has a C compiler)"
    assert isinstance(built, PagedDecode)
    return built


@pytest.fixture
def threads() -> Iterator[None]:
    """Restores torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def build_step(
    lengths: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    seed: int,
    page_size: int = 16,
    extra_tokens: int = 3,
    spare_cache_rows: int = 40,
    query_scale: float = 1.0,
    gap: int = 2,
) -> Step:
    """Requests whose keys lie in pages scattered over the cache (pages shuffled, rows within a page in order, the
    index spans laid out in a shuffled order with unused entries between them), in a step whose query rows are
    shuffled and include `extra_tokens` rows that are not decode rows."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-length // page_size) for length in lengths)
    cache_rows = pages_needed * page_size + spare_cache_rows
    keys = torch.randn(cache_rows, kv_heads, head_dim, generator=generator)
    values = torch.randn(cache_rows, kv_heads, head_dim, generator=generator)
    pages = list(range(cache_rows // page_size))
    rng.shuffle(pages)
    reads = []
    for length in lengths:
        count = -(-length // page_size)
        mine, pages = pages[:count], pages[count:]
        rows = [page * page_size + offset for page in mine for offset in range(page_size)]
        reads.append(torch.tensor(rows[:length], dtype=torch.int64))
    # lay the spans out in the index in a shuffled order, with junk (but valid) entries between them
    order = list(range(len(lengths)))
    rng.shuffle(order)
    index: list[int] = [rng.randrange(cache_rows) for _ in range(gap)]
    starts = [0] * len(lengths)
    for i in order:
        starts[i] = len(index)
        index.extend(reads[i].tolist())
        index.extend(rng.randrange(cache_rows) for _ in range(gap))
    tokens = len(lengths) + extra_tokens
    query_rows = rng.sample(range(tokens), len(lengths))
    query = torch.randn(tokens, heads, head_dim, generator=generator) * query_scale
    rows = DecodeRows(
        torch.tensor(query_rows, dtype=torch.int64),
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64),
        torch.tensor(index, dtype=torch.int64),
    )
    return Step(query, keys, values, rows, reads)


def attention(query_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA in float64 for one decode row: `query_row` [heads, d], `keys`/`values` [length, kv_heads, d] (gathered)."""
    return functional.scaled_dot_product_attention(
        query_row.double().unsqueeze(1),
        keys.double().transpose(0, 1),
        values.double().transpose(0, 1),
        scale=scale,
        enable_gqa=True,
    )[:, 0].float()


def expected_of(step: Step, scale: float) -> dict[int, torch.Tensor]:
    return {
        row: attention(step.query[row], step.keys[read], step.values[read], scale)
        for row, read in zip(step.query_rows, step.reads, strict=True)
    }


def run_and_check(
    kernel: PagedDecode, step: Step, scale: float | None = None, sentinel: float = 1234.5
) -> torch.Tensor:
    """Runs the kernel into an `out` full of `sentinel`, checks every decode row against SDPA and every other row is
    still the sentinel, and returns `out`."""
    head_dim = step.query.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.full_like(step.query, sentinel)
    kernel(step.query, step.keys, step.values, step.rows, scale, out)
    for row, expected in expected_of(step, scale).items():
        torch.testing.assert_close(out[row], expected, msg=lambda m, row=row: f"decode row {row}: {m}")
    others = sorted(set(range(step.query.shape[0])) - set(step.query_rows))
    untouched = torch.full_like(out[others], sentinel)
    assert torch.equal(out[others].view(torch.int32), untouched.view(torch.int32)), "a non-decode row was written"
    return out


def single(
    query_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read: list[int]
) -> tuple[torch.Tensor, DecodeRows]:
    """A one-token step for one decode row over cache rows `read`."""
    rows = DecodeRows(
        torch.tensor([0]), torch.tensor([0]), torch.tensor([len(read)]), torch.tensor(read, dtype=torch.int64)
    )
    return query_row.unsqueeze(0).contiguous(), rows


# --- it builds -----------------------------------------------------------------------------------------------------


def test_the_kernel_builds_here(kernel: PagedDecode) -> None:
    """A C compiler is on this machine, so `load()` builds and returns the kernel, the same object every time.
    (Where HAS_AVX512, i.e. /proc/cpuinfo lists avx512f, as on the machine these tests were written on, head sizes
    that are multiples of 16 take the 16-keys-at-a-time path.)"""
    assert cpu_kernels.load() is kernel
    assert callable(kernel)


# --- lengths: every short length and the 16-key block edges ---------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 48, 8, 40, 100])
def test_every_length_from_1_to_40_in_one_step(kernel: PagedDecode, head_dim: int) -> None:
    """40 decode rows of lengths 1..40 (every remainder of a 16-key block, full blocks, two blocks plus a tail), GQA
    with 4 heads per KV head so a spilled short-block store would land on the next head's scores."""
    step = build_step(list(range(1, 41)), heads=8, kv_heads=2, head_dim=head_dim, seed=head_dim)
    run_and_check(kernel, step)


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 24, 72])
def test_lengths_around_block_edges(kernel: PagedDecode, head_dim: int) -> None:
    lengths = [15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513]
    step = build_step(lengths, heads=6, kv_heads=3, head_dim=head_dim, seed=1000 + head_dim)
    run_and_check(kernel, step)


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 33])
@pytest.mark.parametrize("heads", [1, 3, 16])
def test_a_single_decode_row(kernel: PagedDecode, length: int, heads: int) -> None:
    """One decode row (the kernel runs it without sharing out work), one query head up to 16, one KV head."""
    step = build_step([length], heads=heads, kv_heads=1, head_dim=64, seed=length * 31 + heads, extra_tokens=0)
    run_and_check(kernel, step)


# --- head sizes and groups ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [*BLOCKED_HEAD_DIMS, 160, 272, 512, *TILED_HEAD_DIMS, 17, 300])
def test_head_sizes(kernel: PagedDecode, head_dim: int) -> None:
    """Multiples of 16 (the blocked path where AVX-512 is), others (the tiled path), and sizes past the 256-wide
    value tile."""
    step = build_step([1, 5, 16, 23, 48, 70, 200], heads=6, kv_heads=2, head_dim=head_dim, seed=head_dim + 7)
    run_and_check(kernel, step)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("kv_heads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [48, 64, 40])
def test_group_sizes(kernel: PagedDecode, group: int, kv_heads: int, head_dim: int) -> None:
    """Every group size 1..8 (1 is MHA) over 1-3 KV heads: query head h must read KV head h // group, including
    groups that do not fit a whole number of 4-head tiles. KV heads differ strongly, so reading the wrong one shows."""
    heads = group * kv_heads
    step = build_step([3, 17, 40, 100], heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=group * 10 + kv_heads)
    for kv in range(kv_heads):  # make each KV head's keys and values unmistakable
        step.keys[:, kv] += 0.5 * (kv + 1)
        step.values[:, kv] += 3.0 * (kv + 1)
    run_and_check(kernel, step)


def test_mha_with_many_heads(kernel: PagedDecode) -> None:
    step = build_step([1, 16, 29, 64, 90], heads=32, kv_heads=32, head_dim=64, seed=77)
    run_and_check(kernel, step)


# --- many rows, long contexts, threads ------------------------------------------------------------------------------


def test_many_decode_rows_shared_out_among_threads(kernel: PagedDecode, threads: None) -> None:
    torch.set_num_threads(max(2, torch.get_num_threads()))
    rng = random.Random(5)
    lengths = [rng.randint(1, 300) for _ in range(96)]
    step = build_step(lengths, heads=9, kv_heads=3, head_dim=64, seed=5, extra_tokens=10)
    run_and_check(kernel, step)


@pytest.mark.parametrize(("head_dim", "lengths"), [(64, [4096, 5003]), (128, [4113, 1]), (40, [4097, 33])])
def test_long_contexts(kernel: PagedDecode, head_dim: int, lengths: list[int]) -> None:
    step = build_step(lengths, heads=4, kv_heads=1, head_dim=head_dim, seed=head_dim, page_size=64)
    run_and_check(kernel, step)


def test_thread_count_does_not_change_the_result(kernel: PagedDecode, threads: None) -> None:
    rng = random.Random(9)
    lengths = [rng.randint(1, 200) for _ in range(40)]
    step = build_step(lengths, heads=8, kv_heads=2, head_dim=64, seed=9)
    outs = []
    for count in (1, 2):
        torch.set_num_threads(count)
        outs.append(run_and_check(kernel, step))
    torch.testing.assert_close(outs[0], outs[1])


def test_the_same_call_twice_gives_the_same_bits(kernel: PagedDecode) -> None:
    """And the result does not depend on what `out` held before (two different sentinels)."""
    rng = random.Random(11)
    step = build_step([rng.randint(1, 150) for _ in range(24)], heads=6, kv_heads=2, head_dim=48, seed=11)
    first = run_and_check(kernel, step, sentinel=0.0)
    second = run_and_check(kernel, step, sentinel=float("nan"))
    decode = step.query_rows
    assert torch.equal(first[decode], second[decode])


# --- where the keys lie ---------------------------------------------------------------------------------------------


def test_index_entries_in_any_order_and_pages_shared(kernel: PagedDecode) -> None:
    """Spans whose entries are in no order, that read the same cache row twice (within one request, and across
    requests sharing a prefix), that overlap one another in the index, laid out in the index in reverse order."""
    rng = random.Random(3)
    torch.manual_seed(3)
    heads, kv_heads, head_dim, cache_rows = 8, 2, 64, 300
    keys, values = torch.randn(cache_rows, kv_heads, head_dim), torch.randn(cache_rows, kv_heads, head_dim)
    shared = rng.sample(range(cache_rows), 37)  # a prefix two requests share
    reads = [
        shared + rng.sample(range(cache_rows), 12),
        shared + rng.sample(range(cache_rows), 3),
        [rng.randrange(cache_rows) for _ in range(50)],  # duplicates within one request, any order
        [7] * 19,  # one cache row, 19 times
    ]
    rng.shuffle(reads[0])
    index: list[int] = []
    starts = [0] * 5
    for i in reversed(range(4)):
        starts[i] = len(index)
        index.extend(reads[i])
    # a fifth request whose span is the tail of request 0's span and the head of the next one in the index
    starts[4] = starts[0] + 20
    reads.append(index[starts[4] : starts[4] + 45])
    lengths = [len(read) for read in reads]
    assert starts[4] + lengths[4] <= len(index)
    query_rows = [4, 0, 2, 5, 1]
    query = torch.randn(7, heads, head_dim)
    rows = DecodeRows(torch.tensor(query_rows), torch.tensor(starts), torch.tensor(lengths), torch.tensor(index))
    step = Step(query, keys, values, rows, [torch.tensor(read) for read in reads])
    run_and_check(kernel, step)


def test_keys_and_values_of_different_row_counts_and_one_tensor_for_both(kernel: PagedDecode) -> None:
    step = build_step([5, 17, 33], heads=4, kv_heads=2, head_dim=32, seed=21)
    bigger_values = torch.cat([step.values, torch.randn(50, 2, 32)])
    run_and_check(kernel, Step(step.query, step.keys, bigger_values, step.rows, step.reads))
    run_and_check(kernel, Step(step.query, step.keys, step.keys, step.rows, step.reads))


def test_decode_rows_from_strided_tensors(kernel: PagedDecode) -> None:
    """DecodeRows built from non-contiguous views reads them as their values, not their storage."""
    step = build_step([3, 18, 40], heads=4, kv_heads=1, head_dim=16, seed=8)
    r = step.rows
    spread = [torch.stack([t, torch.full_like(t, 10**9)], dim=1)[:, 0] for t in (r.query_rows, r.starts, r.lengths)]
    index = torch.stack([r.index, torch.full_like(r.index, 10**9)], dim=1)[:, 0]
    assert not index.is_contiguous()
    rows = DecodeRows(*spread, index)
    run_and_check(kernel, Step(step.query, step.keys, step.values, rows, step.reads))


def test_nothing_outside_the_spans_is_read(kernel: PagedDecode) -> None:
    """NaN in every cache row that no span reads (those the junk index entries between spans point at included) and
    in every query row that is not a decode row: the decode rows stay finite and right."""
    step = build_step([*range(1, 36), 64, 65, 100], heads=8, kv_heads=2, head_dim=64, seed=13, extra_tokens=6)
    used = torch.zeros(step.keys.shape[0], dtype=torch.bool)
    for read in step.reads:
        used[read] = True
    step.keys[~used] = float("nan")
    step.values[~used] = float("nan")
    others = sorted(set(range(step.query.shape[0])) - set(step.query_rows))
    step.query[others] = float("nan")
    out = run_and_check(kernel, step)
    assert bool(torch.isfinite(out[step.query_rows]).all())


@pytest.mark.parametrize("head_dim", [16, 64, 24])
def test_no_decode_rows_leaves_out_alone(kernel: PagedDecode, head_dim: int) -> None:
    query = torch.randn(4, 2, head_dim)
    keys = torch.randn(10, 1, head_dim)
    empty = torch.zeros(0, dtype=torch.int64)
    out = torch.full_like(query, -7.0)
    kernel(query, keys, keys, DecodeRows(empty, empty, empty, empty), 1.0, out)
    assert bool((out == -7.0).all())


def test_out_as_a_view_inside_a_bigger_buffer(kernel: PagedDecode) -> None:
    """`out` is a contiguous slice of a bigger tensor, the first and last decode rows at its very ends: nothing before
    or after it changes, nor any row of it that is not a decode row."""
    heads, kv_heads, head_dim, tokens = 4, 2, 48, 6
    torch.manual_seed(17)
    keys, values = torch.randn(100, kv_heads, head_dim), torch.randn(100, kv_heads, head_dim)
    query = torch.randn(tokens, heads, head_dim)
    query_rows = [0, tokens - 1, 2]
    reads = [list(range(0, 17)), list(range(99, 60, -1)), [5]]
    index = [row for read in reads for row in read]
    starts = [0, 17, 17 + 39]
    rows = DecodeRows(torch.tensor(query_rows), torch.tensor(starts), torch.tensor([17, 39, 1]), torch.tensor(index))
    big = torch.full((tokens + 4, heads, head_dim), -99.0)
    out = big[2 : 2 + tokens]
    assert out.is_contiguous() and out.data_ptr() != big.data_ptr()
    kernel(query, keys, values, rows, head_dim**-0.5, out)
    assert bool((big[:2] == -99.0).all()) and bool((big[2 + tokens :] == -99.0).all())
    assert bool((out[[1, 3, 4]] == -99.0).all())
    for row, read in zip(query_rows, reads, strict=True):
        torch.testing.assert_close(out[row], attention(query[row], keys[read], values[read], head_dim**-0.5))


# --- scores: scales and extremes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.01, 0.3, 2.5, -0.7, 1e-6, 0.0])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_scales_other_than_one_over_root_d(kernel: PagedDecode, scale: float, head_dim: int) -> None:
    step = build_step([1, 7, 16, 19, 45, 130], heads=6, kv_heads=3, head_dim=head_dim, seed=int(abs(scale) * 100))
    run_and_check(kernel, step, scale=scale)


def integer_step(lengths: list[int], heads: int, kv_heads: int, head_dim: int, seed: int) -> Step:
    """A scattered step whose queries and keys hold small integers, so every score is an exactly representable
    integer whatever the order of the sums: large scores then test the softmax, not float32's rounding of them."""
    step = build_step(lengths, heads, kv_heads, head_dim, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    step.query[:] = torch.randint(-3, 4, step.query.shape, generator=generator).float()
    step.keys[:] = torch.randint(-3, 4, step.keys.shape, generator=generator).float()
    return step


@pytest.mark.parametrize("head_dim", [16, 64, 128, 40])
def test_one_hot_softmax_returns_the_winning_value(kernel: PagedDecode, head_dim: int) -> None:
    """Exact integer scores times a scale of 64: each head's softmax is one-hot (or an even split between tied best
    keys), so the output is the best key's value (the tied keys' mean), whichever lane of a 16-key block it is in."""
    step = integer_step([*range(1, 41), 100], heads=4, kv_heads=2, head_dim=head_dim, seed=head_dim)
    out = run_and_check(kernel, step, scale=64.0)
    for row, read in zip(step.query_rows, step.reads, strict=True):
        for h in range(4):
            scores = step.keys[read, h // 2] @ step.query[row, h]
            best = [cache_row for cache_row, score in zip(read, scores.tolist(), strict=True) if score == scores.max()]
            winner = step.values[best, h // 2].double().mean(0).float()
            torch.testing.assert_close(out[row, h], winner)


@pytest.mark.parametrize("head_dim", [16, 64, 24])
def test_all_equal_scores_average_the_values(kernel: PagedDecode, head_dim: int) -> None:
    """Identical keys (every score equal, including a short block's repeated lanes): the output is the plain mean of
    the values, each key counted exactly once."""
    lengths = [*range(1, 40), 100]
    step = build_step(lengths, heads=4, kv_heads=1, head_dim=head_dim, seed=head_dim)
    step.keys[:] = torch.randn(head_dim)
    out = run_and_check(kernel, step)
    for row, read in zip(step.query_rows, step.reads, strict=True):
        mean = step.values[read, 0].double().mean(0).float()
        torch.testing.assert_close(out[row], mean.expand(4, head_dim))


@pytest.mark.parametrize("head_dim", [32, 64, 72])
def test_large_negative_and_wide_spread_scores(kernel: PagedDecode, head_dim: int) -> None:
    """Exact integer scores all far below zero (about -1000 * |q|^2: the maximum must be subtracted first, or every
    exponential underflows), and scores spread over thousands between keys."""
    step = integer_step([2, 17, 33, 80], heads=4, kv_heads=2, head_dim=head_dim, seed=head_dim)
    generator = torch.Generator().manual_seed(head_dim)
    direction = torch.randint(-2, 3, (head_dim,), generator=generator).float()
    direction[0] = 1.0
    step.query[:] = direction
    noise = torch.randint(-1, 2, step.keys.shape, generator=generator).float()
    step.keys[:] = -40.0 * direction + noise
    run_and_check(kernel, step, scale=1.0)
    run_and_check(kernel, step, scale=0.5)
    spread = torch.arange(step.keys.shape[0]) % 41 - 20  # -20 .. 20 times |direction|^2, in any order
    step.keys[:] = direction * spread.float().view(-1, 1, 1)
    run_and_check(kernel, step, scale=1.0)
    run_and_check(kernel, step, scale=0.0625)


def _last_key_wins(
    length: int, heads: int, head_dim: int, seed: int, margin: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """One request of `length` keys over one KV head where the last key scores `margin` above every other (which
    all score about 0) for every query head."""
    generator = torch.Generator().manual_seed(seed)
    cache_rows = length + 20
    read = torch.randperm(cache_rows, generator=generator)[:length].tolist()
    direction = torch.randn(head_dim, generator=generator)
    direction /= direction.norm()
    keys = torch.randn(cache_rows, 1, head_dim, generator=generator) * 0.01
    keys -= (keys @ direction).unsqueeze(-1) * direction  # other keys orthogonal to the query: score 0
    keys[read[-1], 0] = direction * margin
    values = torch.randn(cache_rows, 1, head_dim, generator=generator)
    values[read[-1], 0] = 5.0  # the winning value is far from the others
    query = direction.expand(heads, head_dim).clone()
    return query, keys, values, read


@pytest.mark.parametrize("head_dim", [16, 64, 128, 24])
@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 13, 15, 17, 18, 24, 30, 31, 33, 39, 47, 63, 65, 77, 100, 129])
def test_a_short_blocks_repeated_last_key_is_counted_once(kernel: PagedDecode, length: int, head_dim: int) -> None:
    """The last key of a short block is the maximum and carries a distinct value. Were the padding lanes (which
    repeat it) counted in the softmax, its weight would grow from e^m / (e^m + n - 1) to k e^m / (k e^m + n - 1):
    checked here to move the answer by far more than the tolerance, and the kernel must give the once-counted one.
    Several query heads, so a store spilling past a head's row would corrupt the next head's first scores."""
    heads = 4
    margin = math.log(max(length - 1, 1))  # the winning key weighs about one half
    query, keys, values, read = _last_key_wins(length, heads, head_dim, seed=length * 1000 + head_dim, margin=margin)
    query_row, rows = single(query, keys, values, read)
    out = torch.full_like(query_row, float("nan"))
    kernel(query_row, keys, values, rows, 1.0, out)
    expected = attention(query, keys[read], values[read], 1.0)
    torch.testing.assert_close(out[0], expected)
    padded = -(-length // 16) * 16
    if 1 < length < padded:  # the answer had the repeated key been counted: it must be clearly different
        repeated = read + [read[-1]] * (padded - length)
        wrong = attention(query, keys[repeated], values[repeated], 1.0)
        assert float((wrong - expected).abs().max()) > 1e-2


@pytest.mark.parametrize("position", [0, 1, 14, 15, 16, 17, 31, 32])
@pytest.mark.parametrize("head_dim", [32, 40])
def test_the_winning_key_in_every_lane(kernel: PagedDecode, position: int, head_dim: int) -> None:
    """One key far above the rest at each lane of a block (and across the block edge): its value comes out, so the
    transpose-and-add reduction puts every key's score in its own lane."""
    length, heads = 35, 3
    query, keys, values, read = _last_key_wins(length, heads, head_dim, seed=position, margin=60.0)
    read[position], read[-1] = read[-1], read[position]  # move the winner to `position`
    query_row, rows = single(query, keys, values, read)
    out = torch.empty_like(query_row)
    kernel(query_row, keys, values, rows, 1.0, out)
    torch.testing.assert_close(out[0], attention(query, keys[read], values[read], 1.0))
    torch.testing.assert_close(out[0], torch.full((heads, head_dim), 5.0))


def test_distinct_scores_per_lane_and_head(kernel: PagedDecode) -> None:
    """Keys that are scaled unit vectors e_t (score of key t for head h = query[h, t] * c_t): every lane of every
    block a different score, every head a different permutation, so a lane or head mix-up cannot cancel out."""
    head_dim, heads, length = 64, 4, 50
    keys = torch.zeros(length, 1, head_dim)
    for t in range(length):
        keys[t, 0, t] = 1.0 + t / 10
    values = torch.randn(length, 1, head_dim, generator=torch.Generator().manual_seed(1))
    query = torch.stack(
        [torch.randperm(head_dim, generator=torch.Generator().manual_seed(h)).float() / 20 for h in range(heads)]
    )
    read = list(range(length))
    query_row, rows = single(query, keys, values, read)
    out = torch.empty_like(query_row)
    kernel(query_row, keys, values, rows, 1.0, out)
    torch.testing.assert_close(out[0], attention(query, keys, values, 1.0))


# --- property: random shapes ----------------------------------------------------------------------------------------


@st.composite
def step_shapes(draw: st.DrawFn) -> tuple[list[int], int, int, int, int, int, float]:
    """lengths, heads, kv_heads, head_dim, seed, page size, scale: only parameters (the tensors are made in the test,
    so that drawing stays fast). Scales stay within 2 / sqrt(head_dim): random keys' scores beyond that are so
    large that float32's rounding of them alone approaches the tolerance."""
    kv_heads = draw(st.integers(1, 4))
    group = draw(st.integers(1, 6))
    head_dim = draw(st.sampled_from([*BLOCKED_HEAD_DIMS, *TILED_HEAD_DIMS, 5, 33, 144]))
    lengths = draw(st.lists(st.integers(1, 150), min_size=1, max_size=12))
    scale = draw(st.sampled_from([1.0, 2.0, 0.1, -0.5, 0.0])) * head_dim**-0.5
    seed = draw(st.integers(0, 2**16))
    page_size = draw(st.sampled_from([1, 4, 16, 32]))
    return lengths, kv_heads * group, kv_heads, head_dim, seed, page_size, scale


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(shape=step_shapes())
def test_random_steps_match_sdpa(kernel: PagedDecode, shape: tuple[list[int], int, int, int, int, int, float]) -> None:
    lengths, heads, kv_heads, head_dim, seed, page_size, scale = shape
    step = build_step(lengths, heads, kv_heads, head_dim, seed=seed, page_size=page_size, gap=seed % 4)
    run_and_check(kernel, step, scale=scale)


# --- refusals -------------------------------------------------------------------------------------------------------


def _valid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeRows, torch.Tensor]:
    query = torch.randn(3, 4, 16)
    keys, values = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    rows = DecodeRows(torch.tensor([0, 2]), torch.tensor([0, 3]), torch.tensor([3, 4]), torch.arange(7))
    return query, keys, values, rows, torch.full_like(query, 8.0)


def test_the_valid_baseline_call_works(kernel: PagedDecode) -> None:
    query, keys, values, rows, out = _valid()
    kernel(query, keys, values, rows, 0.25, out)
    torch.testing.assert_close(out[2], attention(query[2], keys[3:7], values[3:7], 0.25))
    assert bool((out[1] == 8.0).all())


REFUSED_CALLS = {
    "float64-query": lambda q, k, v, r, o: (q.double(), k, v, r, o),
    "float16-keys": lambda q, k, v, r, o: (q, k.half(), v, r, o),
    "bfloat16-values": lambda q, k, v, r, o: (q, k, v.bfloat16(), r, o),
    "float64-out": lambda q, k, v, r, o: (q, k, v, r, o.double()),
    "strided-query": lambda q, k, v, r, o: (torch.randn(3, 16, 4).transpose(1, 2), k, v, r, o),
    "strided-keys": lambda q, k, v, r, o: (q, torch.randn(10, 16, 2).transpose(1, 2), v, r, o),
    "strided-out": lambda q, k, v, r, o: (q, k, v, r, torch.full((3, 16, 4), 8.0).transpose(1, 2)),
    "2d-query": lambda q, k, v, r, o: (q.reshape(3, 64), k, v, r, o.reshape(3, 64)),
    "2d-keys": lambda q, k, v, r, o: (q, k.reshape(10, 32), v.reshape(10, 32), r, o),
    "values-other-head-dim": lambda q, k, v, r, o: (q, k, torch.randn(10, 2, 8), r, o),
    "values-other-kv-heads": lambda q, k, v, r, o: (q, k, torch.randn(10, 4, 16), r, o),
    "out-other-shape": lambda q, k, v, r, o: (q, k, v, r, torch.full((4, 4, 16), 8.0)),
    "heads-not-a-multiple-of-kv-heads": lambda q, k, v, r, o: (
        torch.randn(3, 3, 16),
        k,
        v,
        r,
        torch.full((3, 3, 16), 8.0),
    ),
    "query-other-head-dim": lambda q, k, v, r, o: (torch.randn(3, 4, 32), k, v, r, torch.full((3, 4, 32), 8.0)),
    "query-row-past-tokens": lambda q, k, v, r, o: (q[:2].contiguous(), k, v, r, o[:2].contiguous()),
    "index-past-keys": lambda q, k, v, r, o: (q, k[:6].contiguous(), v, r, o),
    "index-past-values": lambda q, k, v, r, o: (q, k, v[:6].contiguous(), r, o),
}


@pytest.mark.parametrize("case", list(REFUSED_CALLS))
def test_invalid_calls_raise_value_error_and_write_nothing(kernel: PagedDecode, case: str) -> None:
    query, keys, values, rows, out = REFUSED_CALLS[case](*_valid())
    before = out.clone()
    with pytest.raises(ValueError):
        kernel(query, keys, values, rows, 1.0, out)
    assert torch.equal(out, before)


def test_zero_kv_heads_is_a_value_error(kernel: PagedDecode) -> None:
    rows = DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), torch.tensor([0, 1]))
    query, keys = torch.zeros(1, 0, 16), torch.zeros(4, 0, 16)
    with pytest.raises(ValueError):
        kernel(query, keys, keys, rows, 1.0, torch.zeros_like(query))


def test_zero_head_dim_is_refused_without_crashing_the_process() -> None:
    """Run in a child process, since the failure was a crash (the AVX-512 path read 16 floats of an empty query)."""
    script = textwrap.dedent(
        """
        import torch
        from worker.engine.kernels.cpu_kernels import DecodeRows, load
        kernel = load()
        assert kernel is not None
        rows = DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([3]), torch.tensor([0, 1, 2]))
        query, keys = torch.zeros(1, 4, 0), torch.zeros(4, 2, 0)
        try:
            kernel(query, keys, keys.clone(), rows, 1.0, torch.empty_like(query))
        except ValueError:
            print("refused")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "refused" in done.stdout, f"rc {done.returncode}: {done.stderr[-2000:]}"


REFUSED_ROWS = {
    "int32-query-rows": lambda: DecodeRows(torch.tensor([0], dtype=torch.int32), *_rows_rest()),
    "float-index": lambda: DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), torch.tensor([0.0, 1])),
    "2d-starts": lambda: DecodeRows(torch.tensor([0]), torch.tensor([[0]]), torch.tensor([2]), torch.arange(4)),
    "0d-lengths": lambda: DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor(2), torch.arange(4)),
    "fewer-starts": lambda: DecodeRows(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([2, 2]), torch.arange(4)),
    "more-lengths": lambda: DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([2, 2]), torch.arange(4)),
    "zero-length": lambda: DecodeRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.arange(4)),
    "negative-length": lambda: DecodeRows(torch.tensor([0]), torch.tensor([2]), torch.tensor([-1]), torch.arange(4)),
    "negative-start": lambda: DecodeRows(torch.tensor([0]), torch.tensor([-1]), torch.tensor([2]), torch.arange(4)),
    "span-past-index": lambda: DecodeRows(torch.tensor([0]), torch.tensor([3]), torch.tensor([2]), torch.arange(4)),
    "negative-query-row": lambda: DecodeRows(torch.tensor([-1]), torch.tensor([0]), torch.tensor([2]), torch.arange(4)),
    "negative-cache-row": lambda: DecodeRows(
        torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), torch.tensor([0, -3])
    ),
}


def _rows_rest() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor([0]), torch.tensor([2]), torch.arange(4)


@pytest.mark.parametrize("case", list(REFUSED_ROWS))
def test_invalid_decode_rows_raise_value_error(case: str) -> None:
    with pytest.raises(ValueError):
        REFUSED_ROWS[case]()
