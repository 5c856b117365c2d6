"""`echo` with prompt logprobs on `/v1/completions`, through the real `openai` SDK (sync and async, streamed and
whole) against a worker on a tiny random model: the prompt's scores are a plain forward pass's."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import openai
import pytest

from client import AsyncClient
from testing.scripted_engine import expected_tokens, text_of
from tests.engine.conftest import load
from tests.engine.test_prompt_logprobs import reference_scores

PROMPT = "The quick brown fox jumps over"
TOP = 2


def check_prompt_scores(logprobs: Any, ids: list[int], reference: Any) -> None:
    """The first `len(ids)` entries of a completion's `logprobs` score the prompt as the forward pass does."""
    count = len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    assert "".join(logprobs.tokens[:count]) == PROMPT
    assert all(PROMPT.startswith(t, o) for t, o in zip(logprobs.tokens[:count], logprobs.text_offset, strict=False))
    for position in range(1, count):
        expected = reference[position - 1]
        assert math.isclose(logprobs.token_logprobs[position], expected[ids[position]].item(), abs_tol=1e-4)
        top = sorted(logprobs.top_logprobs[position].values(), reverse=True)
        assert len(top) == TOP
        for got, want in zip(top, expected.topk(TOP).values.tolist(), strict=True):
            assert math.isclose(got, want, abs_tol=1e-4)


async def test_echo_scores_the_prompt_as_a_forward_pass(
    gateway: Any, start_worker: Any, redis_url: str, model_dir: Path
) -> None:
    await start_worker(real_model=True)
    served = await gateway()
    model, sdk, sync = await served.model(), served.sdk(), served.sync_sdk()
    async with AsyncClient(redis_url) as direct:
        job = await direct.submit(prompt=PROMPT, max_new_tokens=0, prompt_logprobs=TOP)
        ids = (await job.result(timeout=60)).prompt_token_ids
        generated = await direct.generate(PROMPT, max_new_tokens=4, temperature=0, timeout=60)
    assert ids is not None and len(ids) > 3
    reference = reference_scores(load(model_dir)[0], ids)

    scored = await sdk.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=TOP, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage is not None and (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == len(ids)
    check_prompt_scores(choice.logprobs, ids, reference)

    by_ids = await asyncio.to_thread(
        sync.completions.create, model=model, prompt=ids, echo=True, logprobs=TOP, max_tokens=0
    )
    assert by_ids.choices[0].text == PROMPT  # a token-id prompt echoes its tokens' texts
    check_prompt_scores(by_ids.choices[0].logprobs, ids, reference)
    streamed_ids = [
        c
        async for c in await sdk.completions.create(
            model=model, prompt=ids, echo=True, logprobs=TOP, max_tokens=2, temperature=0, stream=True
        )
    ]
    assert streamed_ids[0].choices[0].text == PROMPT  # streamed too: the first chunk has the tokens' texts
    check_prompt_scores(streamed_ids[0].choices[0].logprobs, ids, reference)

    more: dict[str, Any] = {"echo": True, "logprobs": TOP, "max_tokens": 4, "temperature": 0}
    with_answer = await asyncio.to_thread(sync.completions.create, model=model, prompt=PROMPT, **more)
    logprobs = with_answer.choices[0].logprobs
    assert with_answer.choices[0].text == PROMPT + generated.text
    assert logprobs is not None and len(logprobs.tokens or []) == len(ids) + len(generated.token_ids)
    check_prompt_scores(logprobs, ids, reference)
    assert logprobs.text_offset is not None and logprobs.text_offset[len(ids)] == len(PROMPT)

    stream = await sdk.completions.create(model=model, prompt=PROMPT, stream=True, **more)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].text == PROMPT  # the prompt comes first, with its scores
    assert chunks[0].choices[0].logprobs is not None and len(chunks[0].choices[0].logprobs.tokens or []) == len(ids)
    check_prompt_scores(chunks[0].choices[0].logprobs, ids, reference)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + generated.text
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.tokens]
    assert streamed == logprobs.tokens

    def stream_sync() -> list[Any]:  # in a thread: the gateway runs on this loop
        return list(sync.completions.create(model=model, prompt=PROMPT, stream=True, echo=True, max_tokens=0))

    pieces = await asyncio.to_thread(stream_sync)
    assert pieces[0].choices[0].text == PROMPT and pieces[0].choices[0].logprobs is None  # no logprobs asked
    assert "".join(c.choices[0].text for c in pieces if c.choices) == PROMPT
    assert pieces[-1].choices[0].finish_reason == "length"


async def test_echo_is_refused_by_name_where_it_cannot_be_honoured(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway()
    model, sdk = await served.model(), served.sdk()
    plain = await sdk.completions.create(model=model, prompt="hi", max_tokens=2, echo=False)
    assert plain.choices[0].text == "".join(text_of(t) for t in expected_tokens(list(b"hi"), 2))  # the no-op
    messages: Any = [{"role": "user", "content": "hi"}]
    for call, param in (
        (sdk.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body={"echo": True}), "echo"),
        (sdk.completions.create(model=model, prompt="hi", max_tokens=0), "max_tokens"),  # only an echo may be empty
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            await call
        assert caught.value.param == param
        assert caught.value.response.headers["x-should-retry"] == "false"
