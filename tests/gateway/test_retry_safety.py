"""Retries never start a second generation: through the real `openai` SDK with its default `max_retries=2`,
errors say `x-should-retry`, an `Idempotency-Key` names one generation, and every answer carries
`X-Request-Id`. Generations are counted by the submit script's idempotency markers (one per request added)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from client import AsyncClient, AsyncJob
from client.protocol import ENTRY_FIELD, decode_request, ms_now
from client.store import Keys
from gateway.auth import APIKeyMiddleware
from gateway.request_ids import RequestIdMiddleware
from tests.polling import wait_until

HI = [{"role": "user", "content": "hi"}]
KEYS = Keys("default")


@pytest.fixture
async def sdk() -> AsyncIterator[Callable[..., Any]]:
    """`sdk(served, sync=False, api_key="unused")`: the SDK as callers use it, with its default retries (2) and
    backoff; closed after the test."""
    made: list[openai.OpenAI | openai.AsyncOpenAI] = []

    def make(served: Any, *, sync: bool = False, api_key: str = "unused") -> Any:
        kind = openai.OpenAI if sync else openai.AsyncOpenAI
        made.append(kind(base_url=f"{served.url}/v1", api_key=api_key))
        return made[-1]

    yield make
    for client in made:
        if isinstance(client, openai.AsyncOpenAI):
            await client.close()
        else:
            client.close()


async def submitted(redis_url: str) -> set[str]:
    """The ids of every request added to the queue so far (each submit that added one set its marker)."""
    prefix = KEYS.submitted("")
    async with Redis.from_url(redis_url) as redis:
        return {key.decode().removeprefix(prefix) async for key in redis.scan_iter(match=KEYS.submitted("*"))}


async def new_id(redis_url: str, before: set[str]) -> str:
    """The one request submitted since `before`, once it is there."""
    found: list[str] = []

    async def appeared() -> bool:
        found[:] = sorted(await submitted(redis_url) - before)
        return bool(found)

    await wait_until(appeared)
    (request_id,) = found
    return request_id


def assert_no_retry(error: openai.APIStatusError, status: int, code: str) -> None:
    assert (error.status_code, error.code) == (status, code), error
    assert error.response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("sync", [False, True])
async def test_a_cancelled_whole_answer_is_a_conflict_with_one_generation(
    gateway: Any, start_worker: Any, redis_url: str, sdk: Any, sync: bool
) -> None:
    running = await start_worker(step_s=0.01)
    served = await gateway()
    model = await served.model()
    before = await submitted(redis_url)
    if sync:
        client = sdk(served, sync=True)
        call = asyncio.to_thread(client.chat.completions.create, model=model, messages=HI, max_tokens=400)
    else:
        call = sdk(served).chat.completions.create(model=model, messages=HI, max_tokens=400)
    waiting = asyncio.ensure_future(call)
    request_id = await new_id(redis_url, before)
    await wait_until(lambda: running.worker.engine.stats().running == 1)
    async with AsyncClient(redis_url) as direct:
        await AsyncJob.attach(direct, request_id).cancel()  # what `llmq cancel <id>` does
    with pytest.raises(openai.ConflictError) as caught:
        await waiting
    assert_no_retry(caught.value, 409, "cancelled")
    assert caught.value.response.headers["x-request-id"] == request_id
    assert await submitted(redis_url) - before == {request_id}  # the SDK did not retry into a new generation
    assert running.worker.engine.stats().requests_finished == {"cancelled": 1}


async def test_a_request_timeout_makes_one_attempt_and_cancels_it(gateway: Any, redis_url: str, sdk: Any) -> None:
    served = await gateway()  # no worker: the request waits in the queue past its timeout
    client = sdk(served)
    for stream in (False, True):
        before = await submitted(redis_url)
        with pytest.raises(openai.APIStatusError) as caught:
            await client.completions.create(
                model="default", prompt="hi", max_tokens=2, stream=stream, extra_headers={"X-Request-Timeout": "0.2"}
            )
        assert_no_retry(caught.value, 408, "timeout")
        (request_id,) = await submitted(redis_url) - before  # one attempt, not three
        assert caught.value.response.headers["x-request-id"] == request_id
        async with Redis.from_url(redis_url) as redis:
            assert await redis.exists(KEYS.cancel(request_id))  # a worker that reads it later skips it


async def test_expired_is_408_expired_when_the_worker_reads_the_request_late(
    gateway: Any, start_worker: Any, redis_url: str, sdk: Any
) -> None:
    running = await start_worker(max_running=1, step_s=0.01)
    served = await gateway()
    model = await served.model()
    async with AsyncClient(redis_url) as direct:
        busy = await direct.submit("busy", max_new_tokens=400)  # holds the worker's only slot
        await wait_until(lambda: running.worker.engine.stats().running == 1)
        before = await submitted(redis_url)
        late = asyncio.ensure_future(
            sdk(served).completions.create(
                model=model, prompt="late", max_tokens=2, extra_headers={"X-Request-Timeout": "0.3"}
            )
        )
        request_id = await new_id(redis_url, before)
        async with Redis.from_url(redis_url) as redis:  # waiting in the lane's stream, or held for fair share
            entries: list[tuple[bytes, dict[bytes, bytes]]] = [
                *await redis.xrange(KEYS.requests),  # type: ignore[misc]
                *await redis.xrange(KEYS.held("default")),  # type: ignore[misc]
            ]
        queued = [decode_request(fields[ENTRY_FIELD]) for _, fields in entries]
        (deadline,) = [r.deadline for r in queued if r.id == request_id]
        assert deadline is not None
        await wait_until(lambda: ms_now() > deadline)
        await busy.cancel()  # the slot frees: the worker reads `late` past its deadline, within the grace
        with pytest.raises(openai.APIStatusError) as caught:
            await late
    assert_no_retry(caught.value, 408, "expired")
    assert await submitted(redis_url) - before == {request_id}
    assert running.worker.engine.stats().requests_finished == {"cancelled": 1}  # `late` never ran


@pytest.mark.parametrize("real_model", [False, True])
async def test_an_idempotency_key_names_one_generation(
    gateway: Any, start_worker: Any, redis_url: str, sdk: Any, real_model: bool
) -> None:
    running = await start_worker(real_model=real_model)
    served = await gateway()
    model = await served.model()
    client, sync = sdk(served), sdk(served, sync=True)
    before = await submitted(redis_url)
    key = {"Idempotency-Key": "order-1"}
    first = await client.chat.completions.create(model=model, messages=HI, max_tokens=5, extra_headers=key)
    again = await asyncio.to_thread(
        sync.chat.completions.create, model=model, messages=HI, max_tokens=5, extra_headers=key
    )
    assert again.id == first.id and again.choices[0].message.content == first.choices[0].message.content
    streamed = await client.chat.completions.create(
        model=model, messages=HI, max_tokens=5, stream=True, extra_headers=key
    )
    chunks = [chunk async for chunk in streamed]
    assert {c.id for c in chunks} == {first.id}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == first.choices[0].message.content
    other_key = await sdk(served, api_key="another").chat.completions.create(
        model=model, messages=HI, max_tokens=5, extra_headers=key
    )
    assert other_key.id != first.id  # one API key's idempotency keys never meet another's
    assert await submitted(redis_url) - before == {first.id, other_key.id}
    assert sum(running.worker.engine.stats().requests_finished.values()) == 2


async def test_a_caller_gone_with_an_idempotency_key_gets_the_same_generation_on_retry(
    gateway: Any, start_worker: Any, redis_url: str, sdk: Any
) -> None:
    running = await start_worker(step_s=0.005)
    served = await gateway()
    model = await served.model()
    before = await submitted(redis_url)
    body = {"model": model, "prompt": "hi", "max_tokens": 200}
    key = {"Idempotency-Key": "retry-after-a-timeout"}
    async with served.http() as http:  # the SDK's own API key: the same caller
        waiting = asyncio.create_task(
            http.post("/v1/completions", json=body, headers={**key, "Authorization": "Bearer unused"})
        )
        await wait_until(lambda: running.worker.engine.stats().running == 1)
        waiting.cancel()  # the caller's read timeout: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    request_id = await new_id(redis_url, before)
    answer = await sdk(served).completions.create(model=model, prompt="hi", max_tokens=200, extra_headers=key)
    assert answer.id == request_id and answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 200
    assert running.worker.engine.stats().requests_finished == {"length": 1}  # not cancelled, not run twice


async def test_every_answer_carries_a_request_id(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway(api_keys="k1")
    async with served.http(headers={"Authorization": "Bearer k1"}) as authed, served.http() as anonymous:
        listed: list[httpx.Response] = []

        async def a_model_is_listed() -> bool:
            listed[:] = [await authed.get("/v1/models")]
            return bool(listed[0].json()["data"])

        await wait_until(a_model_is_listed)
        model = listed[0].json()["data"][0]["id"]
        answers = [
            listed[0],
            await anonymous.get("/health"),
            await anonymous.get("/metrics"),
            await authed.get("/v1/models/nope"),
            await anonymous.get("/nowhere"),
            await anonymous.post("/v1/chat/completions", json={"model": model, "messages": HI}),
            await authed.post("/v1/chat/completions", json={"model": model, "messages": HI, "n": 17}),
            await authed.post("/v1/chat/completions", content=b"{"),
        ]
        ok = await authed.post("/v1/chat/completions", json={"model": model, "messages": HI, "max_tokens": 2})
    assert [a.status_code for a in answers] == [200, 200, 200, 404, 404, 401, 400, 400]
    ids = [a.headers["x-request-id"] for a in answers]
    assert all(ids) and len(set(ids)) == len(ids)
    assert all(a.headers["x-should-retry"] == "false" for a in answers[3:])
    assert ok.status_code == 200 and ok.headers.get_list("x-request-id") == [ok.json()["id"]]


async def test_a_refusal_by_the_worker_names_the_openai_param(gateway: Any, start_worker: Any, sdk: Any) -> None:
    await start_worker(max_new_tokens=50)  # a lower limit than the gateway's: only the worker refuses
    served = await gateway()
    model = await served.model()
    client = sdk(served)
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=model, messages=HI, **{field: 60})
        assert_no_retry(caught.value, 400, "invalid_request")
        assert caught.value.param == field


def tiny_app() -> Starlette:
    """Routes that answer with and without their own id, and one that fails, behind the API key check."""

    async def own_id(request: Request) -> Response:
        return JSONResponse({}, headers={"X-Request-Id": "generation-1"})

    async def plain(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def broken(request: Request) -> Response:
        raise RuntimeError("a bug")

    routes = [Route("/v1/own", own_id), Route("/open", plain), Route("/broken", broken)]
    return Starlette(
        routes=routes,
        middleware=[Middleware(RequestIdMiddleware), Middleware(APIKeyMiddleware, keys=[(b"k", None)])],
    )


async def test_the_middleware_keeps_a_handlers_id_and_adds_one_everywhere_else() -> None:
    transport = httpx.ASGITransport(app=tiny_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        own = await http.get("/v1/own", headers={"Authorization": "Bearer k"})
        answers = [await http.get("/open"), await http.get("/v1/own"), await http.get("/broken")]
    assert own.headers.get_list("x-request-id") == ["generation-1"]
    assert [a.status_code for a in answers] == [200, 401, 500]
    ids = [a.headers["x-request-id"] for a in answers]
    assert len(set(ids)) == 3 and all(len(i) == 32 for i in ids)
    broken = answers[2]
    assert broken.json()["error"]["code"] == "internal" and broken.headers["x-should-retry"] == "false"
