"""Prompt logprobs through the wire: a real worker scores the prompt, the client assembles it, sync and async."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from redis.asyncio import Redis

from client import AsyncClient, Client, InvalidRequest
from client.protocol import DoneEvent, PromptEvent, TokensEvent, Usage, encode
from worker.engine import LoadOptions, load_model
from worker.intake import _earlier_output

PROMPT = [5, 9, 17, 4, 33, 8, 12, 60, 7, 21, 3, 44]


def reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    model, _ = load_model(str(model_dir), LoadOptions(cache_dir=model_dir / "reference-cache"))
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


async def test_a_request_that_only_scores_its_prompt(start_worker: Any, client: AsyncClient, model_dir: Path) -> None:
    await start_worker(real_model=True)
    job = await client.submit(input_ids=PROMPT, max_new_tokens=0, prompt_logprobs=2)
    deltas = [delta async for delta in job.stream(timeout=60)]
    result = await job.result(timeout=60)
    assert result.token_ids == [] and result.text == "" and result.finish_reason == "length"
    assert result.usage == Usage(prompt_tokens=len(PROMPT), completion_tokens=0)
    assert result.prompt_token_ids == PROMPT
    assert result.prompt_tokens is not None and len(result.prompt_tokens) == len(PROMPT)
    scores = result.prompt_logprobs
    assert scores is not None and len(scores) == len(PROMPT) and scores[0] is None
    expected = reference(model_dir, PROMPT)
    for position, entry in enumerate(scores[1:]):
        assert entry is not None and entry.token_id == PROMPT[position + 1]
        assert entry.text == result.prompt_tokens[position + 1]
        assert math.isclose(entry.logprob, expected[position, entry.token_id].item(), abs_tol=1e-4)
        assert [alt for alt, _, _ in entry.top] == expected[position].topk(2).indices.tolist()
    assert [delta.prompt_logprobs for delta in deltas] == [scores]  # one delta, without tokens


async def test_scoring_the_prompt_leaves_the_output_unchanged_sync_twin(start_worker: Any, redis_url: str) -> None:
    await start_worker(real_model=True)

    def submit_both() -> tuple[Any, Any]:
        with Client(redis_url) as sync:
            options: dict[str, Any] = {"input_ids": PROMPT, "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
            plain = sync.submit(**options).result(timeout=60)
            scored = sync.submit(**options, prompt_logprobs=0).result(timeout=60)
            return plain, scored

    plain, scored = await asyncio.to_thread(submit_both)
    assert scored.token_ids == plain.token_ids and len(plain.token_ids) == 6
    assert plain.prompt_logprobs is None and plain.prompt_token_ids is None
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(PROMPT)
    assert all(entry is None or entry.top == [] for entry in scored.prompt_logprobs)


async def test_bad_prompt_logprobs_are_refused_before_submitting(client: AsyncClient) -> None:
    with pytest.raises(InvalidRequest) as info:
        await client.submit(input_ids=PROMPT, max_new_tokens=0)
    assert info.value.param == "params.max_new_tokens"
    with pytest.raises(InvalidRequest) as info:
        await client.submit(input_ids=PROMPT, prompt_logprobs=21)
    assert info.value.param == "params.prompt_logprobs"


def test_a_resumed_stream_reads_past_the_prompt_event() -> None:
    """The prompt's event is neither output nor an end: a claiming worker resumes after the tokens that follow."""
    prompt = PromptEvent(ids=[1, 2], texts=["a", "b"], logprobs=[None, (-0.5, [])])
    tokens = TokensEvent(seq=0, ids=[7, 8], text="xy")
    entries = [(b"1-0", {b"m": encode(prompt)}), (b"2-0", {b"m": encode(tokens)})]
    assert _earlier_output(entries) == ([7, 8], "xy", False, 2)
    done = DoneEvent(finish_reason="length", usage=Usage(prompt_tokens=2, completion_tokens=0))
    assert _earlier_output([entries[0], (b"3-0", {b"m": encode(done)})])[2] is True
    assert "texts" in msgpack.unpackb(encode(prompt))


async def test_a_request_resumed_on_another_worker_keeps_its_scores_once(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    options: dict[str, Any] = {"input_ids": PROMPT, "max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
    first = await start_worker(real_model=True, drain_timeout_s=0.0)
    job = await client.submit(**options, prompt_logprobs=1)
    seen = 0
    async for delta in job.stream(timeout=60):
        seen += len(delta.token_ids)
        if seen >= 10:
            break
    first.stop.set()  # drains for 0 s: hands the request back after its first tokens
    await asyncio.wait_for(first.task, 30)
    second = await start_worker(real_model=True, claim_interval_s=0.1)
    resumed = await job.result(timeout=120)
    assert second.worker.publisher.stats.tokens > 0  # the second worker generated the rest
    reference = await (await client.submit(**options, prompt_logprobs=1)).result(timeout=120)
    assert resumed.token_ids == reference.token_ids and len(resumed.token_ids) == 120
    assert resumed.prompt_logprobs is not None and reference.prompt_logprobs is not None
    for got, want in zip(resumed.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True):
        assert got is not None and want is not None and got.token_id == want.token_id
        assert math.isclose(got.logprob, want.logprob, abs_tol=1e-4)
    redis = Redis.from_url(redis_url)
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await redis.xrange(job.keys.result(job.id))  # type: ignore[assignment]
    finally:
        await redis.aclose()
    kinds = [msgpack.unpackb(fields[b"m"])["type"] for _, fields in entries]
    assert kinds.count("prompt") == 1 and kinds[0] == "prompt"  # the second worker did not score it again
