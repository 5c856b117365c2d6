"""Every error status through the real SDK (or raw HTTP where the SDK cannot send it), in OpenAI's shape."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from client import AsyncClient
from tests.polling import wait_until

HI = [{"role": "user", "content": "hi"}]


def assert_openai_error(error: openai.APIStatusError, status: int, code: str, param: str | None = None) -> None:
    assert error.status_code == status, error
    body = error.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert (body["code"], body["param"]) == (code, param), body


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 17}, "n"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # the legacy form of `tools`
        ({"service_tier": "scale"}, "service_tier"),
        ({"temperature": 1000}, "temperature"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
    ],
)
async def test_unsupported_fields_are_400_naming_the_field(
    gateway: Any, start_worker: Any, extra: dict[str, Any], param: str
) -> None:
    await start_worker()
    served = await gateway()
    model = await served.model()
    with pytest.raises(openai.BadRequestError) as caught:
        await served.sdk().chat.completions.create(model=model, messages=HI, max_tokens=2, **extra)
    assert_openai_error(caught.value, 400, "invalid_request", param)
    assert caught.value.param == param


async def test_request_errors(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway(max_body_bytes=4096, max_new_tokens=100)
    model = await served.model()
    sdk = served.sdk()
    with pytest.raises(openai.NotFoundError) as not_found:
        await sdk.chat.completions.create(model="no-such-model", messages=HI)
    assert_openai_error(not_found.value, 404, "model_not_found", "model")
    assert model in not_found.value.message  # says what is served

    with pytest.raises(openai.BadRequestError) as over_limit:  # the gateway's client limits
        await sdk.completions.create(model=model, prompt="hi", max_tokens=101)
    assert_openai_error(over_limit.value, 400, "invalid_request", "max_tokens")

    for stream in (False, True):  # refused by the worker (over the model's context): 400 before any byte
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.completions.create(model=model, prompt="x" * 500, max_tokens=50, stream=stream)
        assert_openai_error(refused.value, 400, "invalid_request")
        assert "context" in refused.value.message

    with pytest.raises(openai.APIStatusError) as too_large:
        await sdk.completions.create(model=model, prompt="x" * 5000, max_tokens=2)
    assert_openai_error(too_large.value, 413, "request_too_large")

    async with served.http() as http:
        bad_json = await http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
        no_model = await http.post("/v1/chat/completions", json={"messages": HI})
        bad_header = await http.post(
            "/v1/completions", json={"model": model, "prompt": "hi"}, headers={"X-Request-Timeout": "soon"}
        )
        wrong_method = await http.get("/v1/chat/completions")
        no_route = await http.get("/v2/anything")
    assert (bad_json.status_code, bad_json.json()["error"]["code"]) == (400, "invalid_json")
    assert (no_model.status_code, no_model.json()["error"]["param"]) == (400, "model")
    assert (bad_header.status_code, bad_header.json()["error"]["param"]) == (400, "X-Request-Timeout")
    assert (wrong_method.status_code, wrong_method.json()["error"]["code"]) == (405, "method_not_allowed")
    assert (no_route.status_code, no_route.json()["error"]["code"]) == (404, "not_found")


async def test_full_queue_is_429_with_retry_after(gateway: Any, redis_url: str) -> None:
    served = await gateway(max_queue_len=1, retry_after_s=3)
    async with AsyncClient(redis_url) as direct:
        await direct.submit("waiting", max_new_tokens=2)  # no worker: it stays queued
    with pytest.raises(openai.RateLimitError) as caught:  # the queue's name is a model id too
        await served.sdk().chat.completions.create(model="default", messages=HI, max_tokens=2)
    assert_openai_error(caught.value, 429, "queue_full")
    assert caught.value.response.headers["retry-after"] == "3"
    assert caught.value.response.headers["x-should-retry"] == "true"  # nothing was queued


async def test_timeout_header_is_408_and_leaves_nothing_queued_to_run(gateway: Any, redis_url: str) -> None:
    served = await gateway()
    sdk = served.sdk()
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as caught:
            await sdk.completions.create(
                model="default", prompt="hi", max_tokens=2, stream=stream, extra_headers={"X-Request-Timeout": "0.2"}
            )
        assert_openai_error(caught.value, 408, "timeout")
        assert "cancelled" in caught.value.message
        assert caught.value.response.headers["x-should-retry"] == "false"


async def test_a_request_timed_out_in_the_queue_is_never_generated(
    gateway: Any, start_worker: Any, redis_url: str
) -> None:
    running = await start_worker(max_running=1, step_s=0.005)
    served = await gateway()
    model = await served.model()
    sdk = served.sdk()
    busy = asyncio.create_task(sdk.completions.create(model=model, prompt="busy", max_tokens=100))
    await wait_until(lambda: running.worker.engine.stats().running == 1)
    with pytest.raises(openai.APIStatusError) as caught:  # queued behind `busy` (one slot) past its timeout
        await sdk.completions.create(
            model=model, prompt="late", max_tokens=2, extra_headers={"X-Request-Timeout": "0.1"}
        )
    assert caught.value.status_code == 408
    assert (await busy).choices[0].finish_reason == "length"
    async with AsyncClient(redis_url) as direct:

        async def drained() -> bool:
            return (await direct.status()).depth == 0

        await wait_until(drained)
    assert sum(running.worker.engine.stats().requests_finished.values()) == 1  # only `busy` ran


async def test_a_poisoned_request_is_500(gateway: Any, start_worker: Any) -> None:
    running = await start_worker(max_engine_failures=1, step_s=0.02)
    served = await gateway()
    model = await served.model()
    answer = asyncio.create_task(served.sdk().completions.create(model=model, prompt="boom", max_tokens=200))
    await wait_until(lambda: running.worker.engine.stats().running == 1)
    running.worker.engine.fail_next_step()
    with pytest.raises(openai.InternalServerError) as caught:
        await answer
    assert_openai_error(caught.value, 500, "poison_request")
    assert caught.value.response.headers["x-should-retry"] == "false"  # a retry would kill another engine
