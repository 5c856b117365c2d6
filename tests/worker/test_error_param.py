"""A worker's refusals name the field they blame (`ErrorEvent.param`): the intake's, and the engine's."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from client import AsyncClient, RequestFailed
from client.protocol import ErrorCode, ErrorEvent, RequestLimits, ms_now
from worker import adapter
from worker.engine.errors import EngineFailed, RequestRejected
from worker.engine.inputs import InputProcessor, ModelLimits
from worker.engine.types import EngineRequest, GenerationParams
from worker.intake import Answer, decide

LIMITS = RequestLimits()


def decided_param(fields: dict, limits: RequestLimits = LIMITS) -> str | None:
    base = {"v": 1, "id": "req-1", "prompt": "hi", "submitted": ms_now()}
    decision = decide(b"1-0", {b"m": msgpack.packb({**base, **fields})}, limits)
    assert isinstance(decision, Answer) and isinstance(decision.event, ErrorEvent)
    assert decision.event.code == ErrorCode.INVALID_REQUEST
    return decision.event.param


def test_the_intake_names_the_invalid_field() -> None:
    assert decided_param({"params": {"temperature": -1.0}}) == "params.temperature"
    assert decided_param({"prompt": None, "input_ids": [2**31]}) == "input_ids"
    assert decided_param({"prompt": None}) is None


def test_the_intake_names_the_field_over_a_limit() -> None:
    assert decided_param({"params": {"max_new_tokens": 9000}}) == "params.max_new_tokens"
    assert decided_param({"prompt": "x" * 11}, RequestLimits(max_prompt_bytes=10)) == "prompt"


def test_an_unsupported_version_names_no_field() -> None:
    decision = decide(b"1-0", {b"m": msgpack.packb({"v": 2, "id": "req-1"})}, LIMITS)
    assert isinstance(decision, Answer) and isinstance(decision.event, ErrorEvent)
    assert decision.event.code == ErrorCode.UNSUPPORTED_VERSION and decision.event.param is None


PROCESSOR = InputProcessor(tokenizer=None, limits=ModelLimits(vocab_size=100, max_context=64, max_cached_tokens=48))


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (EngineRequest("x", input_ids=[3, 100], params=GenerationParams(max_new_tokens=4)), "input_ids"),
        (EngineRequest("x", input_ids=[3] * 60, params=GenerationParams(max_new_tokens=10)), "input_ids"),  # context
        (EngineRequest("x", input_ids=[3] * 40, params=GenerationParams(max_new_tokens=10)), "input_ids"),  # KV cache
        (EngineRequest("x", input_ids=[3], params=GenerationParams(top_p=0.0)), "params.top_p"),
        (EngineRequest("x", input_ids=[3], params=GenerationParams(presence_penalty=5.0)), "params.presence_penalty"),
        (EngineRequest("x", input_ids=[3], params=GenerationParams(logprobs=99)), "params.top_logprobs"),
        (EngineRequest("x", messages=[{"role": "user"}], params=GenerationParams()), "messages"),
        (EngineRequest("x", prompt="a", input_ids=[3], params=GenerationParams()), None),
    ],
)
def test_the_engine_names_the_field_it_rejects(request_: EngineRequest, param: str | None) -> None:
    with pytest.raises(RequestRejected) as info:
        PROCESSOR.prepare(request_)
    assert info.value.param == param
    event = adapter.error_event(info.value)
    assert (event.code, event.param, event.retryable) == (ErrorCode.INVALID_REQUEST, param, False)


def test_an_engine_failure_names_no_field() -> None:
    event = adapter.error_event(EngineFailed("the engine died"))
    assert (event.code, event.param, event.retryable) == (ErrorCode.ENGINE_FAILED, None, True)


async def test_the_callers_error_names_the_field_the_engine_rejected(start_worker: Any, client: AsyncClient) -> None:
    await start_worker(real_model=True)
    job = await client.submit(input_ids=[3, 10**6], max_new_tokens=4)  # over the tiny vocabulary: the engine's check
    with pytest.raises(RequestFailed) as info:
        await job.result(timeout=60)
    assert (info.value.code, info.value.param) == ("invalid_request", "input_ids")
    long = await client.submit(input_ids=[3] * 500, max_new_tokens=100)  # over the model's context of 512
    with pytest.raises(RequestFailed) as info:
        await long.result(timeout=60)
    assert info.value.param == "input_ids" and "context" in info.value.message
