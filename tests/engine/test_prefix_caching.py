"""Prefix caching, on by default: a prompt's full pages are computed once and reused by every request that starts
with them (the `n` choices of one call, requests behind one system prompt), and outputs stay exactly what they are
without it, greedy and seeded, together and staggered."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_engine import collect, greedy, tokens_of
from worker.engine import EngineConfig
from worker.engine.types import EngineRequest, GenerationParams, Resume

PAGE = 16


def system_prompted(vocab: int, count: int, seed: int = 3) -> list[list[int]]:
    """Prompts behind one of two system prompts (3 and 2 full pages and a bit), each with its own question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(length)] for length in (53, 40)]
    return [systems[i % 2] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))] for i in range(count)]


def test_prefix_caching_is_on_by_default() -> None:
    assert EngineConfig().prefix_sharing


async def test_choices_of_one_prompt_prefill_it_once(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    prompt = [3 + i % 90 for i in range(70)]  # four full pages and 6 tokens
    params = GenerationParams(max_new_tokens=6, temperature=0.9, seed=11)
    streams = [engine.submit(EngineRequest(f"c-{i}", input_ids=prompt, params=params)) for i in range(4)]
    # The three followers wait for the first's prefill without holding the engine's free slots.
    assert engine.free_slots() == engine.config.max_running - 4
    outputs = [tokens_of(deltas) for deltas in await asyncio.gather(*(collect(s) for s in streams))]
    stats = engine.stats()
    assert stats.prefill_tokens == 70 + 3 * (70 - 4 * PAGE)  # the pages once, each follower's last 6 tokens
    assert stats.prefix_cache_hits == 3 * 4 * PAGE
    assert outputs == [outputs[0]] * 4  # the same seed on the same prompt: the same answer from shared pages


@pytest.mark.parametrize("staggered", [False, True], ids=["together", "staggered"])
async def test_outputs_are_the_same_with_and_without_prefix_caching(
    llama_dir: Path, make_engine: Any, staggered: bool
) -> None:
    cached = await make_engine(llama_dir)
    plain = await make_engine(llama_dir, prefix_sharing=False)
    prompts = system_prompted(cached.vocab_size, count=12)

    async def run(engine: Any) -> list[list[int]]:
        streams = []
        for index, prompt in enumerate(prompts):
            params = greedy(12) if index % 3 else GenerationParams(max_new_tokens=12, temperature=1.1, seed=index)
            request = EngineRequest(f"r{index}", input_ids=prompt, params=params)
            streams.append(asyncio.ensure_future(collect(engine.submit(request))))
            if staggered:  # later requests find the system prompts' pages cached by earlier ones
                await asyncio.sleep(0.03 * (index % 3))
        return [tokens_of(deltas) for deltas in await asyncio.gather(*streams)]

    with_cache, without = await run(cached), await run(plain)
    assert with_cache == without
    assert cached.stats().prefix_cache_hits > 0 and cached.stats().prefill_tokens < plain.stats().prefill_tokens


async def test_a_prompt_that_extends_a_finished_one_reuses_its_pages(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    first = [5 + i % 80 for i in range(40)]
    await collect(engine.submit(EngineRequest("first", input_ids=first, params=greedy(3))))
    extended = [*first, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # a conversation's next turn, say
    before = engine.stats().prefill_tokens
    await collect(engine.submit(EngineRequest("next", input_ids=extended, params=greedy(3))))
    assert engine.stats().prefill_tokens - before == len(extended) - 2 * PAGE  # the first's two full pages reused


async def test_a_request_of_another_prompt_is_not_held(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir, max_running=3)
    shared = [7 + i % 60 for i in range(300)]  # a long prefill: several steps of 128 tokens
    leader = engine.submit(EngineRequest("leader", input_ids=shared, params=greedy(2)))
    follower = engine.submit(EngineRequest("follower", input_ids=shared, params=greedy(2)))
    other = engine.submit(EngineRequest("other", input_ids=[4] * 20, params=greedy(2)))
    # The follower waits for the leader's prefill; the other request went in beside the leader at once.
    assert [s.request_id for s in engine._running.values()] == ["leader", "other"]
    assert engine.free_slots() == 0  # three slots: two running, one reserved for the follower
    await asyncio.gather(collect(leader), collect(follower), collect(other))
    assert engine.stats().prefix_cache_hits == 300 // PAGE * PAGE


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
async def test_a_resume_on_a_worker_holding_its_pages_continues_the_same_tokens(
    llama_dir: Path, make_engine: Any, seeded: bool
) -> None:
    """A request resumed (after a preemption, say) on an engine that cached its prompt and its first tokens
    continues exactly as one uninterrupted run does, and as a resume without caching does."""
    params = GenerationParams(max_new_tokens=30, temperature=1.0, seed=5) if seeded else greedy(30)
    params = replace(params, ignore_eos=True)
    prompt = [11 + i % 70 for i in range(50)]
    cached = await make_engine(llama_dir)
    plain = await make_engine(llama_dir, prefix_sharing=False)
    whole = tokens_of(await collect(cached.submit(EngineRequest("whole", input_ids=prompt, params=params))))
    delivered = whole[:12]  # prompt + 12 tokens: three full pages of the first run are cached
    text = cached.tokenizer.decode(delivered)

    async def resumed(engine: Any) -> list[int]:
        request = EngineRequest("again", input_ids=prompt, params=params, resume=Resume(delivered, text))
        return delivered + tokens_of(await collect(engine.submit(request)))

    before = cached.stats().prefix_cache_hits
    assert await resumed(cached) == whole == await resumed(plain)
    assert cached.stats().prefix_cache_hits - before == 3 * PAGE  # it did run from the cached pages


async def test_a_prefix_in_use_now_and_then_stays_cached_while_one_offs_fill_the_cache(
    llama_dir: Path, make_engine: Any
) -> None:
    """A cache of 32 pages, filled again and again by one-off prompts of 6 pages: the cached pages evicted are the
    least recently used ones, so a prompt asked between them keeps hitting its pages (the library alone drops
    every cached page at once whenever free room runs low)."""
    engine = await make_engine(llama_dir, kv_cache_tokens=32 * PAGE)
    hot = [9 + i % 50 for i in range(3 * PAGE + 4)]  # three full pages and 4 tokens
    rng = random.Random(5)
    hits = []
    for round_ in range(12):
        one_off = [rng.randrange(3, engine.vocab_size) for _ in range(6 * PAGE + 3)]
        await collect(engine.submit(EngineRequest(f"once-{round_}", input_ids=one_off, params=greedy(4))))
        before = engine.stats().prefix_cache_hits
        await collect(engine.submit(EngineRequest(f"hot-{round_}", input_ids=hot, params=greedy(4))))
        hits.append(engine.stats().prefix_cache_hits - before)
    assert engine.stats().kv_blocks_total == 32
    assert hits == [0] + [3 * PAGE] * 11  # computed once, found every time after
