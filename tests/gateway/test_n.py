"""`n` > 1 through the real `openai` SDK (sync and async, streamed and whole): one call is `n` queued requests,
choice `i` seeded `seed + i`, so a sampled call's choices are what `n` seeded calls give (on a tiny random
model); streams interleave the choices by `index`, usage counts the prompt once; a disconnect, a timeout or an
error in one choice stops them all; an `Idempotency-Key` names the same `n` generations. Generations are counted
by the submit script's idempotency markers (`submitted`) and the worker's finishes."""

from __future__ import annotations

import asyncio
import json
import math
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob
from client.openai_format import MAX_N
from tests.gateway.test_retry_safety import HI, KEYS, submitted
from tests.polling import wait_until

PROMPT = "The quick brown fox"


@pytest.fixture
async def sdks() -> AsyncIterator[Callable[[Any], tuple[openai.AsyncOpenAI, openai.OpenAI]]]:
    """`sdks(served)`: the SDK, async and sync (call the sync one through `asyncio.to_thread`), closed after."""
    made: list[tuple[openai.AsyncOpenAI, openai.OpenAI]] = []

    def make(served: Any) -> tuple[openai.AsyncOpenAI, openai.OpenAI]:
        made.append((served.sdk(), served.sync_sdk()))
        return made[-1]

    yield make
    for async_sdk, sync_sdk in made:
        await async_sdk.close()
        sync_sdk.close()


def joined(chunks: list[Any], chat: bool = True) -> dict[int, str]:
    """Each choice's streamed text, by index."""
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if chat else choice.text
    return dict(texts)


async def test_sampled_choices_are_the_seeded_calls_they_stand_for(gateway: Any, start_worker: Any, sdks: Any) -> None:
    await start_worker(real_model=True)
    served = await gateway()
    model, (sdk, sync) = await served.model(), sdks(served)
    sampled = {"model": model, "messages": HI, "max_tokens": 8, "temperature": 1.0}
    whole = await sdk.chat.completions.create(**sampled, n=3, seed=5)
    alone = [await sdk.chat.completions.create(**sampled, seed=5 + i) for i in range(3)]
    texts = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert texts == [a.choices[0].message.content for a in alone]
    assert len(set(texts)) > 1  # sampled with their own seeds: not one answer three times
    assert whole.usage is not None and alone[0].usage is not None
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt counted once
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone if a.usage)

    def stream_sync() -> list[Any]:  # in a thread: the gateway runs on this loop
        return list(sync.chat.completions.create(**sampled, n=3, seed=5, stream=True))

    assert joined(await asyncio.to_thread(stream_sync)) == dict(enumerate(texts))

    greedy = await asyncio.to_thread(
        sync.completions.create, model=model, prompt=PROMPT, max_tokens=6, temperature=0, n=3
    )
    assert len({c.text for c in greedy.choices}) == 1 and [c.index for c in greedy.choices] == [0, 1, 2]


async def test_echo_and_logprobs_come_with_every_choice(gateway: Any, start_worker: Any, sdks: Any) -> None:
    await start_worker(real_model=True)
    served = await gateway()
    model, (sdk, _) = await served.model(), sdks(served)
    asked = {"model": model, "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1, "seed": 3}
    whole = await sdk.completions.create(**asked, n=2, temperature=1.0)
    alone = await sdk.completions.create(**asked, temperature=1.0)
    assert whole.usage is not None and alone.usage is not None
    prompt_tokens = alone.usage.prompt_tokens
    for choice in whole.choices:
        assert choice.text.startswith(PROMPT) and choice.logprobs is not None
        tokens = choice.logprobs.tokens or []
        assert len(tokens) == prompt_tokens + 3 and choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset or [])
    assert whole.choices[0].text == alone.choices[0].text  # choice 0 is the call seeded 3
    ours, theirs = whole.choices[0].logprobs, alone.choices[0].logprobs
    assert ours is not None and theirs is not None and ours.tokens == theirs.tokens
    scores = zip((ours.token_logprobs or [])[1:], (theirs.token_logprobs or [])[1:], strict=True)
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in scores)  # batched with another: float noise alone
    stream = await sdk.completions.create(**asked, n=2, temperature=1.0, stream=True)
    chunks = [chunk async for chunk in stream]
    assert joined(chunks, chat=False) == {c.index: c.text for c in whole.choices}
    for index, choice in enumerate(whole.choices):
        streamed = [t for c in chunks for s in c.choices if s.index == index and s.logprobs for t in s.logprobs.tokens]
        assert choice.logprobs is not None and streamed == choice.logprobs.tokens


@pytest.mark.parametrize("sync", [False, True])
async def test_a_stream_of_three_has_every_index_and_the_summed_usage(
    gateway: Any, start_worker: Any, sync: bool, sdks: Any
) -> None:
    await start_worker()
    served = await gateway()
    model = await served.model()
    asked = {"model": model, "messages": HI, "max_tokens": 4, "stream": True}
    asked |= {"stream_options": {"include_usage": True}}
    aio, threaded = sdks(served)
    if sync:
        client = threaded
        chunks = await asyncio.to_thread(lambda: list(client.chat.completions.create(**asked, n=3)))
        one = await asyncio.to_thread(lambda: list(client.chat.completions.create(**asked)))
    else:
        chunks = [chunk async for chunk in await aio.chat.completions.create(**asked, n=3)]
        one = [chunk async for chunk in await aio.chat.completions.create(**asked)]
    choices = [choice for chunk in chunks for choice in chunk.choices]
    assert {choice.index for choice in choices} == {0, 1, 2}
    assert sorted(c.index for c in choices if c.finish_reason) == [0, 1, 2]
    assert sorted(c.index for c in choices if c.delta.role == "assistant") == [0, 1, 2]  # each choice's first
    assert len({chunk.id for chunk in chunks}) == 1
    texts = joined(chunks)
    assert texts[0] == texts[1] == texts[2] == joined(one)[0]  # the scripted engine ignores seeds
    last, single = chunks[-1], one[-1]
    assert last.choices == [] and last.usage is not None and single.usage is not None
    assert last.usage.prompt_tokens == single.usage.prompt_tokens
    assert last.usage.completion_tokens == 3 * single.usage.completion_tokens == 12
    assert all(chunk.usage is None for chunk in chunks[:-1])


async def test_a_client_gone_mid_stream_cancels_every_choice(gateway: Any, start_worker: Any) -> None:
    running = await start_worker(step_s=0.01)
    served = await gateway()
    model = await served.model()
    body = {"model": model, "prompt": "hi", "max_tokens": 400, "n": 3, "stream": True}
    async with served.http() as http, http.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        seen: set[int] = set()
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                seen |= {choice["index"] for choice in json.loads(line.removeprefix("data: "))["choices"]}
            if len(seen) == 3:
                break
    await wait_until(lambda: running.worker.engine.stats().requests_finished == {"cancelled": 3})


async def test_a_timeout_cancels_every_choice(gateway: Any, redis_url: str, sdks: Any) -> None:
    served = await gateway()  # no worker: the requests wait in the queue past their timeout
    before = await submitted(redis_url)
    with pytest.raises(openai.APIStatusError) as caught:
        await sdks(served)[0].chat.completions.create(
            model="default", messages=HI, max_tokens=2, n=2, extra_headers={"X-Request-Timeout": "0.2"}
        )
    assert caught.value.status_code == 408
    request_id = caught.value.response.headers["x-request-id"]
    assert await submitted(redis_url) - before == {f"{request_id}-0", f"{request_id}-1"}
    async with Redis.from_url(redis_url) as redis:
        assert await redis.exists(KEYS.cancel(f"{request_id}-0"), KEYS.cancel(f"{request_id}-1")) == 2


async def test_a_queue_without_room_for_every_choice_takes_none(gateway: Any, redis_url: str, sdks: Any) -> None:
    served = await gateway(max_queue_len=2)  # no worker: three choices do not fit in a backlog of two
    before = await submitted(redis_url)
    with pytest.raises(openai.RateLimitError) as caught:
        await sdks(served)[0].chat.completions.create(model="default", messages=HI, max_tokens=2, n=3)
    assert caught.value.response.headers["x-should-retry"] == "true"  # nothing runs: a retry is safe
    assert await submitted(redis_url) == before  # all or nothing: not one choice went in


async def test_one_cancelled_choice_is_the_calls_error_and_stops_the_others(
    gateway: Any, start_worker: Any, redis_url: str, sdks: Any
) -> None:
    running = await start_worker(step_s=0.01)
    served = await gateway()
    model = await served.model()
    before = await submitted(redis_url)
    waiting = asyncio.ensure_future(
        sdks(served)[0].chat.completions.create(model=model, messages=HI, max_tokens=400, n=2)
    )
    found: list[str] = []

    async def both_submitted() -> bool:
        found[:] = sorted(await submitted(redis_url) - before)
        return len(found) == 2

    await wait_until(both_submitted)
    await wait_until(lambda: running.worker.engine.stats().running == 2)
    async with AsyncClient(redis_url) as direct:
        await AsyncJob.attach(direct, found[1]).cancel()  # what `llmq cancel <id>-1` does
    with pytest.raises(openai.ConflictError) as caught:
        await waiting
    assert caught.value.response.headers["x-request-id"] == found[0].removesuffix("-0")
    await wait_until(lambda: running.worker.engine.stats().requests_finished == {"cancelled": 2})


async def test_one_choice_cancelled_mid_stream_is_an_error_event_and_stops_the_others(
    gateway: Any, start_worker: Any, redis_url: str, sdks: Any
) -> None:
    running = await start_worker(step_s=0.01)
    served = await gateway()
    model = await served.model()
    stream = await sdks(served)[0].chat.completions.create(model=model, messages=HI, max_tokens=400, n=2, stream=True)
    seen = 0
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            seen += 1
            if seen == 4:  # the headers and both choices' first chunks are out: the error can only be an event
                async with AsyncClient(redis_url) as direct:
                    await AsyncJob.attach(direct, f"{chunk.id}-1").cancel()
    assert "cancel" in str(caught.value).lower()
    await wait_until(lambda: running.worker.engine.stats().requests_finished == {"cancelled": 2})


@pytest.mark.parametrize("stream", [False, True])
async def test_more_than_the_bound_or_best_of_is_400_by_name(
    gateway: Any, start_worker: Any, stream: bool, sdks: Any
) -> None:
    await start_worker()
    served = await gateway()
    model, (sdk, _) = await served.model(), sdks(served)
    calls = [
        (sdk.chat.completions.create(model=model, messages=HI, n=MAX_N + 1, stream=stream), "n"),
        (sdk.completions.create(model=model, prompt="hi", n=MAX_N + 1, stream=stream), "n"),
        (sdk.completions.create(model=model, prompt="hi", n=2, best_of=2, stream=stream), "best_of"),
    ]
    for call, param in calls:
        with pytest.raises(openai.BadRequestError) as caught:
            await call
        assert caught.value.param == param


async def test_an_idempotency_key_names_the_same_n_generations(
    gateway: Any, start_worker: Any, redis_url: str, sdks: Any
) -> None:
    running = await start_worker()
    served = await gateway()
    model, (sdk, sync) = await served.model(), sdks(served)
    before = await submitted(redis_url)
    asked = {"model": model, "messages": HI, "max_tokens": 5, "n": 2, "extra_headers": {"Idempotency-Key": "n-2"}}
    first = await sdk.chat.completions.create(**asked)
    again = await asyncio.to_thread(lambda: sync.chat.completions.create(**asked))
    streamed = [chunk async for chunk in await sdk.chat.completions.create(**asked, stream=True)]
    assert again.id == first.id and {c.id for c in streamed} == {first.id}
    texts = {c.index: c.message.content for c in first.choices}
    assert {c.index: c.message.content for c in again.choices} == texts == joined(streamed)
    assert await submitted(redis_url) - before == {f"{first.id}-0", f"{first.id}-1"}
    assert running.worker.engine.stats().requests_finished == {"length": 2}  # 2 generations, not 4 or 6
