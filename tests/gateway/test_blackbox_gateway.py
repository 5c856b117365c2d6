"""Black-box checks of the README's gateway promises (logprobs, response_format, service_tier, no-op-only
fields) through the real `openai` SDK, a real Redis and a real worker on a tiny random model."""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest

QUESTION = [{"role": "user", "content": "Say something."}]


async def test_chat_features_through_the_sdk(gateway: Any, start_worker: Any) -> None:
    await start_worker(real_model=True)
    served = await gateway()
    model = await served.model()
    sdk = served.sdk()

    answer = await sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0.7,
                                               seed=5, logprobs=True, top_logprobs=2)
    assert answer.usage is not None
    content = answer.choices[0].logprobs.content
    assert content is not None and len(content) == answer.usage.completion_tokens > 0
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-5
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content

    stream = await sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0.7,
                                               seed=5, logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for chunk in [c async for c in stream] if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]

    for tier in ("flex", "priority", "auto", "default"):
        tiered = await sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0,
                                                   service_tier=tier)
        assert tiered.choices[0].message.content is not None and tiered.usage.completion_tokens > 0


async def test_json_object_output_is_a_json_object(gateway: Any, start_worker: Any) -> None:
    await start_worker(real_model=True)
    served = await gateway()
    model = await served.model()
    shaped = await served.sdk().chat.completions.create(model=model, messages=QUESTION, max_tokens=96,
                                                        temperature=0, response_format={"type": "json_object"})
    assert shaped.choices[0].finish_reason == "stop"
    parsed = json.loads(shaped.choices[0].message.content or "")  # README: the output always parses
    assert isinstance(parsed, dict), f"json_object gave {shaped.choices[0].message.content!r}"  # OpenAI: an object


@pytest.mark.parametrize(("field", "value"), [("n", 17), ("logit_bias", {"5": 1}), ("best_of", 2)])
async def test_non_noop_openai_fields_are_400_naming_the_field(gateway: Any, start_worker: Any, field: str,
                                                               value: Any) -> None:
    await start_worker()
    served = await gateway()
    model = await served.model()
    create = served.sdk().completions.create if field == "best_of" else served.sdk().chat.completions.create
    inputs = {"prompt": "Hi"} if field == "best_of" else {"messages": QUESTION}
    with pytest.raises(openai.BadRequestError) as caught:
        await create(model=model, max_tokens=4, **inputs, **{field: value})
    assert caught.value.status_code == 400 and caught.value.param == field
    assert field in str(caught.value)


async def test_bad_values_are_400(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway()
    model = await served.model()
    sdk = served.sdk()
    for extra, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"presence_penalty": 3}, "presence_penalty"),
                         ({"response_format": {"type": "xml"}}, "response_format"),
                         ({"service_tier": "ultra"}, "service_tier"),
                         ({"extra_body": {"not_a_field": 1}}, "not_a_field")):
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, **extra)
        assert caught.value.param is not None and param in caught.value.param, (extra, caught.value.param)
