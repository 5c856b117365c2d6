"""The real `openai` SDK, sync and async, streaming and not, against the gateway: the same answers as the
Python client, with the right usage."""

from __future__ import annotations

import asyncio
from typing import Any

from client import AsyncClient
from testing.scripted_engine import expected_tokens, text_of

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def test_greedy_text_equals_the_direct_clients_on_a_real_model(
    gateway: Any, start_worker: Any, redis_url: str
) -> None:
    await start_worker(real_model=True)
    served = await gateway()
    model = await served.model()
    async with AsyncClient(redis_url) as direct:
        chat = await direct.generate(messages=QUESTION, max_new_tokens=12, temperature=0, timeout=60)
        text = await direct.generate("The quick brown fox", max_new_tokens=12, temperature=0, timeout=60)
    assert chat.token_ids and text.token_ids

    sdk = served.sdk()
    whole = await sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == chat.text and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == ("length" if chat.finish_reason == "length" else "stop")
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        chat.usage.prompt_tokens,
        len(chat.token_ids),
    )
    assert whole.usage.total_tokens == chat.usage.prompt_tokens + len(chat.token_ids)

    stream = await sdk.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(chat.token_ids)
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens

    sync = served.sync_sdk()
    completion = await asyncio.to_thread(
        sync.completions.create, model=model, prompt="The quick brown fox", max_tokens=12, temperature=0
    )
    assert completion.choices[0].text == text.text
    assert completion.usage is not None and completion.usage.completion_tokens == len(text.token_ids)

    def stream_sync() -> str:
        pieces = sync.completions.create(
            model=model, prompt="The quick brown fox", max_tokens=12, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in pieces if c.choices)

    assert await asyncio.to_thread(stream_sync) == text.text

    stop = text.text[len(text.text) // 2 :][:3]  # a piece from the middle: generation ends before it
    async with AsyncClient(redis_url) as direct:
        stopped = await direct.generate(
            "The quick brown fox", max_new_tokens=12, temperature=0, stop=[stop], timeout=60
        )
    answer = await sdk.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=12, temperature=0, stop=stop
    )
    assert answer.choices[0].text == stopped.text and len(stopped.text) < len(text.text)


async def test_streams_end_with_a_finish_reason_and_usage_only_when_asked(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway()
    model = await served.model()
    expected = "".join(text_of(t) for t in expected_tokens(list(b"hello"), 6))
    sdk = served.sdk()

    stream = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=6, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks) and len({c.id for c in chunks}) == 1

    stream = await sdk.completions.create(
        model=model, prompt="hello", max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 6)


async def test_raw_sse_ends_with_done_and_carries_the_request_id(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway()
    model = await served.model()
    body = {"model": model, "prompt": "hi", "max_tokens": 3, "stream": True}
    async with served.http() as http:
        response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert response.headers["x-request-id"] in events[0]


async def test_parameters_pass_through(gateway: Any, start_worker: Any) -> None:
    """`seed`, `user` and `top_k` are accepted, every `service_tier` runs in its lane (the scripted engine ignores
    sampling; `stop` is checked on the real model)."""
    await start_worker()
    served = await gateway()
    model = await served.model()
    tokens = [text_of(t) for t in expected_tokens(list(b"hi"), 6)]
    sdk = served.sdk()
    answer = await sdk.completions.create(
        model=model, prompt="hi", max_tokens=6, seed=7, user="alice", extra_body={"top_k": 5}
    )
    assert answer.choices[0].text == "".join(tokens) and answer.choices[0].finish_reason == "length"
    for tier in ("auto", "default", "priority", "flex"):
        chat = await sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            service_tier=tier,
        )
        assert chat.choices[0].message.content == "".join(tokens[:2])


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


async def test_logprobs_and_a_json_schema_through_the_sdk(gateway: Any, start_worker: Any, redis_url: str) -> None:
    import json

    import jsonschema  # type: ignore[import-untyped]

    await start_worker(real_model=True)
    served = await gateway()
    model, sdk = await served.model(), served.sdk()
    async with AsyncClient(redis_url) as direct:
        job = await direct.submit(messages=[*QUESTION], max_new_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
        reference = await job.result(timeout=60)
    assert reference.logprobs is not None
    whole = await sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == [lp.logprob for lp in reference.logprobs]
    assert [c.token for c in content] == [lp.text for lp in reference.logprobs]
    assert all(len(c.top_logprobs) == 2 for c in content)
    stream = await sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        c
        for chunk in [c async for c in stream]
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content or []
    ]
    assert [c.logprob for c in streamed] == [c.logprob for c in content]
    completion = await sdk.completions.create(model=model, prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
    assert completion.choices[0].logprobs is not None
    assert len(completion.choices[0].logprobs.token_logprobs or []) == completion.usage.completion_tokens
    shaped = await sdk.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=60,
        temperature=0.7,
        seed=5,
        presence_penalty=0.3,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(shaped.choices[0].message.content or ""), SCHEMA)


async def test_fields_sdks_send_by_default_pass_and_the_rest_are_refused_by_name(
    gateway: Any, start_worker: Any
) -> None:
    """What openai-python, LangChain's ChatOpenAI and LiteLLM send when the caller sets nothing more (the table in
    docs/gateway.md), through the SDK, sync and async, streamed and whole."""
    import openai
    import pytest

    await start_worker()
    served = await gateway()
    model = await served.model()
    expected = "".join(text_of(t) for t in expected_tokens(list(b"hi"), 3))
    sdk, sync = served.sdk(), served.sync_sdk()
    defaults: dict[str, Any] = {
        "n": 1,
        "temperature": 0.7,
        "store": False,
        "metadata": {"team": "search"},
        "prompt_cache_key": "conversation-9",
        "safety_identifier": "hashed-user",
        "parallel_tool_calls": False,
        "modalities": ["text"],
        "extra_body": {"prompt_cache_retention": "24h"},
    }
    messages: Any = [{"role": "user", "content": "hi", "name": "alice"}]
    whole = await sdk.chat.completions.create(model=model, messages=messages, max_tokens=3, **defaults)
    assert whole.choices[0].message.content == expected

    def stream_sync() -> str:  # in a thread: the gateway runs on this loop
        stream = sync.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
            **defaults,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert await asyncio.to_thread(stream_sync) == expected
    for refused, param in (({"reasoning_effort": "low"}, "reasoning_effort"), ({"verbosity": "low"}, "verbosity")):
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(model=model, messages=messages, max_tokens=3, **refused)
        assert caught.value.param == param and caught.value.response.headers["x-should-retry"] == "false"


async def test_parse_with_a_pydantic_model_on_a_real_model(gateway: Any, start_worker: Any) -> None:
    """`chat.completions.parse(response_format=Model)`: the strict json_schema the SDK derives is applied."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=8)  # a bounded answer, even from a random model
        sunny: bool

    await start_worker(real_model=True)
    served = await gateway()
    model = await served.model()
    parsed = await served.sdk().chat.completions.parse(
        model=model, messages=QUESTION, max_tokens=200, temperature=0, response_format=City
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
