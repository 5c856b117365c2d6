"""Black-box tests of the CPU engine's paged-decode kernel, its lean decoder layers, and the engine built on them:
hostile kernel inputs against SDPA on the gathered keys, and hostile workloads against `model.generate`."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from testing.tiny_models import save_tiny_model
from tests.engine.conftest import reference_greedy
from tests.engine.cpu_engine_support import (
    ChildOutcome,
    collect,
    hostile_workload,
    load,
    make_step,
    reference_logprobs,
    run_kernel_child,
    running_engine,
    sdpa_row,
    tokens_of,
)
from tests.polling import wait_until
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import DecodeRows, PagedDecode
from worker.engine.types import EngineRequest, Finish, GenerationParams, OutputDelta

ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def kernel() -> PagedDecode:
    built = cpu_kernels.load()
    assert built is not None, "a C compiler is on this machine: the kernel must build"
    return built


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp(f"bb-{request.param}"), request.param)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bb-llama-only"), "llama")


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bb-qwen2-only"), "qwen2")


def greedy(max_new_tokens: int, **kwargs: Any) -> GenerationParams:
    return GenerationParams(max_new_tokens=max_new_tokens, temperature=0, **kwargs)


def vocab_of(model: Any) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def assert_matches_sdpa(out: torch.Tensor, step: Any, scale: float, **tolerance: float) -> None:
    for request, (position, read) in enumerate(zip(step.query_rows, step.reads, strict=True)):
        torch.testing.assert_close(
            out[position], sdpa_row(step, position, read, scale), msg=lambda m, r=request: f"request {r}: {m}",
            **tolerance,
        )  # fmt: skip


def untouched_rows(step: Any) -> list[int]:
    return sorted(set(range(step.query.shape[0])) - set(step.query_rows))


# ================================================================================================ kernel: numbers


def test_twenty_thousand_keys_with_odd_head_dim(kernel: PagedDecode) -> None:
    """One very long context next to length-1 and short rows; head_dim 12 (not a multiple of 8), 3 query heads per
    KV head."""
    step = make_step([20_000, 1, 3], heads=6, kv_heads=2, head_dim=12, seed=11)
    out = torch.full_like(step.query, float("nan"))
    kernel(step.query, step.keys, step.values, step.rows, 12**-0.5, out)
    assert_matches_sdpa(out, step, 12**-0.5)
    assert bool(out[untouched_rows(step)].isnan().all()), "rows that are not decode rows keep their NaN"


def test_two_hundred_rows_of_mixed_lengths_multi_query(kernel: PagedDecode) -> None:
    """200 requests in one step (one KV head shared by 8 query heads, head_dim 20); `out` starts as NaN, so a
    kernel that accumulates into `out` instead of overwriting it fails."""
    rng = random.Random(3)
    lengths = [rng.choice([1, 2, rng.randint(3, 40), rng.randint(100, 300)]) for _ in range(200)]
    step = make_step(lengths, heads=8, kv_heads=1, head_dim=20, seed=5, extra_tokens=17)
    out = torch.full_like(step.query, float("nan"))
    kernel(step.query, step.keys, step.values, step.rows, 0.3, out)
    assert_matches_sdpa(out, step, 0.3)
    assert len(untouched_rows(step)) == 17
    assert bool(out[untouched_rows(step)].isnan().all())


def test_length_one_rows_return_that_rows_value(kernel: PagedDecode) -> None:
    """Attention over a single key is that key's value, whatever the query: query head h reads KV head h // 3."""
    step = make_step([1] * 9, heads=6, kv_heads=2, head_dim=10, seed=8, query_scale=50.0)
    out = torch.zeros_like(step.query)
    kernel(step.query, step.keys, step.values, step.rows, 10**-0.5, out)
    for position, read in zip(step.query_rows, step.reads, strict=True):
        expected = step.values[int(read[0])].repeat_interleave(3, dim=0)
        torch.testing.assert_close(out[position], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("query_scale", [1e3, 1e4])
def test_large_magnitude_queries_stay_finite_and_exact(kernel: PagedDecode, query_scale: float) -> None:
    """Scores in the tens of thousands: a kernel without max-subtraction overflows exp() to inf / NaN."""
    step = make_step([1, 7, 64, 513], heads=4, kv_heads=4, head_dim=16, seed=21, query_scale=query_scale)
    out = torch.empty_like(step.query)
    kernel(step.query, step.keys, step.values, step.rows, 0.25, out)
    assert bool(out[step.query_rows].isfinite().all())
    assert_matches_sdpa(out, step, 0.25, rtol=1e-4, atol=1e-4)


def test_poisoned_cache_rows_outside_the_index_change_nothing(kernel: PagedDecode) -> None:
    """inf / -inf / NaN in cache rows no request reads (free or other layers' pages) must not leak into the
    output: the same bits as with a clean cache."""
    step = make_step([5, 33, 1, 200], heads=4, kv_heads=2, head_dim=24, seed=13, spare_cache_rows=300)
    clean = torch.zeros_like(step.query)
    kernel(step.query, step.keys, step.values, step.rows, 24**-0.5, clean)
    referenced = set(step.rows.index.tolist())
    unreferenced = [row for row in range(step.keys.shape[0]) if row not in referenced]
    assert len(unreferenced) > 100
    poison = torch.tensor([float("inf"), float("-inf"), float("nan")])
    for offset, row in enumerate(unreferenced):
        step.keys[row] = poison[offset % 3]
        step.values[row] = poison[(offset + 1) % 3]
    poisoned = torch.zeros_like(step.query)
    kernel(step.query, step.keys, step.values, step.rows, 24**-0.5, poisoned)
    assert torch.equal(poisoned, clean)
    assert_matches_sdpa(poisoned, step, 24**-0.5)


def test_requests_sharing_cache_rows_and_overlapping_spans(kernel: PagedDecode) -> None:
    """Shared prefixes: requests read the same cache rows, their spans of `index` overlap or coincide, and one
    request reads a cache row twice."""
    torch.manual_seed(2)
    query, keys, values = torch.randn(5, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16)
    index = torch.tensor([3, 9, 27, 4, 4, 11, 0, 39], dtype=torch.int64)
    spans = [(0, 8), (0, 8), (1, 4), (3, 2), (7, 1)]  # (start, length) per request; query rows 4, 0, 2, 1, 3
    query_rows = [4, 0, 2, 1, 3]
    rows = DecodeRows(
        torch.tensor(query_rows), torch.tensor([s for s, _ in spans]), torch.tensor([n for _, n in spans]), index
    )
    out = torch.zeros_like(query)
    kernel(query, keys, values, rows, 0.25, out)
    for position, (start, length) in zip(query_rows, spans, strict=True):
        read = index[start : start + length]
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[position].unsqueeze(1), keys[read].transpose(0, 1), values[read].transpose(0, 1), scale=0.25,
            enable_gqa=True,
        )[:, 0]  # fmt: skip
        torch.testing.assert_close(out[position], expected)


def test_a_step_without_decode_rows_writes_nothing(kernel: PagedDecode) -> None:
    step = make_step([4, 4], heads=4, kv_heads=2, head_dim=16, seed=1)
    empty = torch.empty(0, dtype=torch.int64)
    out = torch.randn_like(step.query)
    before = out.clone()
    kernel(step.query, step.keys, step.values, DecodeRows(empty, empty, empty, empty), 0.25, out)
    assert torch.equal(out, before)


def test_repeated_calls_give_the_same_bits(kernel: PagedDecode) -> None:
    """The same step twice (threads may split the work differently): identical outputs."""
    step = make_step([3, 900, 17, 1, 250, 64] * 4, heads=8, kv_heads=2, head_dim=32, seed=30)
    first, second = torch.zeros_like(step.query), torch.ones_like(step.query)
    kernel(step.query, step.keys, step.values, step.rows, 32**-0.5, first)
    kernel(step.query, step.keys, step.values, step.rows, 32**-0.5, second)
    assert torch.equal(first[step.query_rows], second[step.query_rows])


def test_tensors_that_are_views_into_larger_buffers(kernel: PagedDecode) -> None:
    """Contiguous views with a storage offset (as slices of a preallocated cache and step buffer are): the kernel
    reads and writes through the views, and nothing of the surrounding buffers changes."""
    step = make_step([6, 40, 1], heads=4, kv_heads=2, head_dim=8, seed=44)
    tokens, cache_rows = step.query.shape[0], step.keys.shape[0]
    buffers = {name: torch.randn(5 + size, *tensor.shape[1:]) for name, size, tensor in [
        ("query", tokens, step.query), ("keys", cache_rows, step.keys), ("values", cache_rows, step.values),
        ("out", tokens, step.query)]}  # fmt: skip
    views = {name: buffer[3 : 3 + size] for name, buffer, size in [
        ("query", buffers["query"], tokens), ("keys", buffers["keys"], cache_rows),
        ("values", buffers["values"], cache_rows), ("out", buffers["out"], tokens)]}  # fmt: skip
    views["query"].copy_(step.query)
    views["keys"].copy_(step.keys)
    views["values"].copy_(step.values)
    assert all(view.is_contiguous() and view.storage_offset() == 3 * view[0].numel() for view in views.values())
    index_buffer = torch.cat([torch.tensor([10**9, -5]), step.rows.index, torch.tensor([10**9])])
    rows = DecodeRows(
        torch.cat([torch.tensor([10**9]), step.rows.query_rows])[1:],
        torch.cat([torch.tensor([10**9]), step.rows.starts])[1:],
        torch.cat([torch.tensor([10**9]), step.rows.lengths])[1:],
        index_buffer[2:-1],
    )
    outside = torch.cat([buffers["out"][:3], buffers["out"][3 + tokens :]]).clone()
    kernel(views["query"], views["keys"], views["values"], rows, 8**-0.5, views["out"])
    assert_matches_sdpa(views["out"], step, 8**-0.5)
    assert torch.equal(torch.cat([buffers["out"][:3], buffers["out"][3 + tokens :]]), outside)


# ================================================================================================ kernel: refusals
# Run in a child interpreter: a kernel that reads or writes out of bounds may crash the process.


CONTROL = {"valid": "accepted", "float64 query": "ValueError", "kv heads do not divide heads": "ValueError"}
MISMATCHED = ["values fewer kv heads", "values fewer cache rows", "values other head_dim", "keys 2-D"]
CHILD_BODIES = {
    # The control calls go first: the shape mismatches after them read out of bounds and might crash the child.
    "shapes": """
        attempt("valid", lambda: kernel(query, keys, values, rows, 0.25, out))
        assert bool(out[1].abs().sum() > 0) and bool((out[[0, 2]] == 0).all())
        attempt("float64 query", lambda: kernel(query.double(), keys, values, rows, 0.25, out))
        attempt("kv heads do not divide heads", lambda: kernel(
            query, torch.randn(10, 3, 16), torch.randn(10, 3, 16), rows, 0.25, out))
        attempt("values fewer kv heads", lambda: kernel(query, keys, values[:, :1].contiguous(), rows, 0.25, out))
        attempt("values fewer cache rows", lambda: kernel(query, keys, values[:5].contiguous(), rows, 0.25, out))
        attempt("values other head_dim", lambda: kernel(query, keys, torch.randn(10, 2, 8), rows, 0.25, out))
        attempt("keys 2-D", lambda: kernel(query, keys.reshape(10, 32), values, rows, 0.25, out))
""",
    "unequal rows": """
        attempt("2 query rows, 1 start", lambda: kernel(
            query, keys, values, DecodeRows(T([1, 2]), T([0]), T([3]), T([0, 5, 9])), 0.25, out))
""",
    "not int64": """
        attempt("int32 index", lambda: kernel(
            query, keys, values, DecodeRows(T([1]), T([0]), T([3]), T([0, 5, 9], torch.int32)), 0.25, out))
        attempt("int32 query rows", lambda: kernel(
            query, keys, values, DecodeRows(T([1], torch.int32), T([0]), T([3]), T([0, 5, 9])), 0.25, out))
""",
    "out of bounds": """
        attempt("index past cache", lambda: kernel(
            query, keys, values, DecodeRows(T([1]), T([0]), T([3]), T([0, 5, 10**6])), 0.25, out))
        attempt("span past index", lambda: kernel(
            query, keys, values, DecodeRows(T([1]), T([0]), T([5]), T([0, 5, 9])), 0.25, out))
        attempt("query row past tokens", lambda: kernel(
            query, keys, values, DecodeRows(T([3]), T([0]), T([3]), T([0, 5, 9])), 0.25, out))
        attempt("negative query row", lambda: kernel(
            query, keys, values, DecodeRows(T([-1]), T([0]), T([3]), T([0, 5, 9])), 0.25, out))
""",
}


@pytest.fixture(scope="module")
def kernel_children(kernel: PagedDecode) -> Callable[[str], ChildOutcome]:
    """Runs a child of `CHILD_BODIES` once (later asks get the same outcome). Needs `kernel`: built here first,
    so the children only load it from the cache."""
    outcomes: dict[str, ChildOutcome] = {}

    def outcome(name: str) -> ChildOutcome:
        if name not in outcomes:
            outcomes[name] = run_kernel_child(CHILD_BODIES[name])
        return outcomes[name]

    return outcome


def test_the_child_harness_tells_a_valid_call_from_a_refused_one(kernel_children: Any) -> None:
    """Control for the refusal tests below (which are expected to fail): in the child, a valid call is accepted and
    writes only its decode row, and the documented refusals raise ValueError without crashing."""
    results = kernel_children("shapes").results
    assert {name: results.get(name) for name in CONTROL} == CONTROL


def test_values_and_keys_of_mismatched_shapes_are_refused(kernel_children: Any) -> None:
    outcome = kernel_children("shapes")
    assert outcome.returncode == 0, outcome.stderr
    assert {name: outcome.results.get(name) for name in MISMATCHED} == dict.fromkeys(MISMATCHED, "ValueError")


def test_decode_rows_of_unequal_lengths_are_refused(kernel_children: Any) -> None:
    outcome = kernel_children("unequal rows")
    assert outcome.returncode == 0, outcome.stderr
    assert outcome.results == {"2 query rows, 1 start": "ValueError"}


def test_decode_rows_that_are_not_int64_are_refused(kernel_children: Any) -> None:
    outcome = kernel_children("not int64")
    assert outcome.returncode == 0, outcome.stderr
    assert outcome.results == {"int32 index": "ValueError", "int32 query rows": "ValueError"}


def test_decode_rows_pointing_out_of_bounds_are_refused(kernel_children: Any) -> None:
    outcome = kernel_children("out of bounds")
    assert outcome.returncode == 0, outcome.stderr
    assert set(outcome.results.values()) == {"ValueError"} and len(outcome.results) == 4


def test_a_strided_index_is_refused_or_read_as_its_values(kernel: PagedDecode) -> None:
    torch.manual_seed(0)
    query, keys, values = torch.randn(3, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    index = torch.tensor([0, 0, 5, 5, 9, 9])[::2]  # the values [0, 5, 9], stride 2
    rows = DecodeRows(torch.tensor([1]), torch.tensor([0]), torch.tensor([3]), index)
    out = torch.zeros_like(query)
    try:
        kernel(query, keys, values, rows, 0.25, out)
    except ValueError:
        return
    read = torch.tensor([0, 5, 9])
    expected = torch.nn.functional.scaled_dot_product_attention(
        query[1].unsqueeze(1), keys[read].transpose(0, 1), values[read].transpose(0, 1), scale=0.25, enable_gqa=True
    )[:, 0]
    torch.testing.assert_close(out[1], expected)


def test_wrong_dtype_or_layout_of_any_tensor_is_refused(kernel: PagedDecode) -> None:
    """The documented refusals, on each of the four tensors (the existing suite tries the query only)."""
    step = make_step([3, 4], heads=4, kv_heads=2, head_dim=16, seed=9)
    out = torch.zeros_like(step.query)
    q, k, v = step.query, step.keys, step.values
    bad = {
        "keys float64": (q, k.double(), v, out),
        "values float16": (q, k, v.half(), out),
        "out bfloat16": (q, k, v, out.bfloat16()),
        "keys strided": (q, k.transpose(0, 1).contiguous().transpose(0, 1), v, out),
        "out strided": (q, k, v, torch.zeros(4, q.shape[0], 16).transpose(0, 1)),
        "out other shape": (q, k, v, torch.zeros(q.shape[0] + 1, 4, 16)),
        "heads not a multiple of kv heads": (torch.randn(q.shape[0], 3, 16), k, v, torch.zeros(q.shape[0], 3, 16)),
    }
    for name, (query, keys, values, target) in bad.items():
        before = target.clone()
        with pytest.raises(ValueError):
            kernel(query, keys, values, step.rows, 0.25, target)
        assert torch.equal(target, before), f"{name}: refused calls write nothing"


# ================================================================================================ engine


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Engine tests run torch (and the kernel's OpenMP) on one thread: on this shared 2-core machine, with another
    process busy, two spinning OpenMP threads made a 4 s engine test take 50 s. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_logprobs(model: Any, ids: list[int], deltas: list[OutputDelta], top: int) -> None:
    tokens = tokens_of(deltas)
    entries = [entry for delta in deltas for entry in delta.logprobs or []]
    assert len(entries) == len(tokens)
    expected = reference_logprobs(model, ids, tokens)
    for position, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        assert len(entry.top) == top
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        assert entry.top[0][0] == token, "greedy: the chosen token is the most likely"
        assert entry.logprob == pytest.approx(entry.top[0][1], abs=1e-6)
        assert entry.logprob == pytest.approx(float(expected[position, token]), abs=1e-4), f"position {position}"
        for alternative, logprob in entry.top:
            assert logprob == pytest.approx(float(expected[position, alternative]), abs=1e-4)


async def test_hostile_batch_matches_generate_with_logprobs_on_some_rows(arch_dir: Path, one_thread: None) -> None:
    """All at once, with chunked prefill (a 32-token budget): one-token prompts, one-token outputs, prompts on page
    and budget boundaries and 8x the budget; logprobs asked on every other request only. Every greedy output is
    `generate`'s; logprobs appear exactly where asked and equal the library's own log-softmax."""
    reference, _ = load(arch_dir)
    model, tokenizer = load(arch_dir)
    workload = hostile_workload(vocab_of(model), seed=3)
    expected = [reference_greedy(reference, ids, n) for ids, n in workload]
    async with running_engine(model, tokenizer, max_batch_tokens=32) as engine:
        assert all("forward" in vars(layer) for layer in model.model.layers), "the lean layers are in use"
        streams = [
            engine.submit(EngineRequest(f"r{i}", input_ids=ids, params=greedy(n, logprobs=3 if i % 2 else None)))
            for i, (ids, n) in enumerate(workload)
        ]
        results = await asyncio.gather(*(collect(stream) for stream in streams))
    for index, ((ids, n), deltas) in enumerate(zip(workload, results, strict=True)):
        assert tokens_of(deltas) == expected[index], f"request {index} ({len(ids)} prompt tokens, {n} new)"
        assert [delta.finished for delta in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == (Finish.LENGTH if len(expected[index]) == n else Finish.EOS)
        assert deltas[0].prompt_tokens == len(ids)
        if index % 2:
            check_logprobs(reference, ids, deltas, top=3)
        else:
            assert all(delta.logprobs is None for delta in deltas), f"request {index} asked for no logprobs"


async def test_staggered_arrivals_under_kv_pressure_match_generate(llama_folder: Path, one_thread: None) -> None:
    """A KV cache too small for the whole workload at once (requests wait for blocks) and at most 4 running; each
    request arrives once the previous one has produced a token, so it joins a batch mid-decode."""
    reference, _ = load(llama_folder)
    model, tokenizer = load(llama_folder)
    workload = hostile_workload(vocab_of(model), seed=9) * 2
    expected = [reference_greedy(reference, ids, n) for ids, n in workload]
    assert sum(len(ids) + n for ids, n in workload) > 2 * 512
    async with running_engine(model, tokenizer, kv_cache_tokens=512, max_batch_tokens=32, max_running=4) as engine:
        firsts, streams = [], []
        for index, (ids, n) in enumerate(workload):
            stream = engine.submit(EngineRequest(f"s{index}", input_ids=ids, params=greedy(n)))
            streams.append(stream)
            firsts.append(await anext(stream))
        rests = await asyncio.gather(*(collect(stream) for stream in streams))
        await wait_until(lambda: engine.idle and engine.stats().kv_blocks_used == 0)
        stats = engine.stats()
    for index, (first, rest) in enumerate(zip(firsts, rests, strict=True)):
        assert tokens_of([first, *rest]) == expected[index], f"request {index}"
    assert stats.kv_blocks_reserved == 0 and stats.running == 0 and stats.waiting == 0


async def test_cancelling_mid_stream_and_mid_prefill_leaves_the_others_exact(
    llama_folder: Path, one_thread: None
) -> None:
    """One request is cancelled after a few decoded tokens, another while its 250-token prompt is still being
    prefilled in 32-token chunks; the rest of the batch still equals `generate`, and the engine serves afterwards."""
    reference, _ = load(llama_folder)
    model, tokenizer = load(llama_folder)
    vocab = vocab_of(model)
    workload = hostile_workload(vocab, seed=17)
    expected = [reference_greedy(reference, ids, n) for ids, n in workload]
    rng = random.Random(1)
    long_ids = [rng.randrange(3, vocab) for _ in range(12)]
    long_reference = reference_greedy(reference, long_ids, 300)
    async with running_engine(model, tokenizer, max_batch_tokens=32) as engine:
        long = engine.submit(EngineRequest("long", input_ids=long_ids, params=greedy(300, ignore_eos=True)))
        others = [
            engine.submit(EngineRequest(f"o{i}", input_ids=ids, params=greedy(n)))
            for i, (ids, n) in enumerate(workload)
        ]
        prefilling = engine.submit(
            EngineRequest("prefilling", input_ids=[rng.randrange(3, vocab) for _ in range(250)], params=greedy(50))
        )
        assert engine.cancel("prefilling")
        others_done = asyncio.gather(*(collect(stream) for stream in others))
        head = [await anext(long) for _ in range(3)]
        assert engine.cancel("long")
        long_rest = await collect(long)
        cancelled_prefill = await collect(prefilling)
        results = await others_done
        after = await collect(engine.submit(EngineRequest("after", input_ids=workload[8][0], params=greedy(12))))
        await wait_until(lambda: engine.idle and engine.stats().kv_blocks_used == 0)
    long_tokens = tokens_of([*head, *long_rest])
    assert long_rest[-1].finish_reason == Finish.CANCELLED
    assert 3 <= len(long_tokens) < 300
    shared = min(len(long_tokens), len(long_reference))
    assert long_tokens[:shared] == long_reference[:shared]
    assert cancelled_prefill[-1].finish_reason == Finish.CANCELLED
    assert len(tokens_of(cancelled_prefill)) < 50
    for index, deltas in enumerate(results):
        assert tokens_of(deltas) == expected[index], f"request {index}"
    assert tokens_of(after) == reference_greedy(reference, workload[8][0], 12)


async def test_a_seeded_sample_repeats_alone_in_a_crowd_and_on_a_fresh_engine(
    qwen2_folder: Path, one_thread: None
) -> None:
    """Grouped-query attention with biases (qwen2), a prompt prefilled in chunks: a seeded sampled request gives
    the same tokens alone, next to a crowd of greedy requests, and on another engine; another seed differs."""
    model, tokenizer = load(qwen2_folder)
    vocab = vocab_of(model)
    rng = random.Random(4)
    ids = [rng.randrange(3, vocab) for _ in range(100)]
    seeded = GenerationParams(max_new_tokens=30, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    crowd = hostile_workload(vocab, seed=5)

    async def run(engine: Any, request_id: str, params: GenerationParams) -> list[int]:
        return tokens_of(await collect(engine.submit(EngineRequest(request_id, input_ids=ids, params=params))))

    async with running_engine(model, tokenizer, max_batch_tokens=32) as engine:
        alone = await run(engine, "alone", seeded)
        crowd_streams = [
            engine.submit(EngineRequest(f"c{i}", input_ids=c, params=greedy(n))) for i, (c, n) in enumerate(crowd)
        ]
        in_crowd, *_ = await asyncio.gather(run(engine, "crowd", seeded), *(collect(s) for s in crowd_streams))
        other_seed = await run(engine, "other", dataclasses.replace(seeded, seed=1235))
    async with running_engine(*load(qwen2_folder), max_batch_tokens=32) as fresh:
        on_fresh = await run(fresh, "fresh", seeded)
    assert len(alone) == 30
    assert in_crowd == alone
    assert on_fresh == alone
    assert other_seed != alone


async def test_a_burst_of_one_token_requests_beyond_max_running(llama_folder: Path, one_thread: None) -> None:
    """48 one-token prompts asking for one token each, more than `max_running` (8): every one finishes with
    exactly `generate`'s token in a single final delta."""
    reference, _ = load(llama_folder)
    model, tokenizer = load(llama_folder)
    vocab = vocab_of(model)
    prompts = [[3 + (i * 37) % (vocab - 3)] for i in range(48)]
    expected = [reference_greedy(reference, ids, 1) for ids in prompts]
    async with running_engine(model, tokenizer, max_running=8, max_batch_tokens=32) as engine:
        streams = [
            engine.submit(EngineRequest(f"b{i}", input_ids=ids, params=greedy(1))) for i, ids in enumerate(prompts)
        ]
        results = await asyncio.gather(*(collect(stream) for stream in streams))
        stats = engine.stats()
    for index, deltas in enumerate(results):
        assert tokens_of(deltas) == expected[index], f"request {index}"
        assert len(tokens_of(deltas)) == 1
        assert deltas[-1].finish_reason in (Finish.LENGTH, Finish.EOS)
        assert deltas[0].prompt_tokens == 1
    assert sum(stats.requests_finished.values()) >= 48
