"""Batched decode attention read straight from the paged cache, against per-request SDPA and `model.generate`."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from tests.engine.conftest import load, reference_greedy
from tests.engine.test_engine import collect, greedy, kill_engine_thread_once, mixed_prompts, tokens_of
from worker.engine import library
from worker.engine.attention import ATTENTION_NAME, paged_attention
from worker.engine.kernels import cpu_kernels
from worker.engine.paged_reads import PagedKV, plan_step, split_by_length
from worker.engine.sampling import FusedSampler
from worker.engine.types import EngineRequest


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_len: int) -> torch.Tensor:
    """One request with explicit key repeat and an explicit bottom-right causal mask: `[q_len, heads, d]`."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    k_len = key.shape[0]
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    out = functional.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)], ids=["mha", "gqa", "gqa-smollm2"])
def test_a_mixed_step_matches_per_request_attention(heads: int, kv_heads: int, native: bool) -> None:
    """Decode rows of very different lengths, a fresh prompt and a chunk after cached context, in one step, with the
    requests' keys scattered over the cache as pages are; decode rows by the native kernel or in padded groups."""
    rng = random.Random(heads)
    torch.manual_seed(heads)
    head_dim, cache_rows = 8, 4096
    # (past length, new tokens): decode rows, a fresh prompt, a chunked prefill after context, more decode rows
    requests = [(37, 1), (0, 9), (1, 1), (300, 1), (20, 7), (64, 1), (0, 1), (31, 1), (255, 1)]
    keys_cache = torch.randn(cache_rows, kv_heads, head_dim)
    values_cache = torch.randn(cache_rows, kv_heads, head_dim)
    free = list(range(cache_rows))
    rng.shuffle(free)
    read, query_offsets, key_offsets = [], [0], [0]
    for past, new in requests:
        read.append(torch.tensor([free.pop() for _ in range(past + new)]))
        query_offsets.append(query_offsets[-1] + new)
        key_offsets.append(key_offsets[-1] + past + new)
    read_index = torch.cat(read)
    total_q = query_offsets[-1]
    query = torch.randn(1, heads, total_q, head_dim)
    # the new keys are the last `new` of each request's keys (written to the cache before attention)
    new_rows = torch.cat([rows[len(rows) - new :] for rows, (_, new) in zip(read, requests, strict=True)])
    new_keys = keys_cache[new_rows].transpose(0, 1).unsqueeze(0)
    new_values = values_cache[new_rows].transpose(0, 1).unsqueeze(0)

    kernel = cpu_kernels.load() if native else None
    assert kernel is not None or not native
    plan = plan_step(query_offsets, key_offsets, read_index, cost_rows=64, kernel=kernel)
    if native:
        assert plan.native is not None and plan.native.rows.query_rows.numel() == 7 and not plan.decode
    else:
        assert len(plan.decode) >= 2, "rows of very different lengths go to separate calls"
        assert sum(group.rows.numel() for group in plan.decode) == 7
    assert len(plan.prefill) == 2
    for _ in range(2):  # the second layer of a step reuses the group buffers
        got = paged_attention(query, new_keys, new_values, PagedKV(keys_cache, values_cache, plan), scaling=None)
    for index, (rows, (_, new)) in enumerate(zip(read, requests, strict=True)):
        q = query[0, :, query_offsets[index] : query_offsets[index + 1]].transpose(0, 1)
        expected = _reference(q, keys_cache[rows], values_cache[rows], new)
        torch.testing.assert_close(got[0, query_offsets[index] : query_offsets[index + 1]], expected)


def test_groups_minimise_padding_plus_calls() -> None:
    assert split_by_length([40] * 10 + [600] * 10, cost_rows=2048) == [(0, 10), (10, 20)]
    assert split_by_length([300] * 12, cost_rows=2048) == [(0, 12)]
    assert split_by_length([], cost_rows=2048) == []
    rng = random.Random(3)
    for _ in range(50):
        lengths = sorted(rng.randint(1, 500) for _ in range(rng.randint(1, 7)))
        every_split = (
            list(itertools.pairwise([0, *cuts, len(lengths)]))
            for k in range(len(lengths))
            for cuts in itertools.combinations(range(1, len(lengths)), k)
        )
        best = min(_padded_cost(lengths, spans, 300) for spans in every_split)
        spans = split_by_length(lengths, 300)
        assert _padded_cost(lengths, spans, 300) == best
        assert [i for span in spans for i in range(*span)] == list(range(len(lengths)))


def _padded_cost(lengths: list[int], spans: list[tuple[int, int]], cost: int) -> int:
    return sum((last - first) * lengths[last - 1] + cost for first, last in spans)


@pytest.mark.parametrize("staggered", [False, True], ids=["together", "staggered"])
async def test_greedy_matches_generate_with_chunked_prefill(
    tiny_model_dir: Path, make_engine: Any, staggered: bool
) -> None:
    """A small token budget chunks long prompts, so steps mix decode rows with prompt chunks after cached context
    (llama: full attention; qwen2: grouped-query)."""
    reference_model, _ = load(tiny_model_dir)
    engine = await make_engine(tiny_model_dir, max_batch_tokens=32)
    workload = mixed_prompts(engine.vocab_size, count=14, seed=11)
    expected = [reference_greedy(reference_model, ids, n) for ids, n in workload]
    streams = []
    for index, (ids, n) in enumerate(workload):
        request = EngineRequest(f"r{index}", input_ids=ids, params=greedy(n))
        streams.append(asyncio.ensure_future(collect(engine.submit(request))))
        if staggered:
            await asyncio.sleep(0.02 * (index % 3))
    results = await asyncio.gather(*streams)
    for index, deltas in enumerate(results):
        assert tokens_of(deltas) == expected[index], f"request {index}"
    stats = engine.stats()
    assert stats.decode_tokens > 0 and stats.prefill_tokens > 0


async def test_engine_on_cpu_runs_the_fast_paths(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    manager = engine._manager
    assert manager is not None
    assert engine.model.config._attn_implementation == ATTENTION_NAME
    processor = manager.library.batch_processor
    assert library.has_paged_reads(processor.cache)
    assert isinstance(processor.model_runner.logit_processor, FusedSampler)
    assert all("forward" in vars(layer) for layer in engine.model.model.layers), "lean layers"
    assert not library.install_paged_reads(processor.cache), "installing twice changes nothing"


async def test_a_restarted_engine_reads_the_paged_cache_again(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load(llama_dir)
    engine = await make_engine(llama_dir, model, tokenizer)
    prompt = list(range(3, 60))
    expected = tokens_of(await collect(engine.submit(EngineRequest("before", input_ids=prompt, params=greedy(12)))))
    await kill_engine_thread_once(engine, model)
    assert engine._manager is not None
    assert library.has_paged_reads(engine._manager.library.batch_processor.cache)
    assert all("forward" in vars(layer) for layer in model.model.layers), "lean layers again"
    after = await collect(engine.submit(EngineRequest("after", input_ids=prompt, params=greedy(12))))
    assert tokens_of(after) == expected == reference_greedy(load(llama_dir)[0], prompt, 12)
