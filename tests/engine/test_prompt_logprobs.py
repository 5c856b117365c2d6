"""Prompt logprobs: the engine scores each prompt token from its prefill's logits, as a plain forward pass does."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.conftest import load
from tests.engine.test_engine import collect, greedy, tokens_of
from worker.engine import prompt_scores
from worker.engine.errors import EngineError, RequestRejected
from worker.engine.prompt_scores import PromptScores
from worker.engine.types import EngineRequest, OutputDelta, Resume, ScoredPrompt

CHUNK = 32  # the engine's max_batch_tokens here: a prompt longer than it is prefilled over several steps
TOP = 3


def reference_scores(model: Any, prompt: list[int]) -> torch.Tensor:
    """Each position's log-softmax from one full forward pass of the prompt alone, float32."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def scored(deltas: list[OutputDelta]) -> ScoredPrompt:
    first = deltas[0].prompt
    assert first is not None
    assert all(delta.prompt is None for delta in deltas[1:])  # once, on the first delta
    return first


def check_against_reference(prompt_ids: list[int], result: ScoredPrompt, reference: torch.Tensor) -> None:
    assert result.token_ids == prompt_ids
    assert len(result.texts) == len(result.logprobs) == len(prompt_ids)
    assert result.logprobs[0] is None
    for position, entry in enumerate(result.logprobs[1:]):
        assert entry is not None
        expected = reference[position]
        assert math.isclose(entry.logprob, expected[prompt_ids[position + 1]].item(), abs_tol=1e-4)
        top_values, top_ids = expected.topk(TOP)
        assert [token for token, _ in entry.top] == top_ids.tolist()
        for (_, value), want in zip(entry.top, top_values.tolist(), strict=True):
            assert math.isclose(value, want, abs_tol=1e-4)
        assert len(entry.top_text) == TOP


@pytest.mark.parametrize("max_new_tokens", [0, 6])
async def test_prompt_logprobs_equal_a_full_forward_pass(
    tiny_model_dir: Path, make_engine: Any, max_new_tokens: int
) -> None:
    reference_model, _ = load(tiny_model_dir)
    engine = await make_engine(tiny_model_dir, max_batch_tokens=CHUNK)
    rng = random.Random(7)
    lengths = [1, 2, 9, 31, CHUNK + 1, 3 * CHUNK + 5]  # one token (nothing to score), and over the chunk
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in lengths]
    params = greedy(max_new_tokens, ignore_eos=True, prompt_logprobs=TOP)
    streams = [engine.submit(EngineRequest(f"p{i}", input_ids=p, params=params)) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(collect(stream) for stream in streams))
    for prompt, deltas in zip(prompts, results, strict=True):
        check_against_reference(prompt, scored(deltas), reference_scores(reference_model, prompt))
        assert len(tokens_of(deltas)) == max_new_tokens
        assert deltas[-1].finish_reason == "length"


async def test_asking_for_prompt_logprobs_leaves_the_output_unchanged(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir, max_batch_tokens=CHUNK)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (5, 40, 77)]

    async def run(prompt_logprobs: int | None) -> list[list[int]]:
        params = greedy(12, ignore_eos=True, prompt_logprobs=prompt_logprobs)
        streams = [
            engine.submit(EngineRequest(f"r{prompt_logprobs}-{i}", input_ids=p, params=params))
            for i, p in enumerate(prompts)
        ]
        return [tokens_of(deltas) for deltas in await asyncio.gather(*(collect(s) for s in streams))]

    plain = await run(None)
    assert await run(0) == plain
    assert all(len(tokens) == 12 for tokens in plain)


async def test_zero_alternatives_and_text(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load(llama_dir)
    engine = await make_engine(llama_dir, model=model, tokenizer=tokenizer)
    deltas = await collect(engine.submit(EngineRequest("t", prompt="hello world", params=greedy(0, prompt_logprobs=0))))
    result = scored(deltas)
    assert result.token_ids == tokenizer("hello world")["input_ids"]
    assert result.texts == [tokenizer.decode([token]) for token in result.token_ids]
    assert all(entry is not None and entry.top == [] for entry in result.logprobs[1:])
    assert tokens_of(deltas) == [] and deltas[-1].prompt_tokens == len(result.token_ids)


async def test_a_resumed_request_does_not_score_its_prompt_again(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    resume = Resume(token_ids=[5, 6], text="")
    request = EngineRequest("resumed", input_ids=[3, 4, 7], params=greedy(4, prompt_logprobs=1), resume=resume)
    deltas = await collect(engine.submit(request))
    assert all(delta.prompt is None for delta in deltas)
    assert len(tokens_of(deltas)) == 2


async def test_zero_new_tokens_needs_prompt_logprobs(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    with pytest.raises(RequestRejected) as info:
        engine.submit(EngineRequest("z", input_ids=[3, 4], params=greedy(0)))
    assert info.value.param == "params.max_new_tokens"
    with pytest.raises(RequestRejected) as info:
        engine.submit(EngineRequest("k", input_ids=[3, 4], params=greedy(1, prompt_logprobs=21)))
    assert info.value.param == "params.prompt_logprobs"


async def test_a_prompt_in_the_prefix_cache_is_still_scored_in_full(llama_dir: Path, make_engine: Any) -> None:
    """A prefix-cache hit skips positions the scores need: a prompt being scored is never matched."""
    reference_model, _ = load(llama_dir)
    engine = await make_engine(llama_dir, prefix_sharing=True, page_size=16)
    rng = random.Random(11)
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(70)]
    await collect(engine.submit(EngineRequest("warm", input_ids=prompt, params=greedy(2))))  # fills the cache
    hits = engine.stats().prefix_cache_hits
    deltas = await collect(
        engine.submit(EngineRequest("again", input_ids=prompt, params=greedy(2, prompt_logprobs=TOP)))
    )
    check_against_reference(prompt, scored(deltas), reference_scores(reference_model, prompt))
    assert engine.stats().prefix_cache_hits == hits
    await collect(engine.submit(EngineRequest("plain", input_ids=prompt, params=greedy(2))))
    assert (engine.stats().prefix_cache_hits or 0) > (hits or 0)  # the prompt was in the cache all along


async def test_a_prompt_that_cannot_be_scored_fails_alone(
    llama_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await make_engine(llama_dir)

    def broken(self: PromptScores, logits: torch.Tensor, positions: range) -> None:
        raise RuntimeError("no scores today")

    monkeypatch.setattr(PromptScores, "add", broken)
    other = engine.submit(EngineRequest("other", input_ids=[3, 4, 5], params=greedy(8, ignore_eos=True)))
    scored_stream = engine.submit(EngineRequest("scored", input_ids=[3, 4, 5, 6], params=greedy(8, prompt_logprobs=1)))
    with pytest.raises(EngineError, match="could not be scored: RuntimeError: no scores today"):
        await collect(scored_stream)
    assert len(tokens_of(await collect(other))) == 8
    assert engine.alive and engine.stats().restarts == 0


def test_a_step_plans_the_rows_of_each_scored_chunk() -> None:
    a = PromptScores(list(range(8)), top=0)  # nothing scored yet
    c = PromptScores(list(range(7)), top=0)
    c.scores = [(-1.0, [])] * 3  # positions 0-2 scored by earlier chunks
    chunks = [("a", 0, 5), ("b", 10, 1), ("c", 3, 4)]  # batch rows 0-4, 5, 6-9
    planned = prompt_scores.plan(chunks, {"a": a, "c": c})
    assert [(p.scores, p.first_row, p.positions) for p in planned] == [(a, 0, range(0, 5)), (c, 6, range(3, 6))]
    assert prompt_scores.rows(planned) == [0, 1, 2, 3, 4, 6, 7, 8]  # c's last position predicts no prompt token
    gap = PromptScores(list(range(9)), top=0)
    assert prompt_scores.plan([("g", 4, 3)], {"g": gap}) == []  # positions 0-3 never ran: it cannot be scored
    assert gap.failed is not None and not gap.complete
