"""A client that goes away cancels its request: the worker stops it within one engine step."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from client import AsyncClient, AsyncJob
from tests.polling import wait_until


def counted(served: Any, route: str, status: str, model: str) -> float:
    value = served.state.metrics.requests.labels(route, status, model)._value.get()
    return float(value)


async def test_disconnect_mid_stream_cancels(gateway: Any, start_worker: Any, redis_url: str) -> None:
    running = await start_worker(step_s=0.01)
    served = await gateway()
    model = await served.model()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}
    events = 0
    async with served.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    assert running.worker.engine.stats().running <= 1
    await wait_until(lambda: running.worker.engine.stats().running == 0, within_s=5)
    async with AsyncClient(redis_url) as direct:
        job = AsyncJob.attach(direct, request_id)
        seen = sum([len(delta.token_ids) async for delta in job.stream(timeout=10)])
    assert job.finish_reason == "cancelled" and seen < 400
    await wait_until(lambda: counted(served, "/v1/chat/completions", "499", model) == 1)
    assert served.state.metrics.in_flight.labels("/v1/chat/completions", model)._value.get() == 0


async def test_disconnect_while_waiting_for_a_whole_answer_cancels(gateway: Any, start_worker: Any) -> None:
    running = await start_worker(step_s=0.01)
    served = await gateway()
    model = await served.model()
    body = {"model": model, "prompt": "hi", "max_tokens": 400}
    async with served.http() as http:
        waiting = asyncio.create_task(http.post("/v1/completions", json=body))
        await wait_until(lambda: running.worker.engine.stats().running == 1)
        waiting.cancel()  # the HTTP client gives up: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    await wait_until(lambda: running.worker.engine.stats().running == 0, within_s=5)
    assert running.worker.engine.stats().requests_finished["cancelled"] == 1
    await wait_until(lambda: counted(served, "/v1/completions", "499", model) == 1)


async def test_a_stream_with_an_idempotency_key_runs_on_and_its_retry_streams_it_all(
    gateway: Any, start_worker: Any
) -> None:
    running = await start_worker(step_s=0.005)
    served = await gateway()
    model = await served.model()
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}
    headers = {"Idempotency-Key": "stream-1"}
    async with served.http() as http:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            request_id = response.headers["x-request-id"]
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # gone after the first event
        retried = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert retried.headers["x-request-id"] == request_id
    events = [line.removeprefix("data: ") for line in retried.text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2]
    assert running.worker.engine.stats().requests_finished == {"length": 1}  # not cancelled, run once
