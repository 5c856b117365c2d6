"""`param`: the request field a refusal blames, from the validation that finds it to the caller's exception."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from client.errors import InvalidRequest, LimitExceeded, MalformedEntry, RequestFailed
from client.protocol import (
    ErrorCode,
    ErrorEvent,
    GenerateRequest,
    RequestLimits,
    decode_event,
    encode,
    error_from_event,
    parse_request,
)


def fields(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"v": 1, "id": "req-1", "prompt": "hi", "submitted": 1}
    return {key: value for key, value in {**base, **changes}.items() if value is not None}


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"params": {"max_new_tokens": -1}}, "params.max_new_tokens"),
        ({"params": {"top_k": 2**31}}, "params.top_k"),
        ({"params": {"stop": [""]}}, "params.stop"),  # the list, not its item
        ({"params": {"top_logprobs": 3}}, "params.top_logprobs"),  # a check across fields names the one to fix
        ({"params": {"ignore_eos": True, "response_format": {"type": "json_object"}}}, "params.response_format"),
        ({"params": {"response_format": {"type": "json_schema", "json_schema": {}}}}, "params.response_format"),
        ({"params": {"unknown": 1}}, "params.unknown"),
        ({"prompt": None, "input_ids": [1, -2]}, "input_ids"),
        ({"prompt": None, "messages": [{"role": "user"}]}, "messages"),
        ({"result_ttl": 0}, "result_ttl"),
        ({"bogus": 1}, "bogus"),
        ({"prompt": None}, None),  # no input at all: no one field to blame
        ({"input_ids": [1]}, None),  # two inputs: neither is wrong alone
    ],
)
def test_validation_names_the_field_it_refuses(changes: dict[str, Any], param: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(fields(**changes))
    assert info.value.param == param
    assert info.value.request_id == "req-1"


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"prompt": "x" * 11}, "prompt"),
        ({"prompt": None, "messages": [{"role": "user", "content": "x" * 11}]}, "messages"),
        ({"prompt": None, "input_ids": list(range(11))}, "input_ids"),
        ({"params": {"max_new_tokens": 301}}, "params.max_new_tokens"),
        ({"params": {"stop": ["a", "b", "c"]}}, "params.stop"),
        ({"params": {"stop": ["abcd"]}}, "params.stop"),
    ],
)
def test_a_limit_names_the_field_it_measures(changes: dict[str, Any], param: str) -> None:
    limits = RequestLimits(max_prompt_bytes=10, max_input_ids=10, max_new_tokens=300, max_stop=2, max_stop_bytes=3)
    with pytest.raises(LimitExceeded) as info:
        GenerateRequest.model_validate(fields(**changes)).check_limits(limits)
    assert info.value.param == param


def test_the_event_carries_param_to_the_callers_exception() -> None:
    event = ErrorEvent(code=ErrorCode.INVALID_REQUEST, message="too long", param="params.max_new_tokens")
    decoded = decode_event(encode(event))
    assert isinstance(decoded, ErrorEvent) and decoded.param == "params.max_new_tokens"
    error = error_from_event(decoded, "req-1")
    assert isinstance(error, RequestFailed)
    assert (error.code, error.param, error.request_id) == ("invalid_request", "params.max_new_tokens", "req-1")


def test_an_event_without_param_is_written_as_before() -> None:
    """Old readers refuse unknown fields, so `param` is on the wire only when set."""
    raw = encode(ErrorEvent(code=ErrorCode.ENGINE_FAILED, message="boom", retryable=True))
    assert "param" not in msgpack.unpackb(raw)
    assert error_from_event(decode_event(raw)).param is None  # type: ignore[arg-type]


def test_param_is_bounded() -> None:
    raw = msgpack.packb({"v": 1, "type": "error", "code": "invalid_request", "message": "m", "param": "p" * 129})
    with pytest.raises(MalformedEntry):
        decode_event(raw)
