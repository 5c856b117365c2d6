"""Prefix caching, black box: written from docs/workers.md ("Prefix caching") and the engine's public API only.

Prompts are `input_ids` (so the token counts are exact) on the tiny llama with 16-token pages. What is checked:
outputs are the same with caching on (the default) and off (`EngineConfig(prefix_sharing=False)`), greedy and
seeded, alone and in a burst; a burst of one prompt computes its full pages once (`stats().prefill_tokens`,
`prefix_cache_hits`); a longer prompt reuses an earlier one's full pages, never its partial last one; a weight
changed in place or swapped is served (its stale prefixes forgotten); a change through `.data` is served after
`engine.reset_prefix_cache()`; a prompt scored with `prompt_logprobs` is computed whole yet serves later prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.engine import (
    Engine,
    EngineRequest,
    EngineStats,
    GenerationParams,
    LoadOptions,
    load_model,
)

PAGE = 16
VOCAB_LOW, VOCAB_HIGH = 10, 400  # ids well inside the tiny tokenizer's vocabulary (512), no special tokens


def prompt(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of `length` ordinary token ids; a different `salt` gives a different prompt."""
    return [VOCAB_LOW + (i * 37 + salt * 101 + 7) % (VOCAB_HIGH - VOCAB_LOW) for i in range(length)]


def params(seed: int | None = None, tokens: int = 6, **extra: Any) -> GenerationParams:
    if seed is None:
        return GenerationParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True, **extra)
    return GenerationParams(max_new_tokens=tokens, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, **extra)


async def drain(stream: Any) -> dict[str, Any]:
    tokens: list[int] = []
    finish = None
    scored = None
    async for delta in stream:
        tokens += delta.token_ids
        if delta.prompt is not None:
            scored = delta.prompt
        if delta.finish_reason is not None:
            finish = delta.finish_reason
    return {"tokens": tokens, "finish": finish, "prompt": scored}


async def run_together(engine: Engine, requests: list[tuple[str, list[int], GenerationParams]]) -> list[list[int]]:
    """Submits every request before reading any (they arrive together), then reads all of them."""
    streams = [engine.submit(EngineRequest(rid, input_ids=ids, params=p)) for rid, ids, p in requests]
    outs = await asyncio.gather(*(drain(s) for s in streams))
    return [out["tokens"] for out in outs]


async def run_one(engine: Engine, rid: str, ids: list[int], p: GenerationParams | None = None) -> list[int]:
    [out] = await run_together(engine, [(rid, ids, p or params())])
    return out


async def settled(engine: Engine) -> EngineStats:
    """The stats once nothing runs or waits (counters are written by the engine's thread after each step)."""
    for _ in range(200):
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return stats
        await asyncio.sleep(0.01)
    return engine.stats()


async def measured(engine: Engine, work: Any) -> tuple[Any, int, int]:
    """Runs `work` (a coroutine) and returns its value with the prefill tokens and prefix-cache hits it cost."""
    before = await settled(engine)
    value = await work
    after = await settled(engine)
    return (
        value,
        after.prefill_tokens - before.prefill_tokens,
        (after.prefix_cache_hits or 0) - (before.prefix_cache_hits or 0),
    )


def fresh_model(folder: Path) -> tuple[Any, Any]:
    return load_model(str(folder), LoadOptions(cache_dir=folder / "cache"))


# --- outputs are the same with and without caching -------------------------------------------------------------


async def test_default_config_has_prefix_caching_on(llama_dir: Path, make_engine: Callable[..., Any]) -> None:
    engine = await make_engine(llama_dir)  # EngineConfig's default, as the worker's LLMQ_PREFIX_SHARING=true
    ids = prompt(50)
    await run_one(engine, "first", ids)
    _, prefill, hits = await measured(engine, run_one(engine, "again", ids))
    assert (prefill, hits) == (50 - 48, 48)


async def test_prefix_sharing_false_computes_every_prompt_token(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    engine = await make_engine(llama_dir, prefix_sharing=False)
    ids = prompt(50)
    await run_one(engine, "first", ids)
    _, prefill, hits = await measured(engine, run_one(engine, "again", ids))
    assert (prefill, hits) == (50, 0)
    _, prefill, hits = await measured(engine, run_together(engine, [(f"b{i}", ids, params()) for i in range(3)]))
    assert (prefill, hits) == (150, 0)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
async def test_outputs_equal_with_and_without_prefix_caching(
    tiny_model_dir: Path, make_engine: Callable[..., Any], seeded: bool
) -> None:
    """Token for token, on llama and qwen2 (grouped-query attention, biases): a sequence of requests that hit the
    cache in every way the docs name (a repeat, an extension, a burst of one prompt, a burst behind one shared
    prefix, prompts of exactly 1 and 4 pages, whose last page is full)."""
    cached = await make_engine(tiny_model_dir)
    plain = await make_engine(tiny_model_dir, prefix_sharing=False)
    system = prompt(48, salt=1)
    plan: list[list[tuple[str, list[int], GenerationParams]]] = [
        [("p70", prompt(70), params(11 if seeded else None))],
        [("p70-again", prompt(70), params(11 if seeded else None))],
        [("p70-ext", prompt(70) + prompt(29, salt=2), params(12 if seeded else None))],
        [(f"burst{i}", prompt(70), params(20 + i if seeded else None)) for i in range(4)],
        [(f"sys{i}", system + prompt(5 + i, salt=3 + i), params(30 + i if seeded else None)) for i in range(3)],
        [("exact1", prompt(16, salt=9), params(40 if seeded else None))],
        [("exact1-again", prompt(16, salt=9), params(40 if seeded else None))],
        [("exact4", prompt(64, salt=10), params(41 if seeded else None))],
        [(f"exact4-burst{i}", prompt(64, salt=10), params(42 + i if seeded else None)) for i in range(3)],
        [("one", [VOCAB_LOW], params(50 if seeded else None))],
    ]
    for wave in plan:
        with_cache = await run_together(cached, wave)
        without = await run_together(plain, wave)
        assert with_cache == without, [rid for rid, _, _ in wave]
        assert all(len(tokens) == wave[0][2].max_new_tokens for tokens in with_cache)
    stats = await settled(cached)
    assert stats.prefix_cache_hits and stats.prefix_cache_hits > 0  # the comparison did exercise the cache


async def test_logprobs_equal_with_and_without_prefix_caching(llama_dir: Path, make_engine: Callable[..., Any]) -> None:
    cached = await make_engine(llama_dir)
    plain = await make_engine(llama_dir, prefix_sharing=False)
    ids = prompt(40)
    results = []
    for engine in (cached, plain):
        await run_one(engine, "warm", ids)  # the cached engine now holds 2 pages of this prompt
        stream = engine.submit(EngineRequest("lp", input_ids=ids, params=params(logprobs=3)))
        tokens: list[int] = []
        logprobs: list[float] = []
        async for delta in stream:
            tokens += delta.token_ids
            logprobs += [lp.logprob for lp in delta.logprobs or []]
        results.append((tokens, logprobs))
    assert len(results[0][0]) == len(results[0][1]) == 6
    assert results[0][0] == results[1][0]
    assert results[0][1] == pytest.approx(results[1][1], abs=1e-4)


# --- what is computed -------------------------------------------------------------------------------------------


async def test_four_choices_of_a_70_token_prompt_compute_70_plus_3_x_6(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    """The docs' own figure: four requests of one 70-token prompt arriving together compute 70 + 3 x 6."""
    engine = await make_engine(llama_dir)
    ids = prompt(70)
    outs, prefill, hits = await measured(engine, run_together(engine, [(f"c{i}", ids, params()) for i in range(4)]))
    assert prefill == 70 + 3 * 6
    assert hits == 3 * 64
    assert outs[0] == outs[1] == outs[2] == outs[3]


async def test_burst_behind_one_system_prompt_computes_it_once(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    engine = await make_engine(llama_dir)
    system = prompt(48, salt=4)  # three full pages
    requests = [(f"q{i}", system + prompt(10, salt=20 + i), params()) for i in range(3)]
    _, prefill, hits = await measured(engine, run_together(engine, requests))
    assert prefill == 58 + 2 * 10
    assert hits == 2 * 48


async def test_burst_beside_other_prompts_is_served(llama_dir: Path, make_engine: Callable[..., Any]) -> None:
    """Requests of other prompts go in beside a shared prefill: every request of a mixed burst finishes with
    the tokens it gets alone."""
    engine = await make_engine(llama_dir)
    plain = await make_engine(llama_dir, prefix_sharing=False)
    shared = prompt(100, salt=5)
    others = [prompt(20 + 7 * i, salt=30 + i) for i in range(3)]
    requests = [(f"s{i}", shared, params()) for i in range(3)] + [
        (f"o{i}", ids, params()) for i, ids in enumerate(others)
    ]
    outs, prefill, _ = await measured(engine, run_together(engine, requests))
    expected = await run_together(plain, requests)
    assert outs == expected
    assert prefill == 100 + 2 * (100 - 96) + sum(len(ids) for ids in others)


async def test_extension_reuses_the_earlier_prompts_full_pages_only(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    engine = await make_engine(llama_dir)
    first = prompt(40)  # 2 full pages + 8 tokens, followed by its generated tokens in the third page
    await run_one(engine, "first", first)
    _, prefill, hits = await measured(engine, run_one(engine, "longer", first + prompt(30, salt=6)))
    assert (prefill, hits) == (70 - 32, 32)
    # The extension's own full pages (4 of them now) serve a still longer prompt.
    _, prefill, hits = await measured(
        engine, run_one(engine, "longest", first + prompt(30, salt=6) + prompt(3, salt=7))
    )
    assert (prefill, hits) == (73 - 64, 64)


async def test_a_different_first_page_shares_nothing(llama_dir: Path, make_engine: Callable[..., Any]) -> None:
    """Pages are keyed by everything before them: the same second page after a different first one is no hit."""
    engine = await make_engine(llama_dir)
    tail = prompt(40, salt=8)
    await run_one(engine, "a", prompt(16, salt=1) + tail)
    changed = prompt(16, salt=1)
    changed[3] += 1
    _, prefill, hits = await measured(engine, run_one(engine, "b", changed + tail))
    assert (prefill, hits) == (56, 0)


async def test_reset_prefix_cache_forgets_every_prefix(llama_dir: Path, make_engine: Callable[..., Any]) -> None:
    engine = await make_engine(llama_dir)
    ids = prompt(70)
    expected = await run_one(engine, "first", ids)
    engine.reset_prefix_cache()
    out, prefill, hits = await measured(engine, run_one(engine, "after-reset", ids))
    assert (prefill, hits) == (70, 0)
    assert out == expected
    out, prefill, hits = await measured(engine, run_one(engine, "cached-again", ids))
    assert (prefill, hits) == (6, 64)
    assert out == expected


async def test_reset_prefix_cache_on_an_idle_fresh_engine_is_harmless(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    engine = await make_engine(llama_dir)
    engine.reset_prefix_cache()
    engine.reset_prefix_cache()
    assert len(await run_one(engine, "r", prompt(20))) == 6


async def test_cancelled_leader_of_a_burst_does_not_stall_the_others(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    """The first of a burst computes the shared pages while the others wait; cancelling it at once must not
    leave them waiting for pages that never come, nor hand them wrong ones."""
    engine = await make_engine(llama_dir)
    plain = await make_engine(llama_dir, prefix_sharing=False)
    ids = prompt(300, salt=11)  # 3 steps of prefill at 128 tokens a step
    streams = [engine.submit(EngineRequest(f"w{i}", input_ids=ids, params=params())) for i in range(4)]
    assert engine.cancel("w0")
    outs = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 60)
    assert outs[0]["finish"] == "cancelled"
    expected = await run_one(plain, "ref", ids)
    assert [out["tokens"] for out in outs[1:]] == [expected] * 3
    assert [out["finish"] for out in outs[1:]] == ["length"] * 3


# --- weights changed between requests ---------------------------------------------------------------------------


def perturb(model: Any, how: str) -> None:
    """Changes layer 0's value projection (a linear weight) in place or by a new parameter, or the token
    embedding through `.data` (a linear weight changed through `.data` is documented to bypass the engine's packed
    copy, so that case uses a weight that is not packed)."""
    generator = torch.Generator().manual_seed(1234)
    attention = model.model.layers[0].self_attn
    if how == "in_place":
        with torch.no_grad():
            weight = attention.v_proj.weight
            weight.add_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * 0.5)
    elif how == "swapped":
        weight = attention.v_proj.weight
        noise = torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * 0.5
        attention.v_proj.weight = torch.nn.Parameter(weight.detach().clone() + noise, requires_grad=False)
    elif how == "data":
        weight = model.model.embed_tokens.weight
        weight.data += torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * 0.5
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["in_place", "swapped", "data"])
async def test_changed_weights_are_served(llama_dir: Path, make_engine: Callable[..., Any], how: str) -> None:
    """After the weights change, a cached prompt answers as the changed model does (a fresh engine on a model
    changed the same way), not from the old model's KV; a `.data` change after `reset_prefix_cache()`."""
    model, tokenizer = fresh_model(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer)
    ids = prompt(70, salt=12)
    before = await run_one(engine, "before", ids)
    _, prefill, hits = await measured(engine, run_one(engine, "cached", ids))
    assert (prefill, hits) == (6, 64)

    perturb(model, how)
    if how == "data":
        engine.reset_prefix_cache()
    after, prefill, hits = await measured(engine, run_one(engine, "after", ids))

    reference_model, reference_tokenizer = fresh_model(llama_dir)
    perturb(reference_model, how)
    reference = await make_engine(llama_dir, model=reference_model, tokenizer=reference_tokenizer, prefix_sharing=False)
    expected = await run_one(reference, "reference", ids)
    assert expected != before  # the change matters to this prompt, so serving stale KV would show
    assert after == expected
    assert (prefill, hits) == (70, 0)
    # ... and the new prefix is cached again for the next request.
    again, prefill, hits = await measured(engine, run_one(engine, "after-again", ids))
    assert again == expected
    assert (prefill, hits) == (6, 64)


# --- prompt logprobs --------------------------------------------------------------------------------------------


async def test_a_scored_prompt_is_computed_whole_but_serves_later_prompts(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    engine = await make_engine(llama_dir)
    plain = await make_engine(llama_dir, prefix_sharing=False)
    ids = prompt(70, salt=13)
    await run_one(engine, "warm", ids)  # its 4 full pages are cached

    async def scored(target: Engine, rid: str) -> dict[str, Any]:
        return await drain(target.submit(EngineRequest(rid, input_ids=ids, params=params(prompt_logprobs=2))))

    out, prefill, hits = await measured(engine, scored(engine, "scored"))
    assert (prefill, hits) == (70, 0)  # scores need every position's logits: no match taken
    reference = await scored(plain, "scored-ref")
    assert out["tokens"] == reference["tokens"]
    assert out["prompt"] is not None and reference["prompt"] is not None
    assert len(out["prompt"].logprobs) == len(ids)
    ours = [None if e is None else e.logprob for e in out["prompt"].logprobs]
    theirs = [None if e is None else e.logprob for e in reference["prompt"].logprobs]
    assert ours[0] is None and theirs[0] is None
    assert ours[1:] == pytest.approx(theirs[1:], abs=1e-4)

    # On a cold cache, a scored prompt's pages serve the next plain request of that prompt.
    engine.reset_prefix_cache()
    await scored(engine, "scored-cold")
    _, prefill, hits = await measured(engine, run_one(engine, "plain-after-scored", ids))
    assert (prefill, hits) == (6, 64)


async def test_burst_of_scored_prompts_each_computes_whole(llama_dir: Path, make_engine: Callable[..., Any]) -> None:
    """Two requests of one prompt with `prompt_logprobs` arriving together (the `n` choices of a scored call):
    neither may take the other's pages, and both get the full scores."""
    engine = await make_engine(llama_dir)
    ids = prompt(40, salt=14)

    async def both() -> list[dict[str, Any]]:
        scored = params(prompt_logprobs=1)
        streams = [engine.submit(EngineRequest(f"s{i}", input_ids=ids, params=scored)) for i in range(2)]
        return list(await asyncio.gather(*(drain(s) for s in streams)))

    outs, prefill, _ = await measured(engine, both())
    assert prefill == 2 * 40
    for out in outs:
        assert out["prompt"] is not None and len(out["prompt"].logprobs) == 40
    first = [None if e is None else e.logprob for e in outs[0]["prompt"].logprobs]
    second = [None if e is None else e.logprob for e in outs[1]["prompt"].logprobs]
    assert first[1:] == pytest.approx(second[1:], abs=1e-4)
    assert outs[0]["tokens"] == outs[1]["tokens"]


async def test_burst_larger_than_max_running_is_served_and_shares(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    """Six requests of one prompt with room to run two at a time: the waiting ones still reuse the pages."""
    engine = await make_engine(llama_dir, max_running=2)
    ids = prompt(70, salt=15)
    outs, prefill, hits = await measured(engine, run_together(engine, [(f"m{i}", ids, params()) for i in range(6)]))
    assert len({tuple(out) for out in outs}) == 1 and len(outs[0]) == 6
    assert prefill == 70 + 5 * 6
    assert hits == 5 * 64


async def test_a_prefix_asked_now_and_then_outlives_one_off_prompts(
    llama_dir: Path, make_engine: Callable[..., Any]
) -> None:
    """A small cache (32 pages) under a stream of one-off prompts: the least recently used pages make room, so
    every request is served (cached pages never block admission), the prefix asked between them keeps hitting,
    and cached pages no request holds count as free."""
    engine = await make_engine(llama_dir, kv_cache_tokens=512)
    plain = await make_engine(llama_dir, kv_cache_tokens=512, prefix_sharing=False)
    often = prompt(33, salt=16)  # 2 full pages
    expected = await run_one(plain, "often-ref", often)
    assert await run_one(engine, "often-first", often) == expected
    for round_ in range(14):
        one_off = prompt(60, salt=100 + round_)  # 3 full pages each: 42 pages over the rounds, the cache holds 32
        got = await asyncio.wait_for(run_one(engine, f"once{round_}", one_off), 30)
        assert got == await run_one(plain, f"once{round_}-ref", one_off)
        out, prefill, hits = await measured(engine, run_one(engine, f"often{round_}", often))
        assert out == expected
        assert (prefill, hits) == (1, 32), round_
    stats = await settled(engine)
    assert stats.kv_blocks_used == 0
