"""Wire protocol: key names, round trips, and that decoding fails only with the right ProtocolError."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from client import LLMQError, protocol
from client.errors import InvalidRequest, LimitExceeded, MalformedEntry, ProtocolError, UnsupportedVersion
from client.protocol import (
    PROTOCOL_VERSION,
    DeadLetterBody,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    GenerateRequest,
    RequestLimits,
    SamplingParams,
    Timings,
    TokensEvent,
    Usage,
    WorkerInfo,
    decode_dead_letter,
    decode_event,
    decode_request,
    decode_worker,
    encode,
    ms_now,
    parse_request,
)
from client.store import Keys


def request(**fields: Any) -> GenerateRequest:
    return GenerateRequest(**{"id": "req-1", "prompt": "hi", "submitted": 1_700_000_000_000, **fields})


def packed(**fields: Any) -> bytes:
    """A request map as another implementation might send it (no validation on the way)."""
    return msgpack.packb({"v": 1, "id": "req-1", "prompt": "hi", "submitted": 1, **fields})


WORKER = WorkerInfo(
    id="w1",
    host="gpu-3",
    pid=4242,
    queue="default",
    model="SmolLM2",
    running=3,
    waiting=1,
    kv_used_blocks=10,
    kv_total_blocks=100,
    tokens_generated=12345,
    started=1,
    heartbeat=2,
)


def test_keys_share_the_queue_hash_tag() -> None:
    keys = Keys("chat")
    assert keys.requests == "{llmq:chat}:requests"
    assert keys.result("a1") == "{llmq:chat}:result:a1"
    assert keys.dead == "{llmq:chat}:dead"
    assert keys.cancel("a1") == "{llmq:chat}:cancel:a1"
    assert keys.cancel_channel == "{llmq:chat}:cancel"
    assert keys.workers == "{llmq:chat}:workers"
    assert keys.submitted("a1") == "{llmq:chat}:id:a1"
    assert Keys("chat", prefix="staging").requests == "{staging:chat}:requests"


@pytest.mark.parametrize("queue", ["", "a{b}", "with space", "x" * 129])
def test_keys_reject_names_that_break_the_hash_tag(queue: str) -> None:
    with pytest.raises(ValueError, match="queue"):
        Keys(queue)


@pytest.mark.parametrize(
    ("model", "decode"),
    [
        (request(), decode_request),
        (request(prompt=None, messages=[{"role": "user", "content": "hey"}], deadline=5, result_ttl=9), decode_request),
        (
            request(
                prompt=None,
                input_ids=[1, 2, 3],
                params=SamplingParams(
                    max_new_tokens=3, temperature=0.0, top_p=0.5, top_k=4, stop=["\n"], seed=-7, ignore_eos=True
                ),
            ),
            decode_request,
        ),
        (TokensEvent(seq=4, ids=[5, 6], text="ab"), decode_event),
        (
            DoneEvent(
                finish_reason="length",
                usage=Usage(prompt_tokens=3, completion_tokens=2),
                timings=Timings(queue_ms=1.5, ttft_ms=-0.5),
            ),
            decode_event,
        ),
        (ErrorEvent(code=ErrorCode.EXPIRED, message="too late"), decode_event),
        (ErrorEvent(code="from_the_future", message="?", retryable=True), decode_event),
        (WORKER, decode_worker),
    ],
    ids=lambda x: type(x).__name__ if not callable(x) else "",
)
def test_round_trip(model: Any, decode: Any) -> None:
    raw = encode(model)
    assert decode(raw) == model
    assert next(iter(msgpack.unpackb(raw))) == "v"  # the map starts with the version


def test_encode_drops_none_and_keeps_known_codes_typed() -> None:
    assert "seed" not in msgpack.unpackb(encode(request()))["params"]
    assert "deadline" not in msgpack.unpackb(encode(request()))
    assert decode_event(encode(ErrorEvent(code="expired", message=""))).code is ErrorCode.EXPIRED


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"\xc1garbage", MalformedEntry),
        (b"", MalformedEntry),
        (msgpack.packb([1, 2]), MalformedEntry),
        (msgpack.packb({"id": "x", "prompt": "hi"}), InvalidRequest),  # no version, but an id to answer
        (msgpack.packb({"v": "1", "id": "x"}), InvalidRequest),
        (msgpack.packb({"v": "1", "prompt": "hi"}), MalformedEntry),  # neither
        (msgpack.packb({"v": 1, "prompt": "hi", "submitted": 1}), MalformedEntry),  # no id to answer
        (msgpack.packb({"v": 1, "id": "no spaces", "prompt": "hi", "submitted": 1}), MalformedEntry),
        (msgpack.packb({"v": 2, "id": "x"}), UnsupportedVersion),
        (packed(colour="red"), InvalidRequest),
        (packed(params={"temperature": -0.1}), InvalidRequest),
        (packed(params={"temperature": "0.5"}), InvalidRequest),
        (packed(params={"max_new_tokens": True}), InvalidRequest),
        (packed(params={"top_p": 0.0}), InvalidRequest),
        (packed(params={"stop": [""]}), InvalidRequest),
        (packed(params={"nucleus": 1}), InvalidRequest),
        (packed(input_ids=[1]), InvalidRequest),  # prompt and input_ids
        (packed(prompt=None), InvalidRequest),  # neither
        (packed(prompt=""), InvalidRequest),
        (packed(input_ids=[-1], prompt=None), InvalidRequest),
        (packed(submitted=None), InvalidRequest),
        (packed(result_ttl=0), InvalidRequest),
        (packed(result_ttl=2**63 - 1), InvalidRequest),  # Redis refuses such an EXPIRE
        (packed(params={"top_k": 2**31}), InvalidRequest),  # int32 in the library
        (packed(deadline=2**63 - 1), InvalidRequest),
    ],
)
def test_decode_request_errors(raw: bytes, error: type[ProtocolError]) -> None:
    with pytest.raises(error) as info:
        decode_request(raw)
    assert type(info.value) is error
    assert isinstance(info.value, ValueError | LLMQError)


def test_errors_name_the_request_when_they_can() -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_request(packed(params={"temperature": -1.0}))
    assert info.value.request_id == "req-1"
    assert "params.temperature" in str(info.value)
    with pytest.raises(UnsupportedVersion) as version:
        decode_request(msgpack.packb({"v": 7, "id": "abc"}))
    assert version.value.request_id == "abc"


def test_error_messages_are_short_and_do_not_echo_input() -> None:
    huge = "secret " * 300_000
    with pytest.raises(InvalidRequest) as info:
        decode_request(packed(prompt=huge, input_ids=[1], a=1, b=2, c=3, d=4))
    message = str(info.value)
    assert len(message) < 600
    assert "secret" not in message
    assert "more" in message  # errors past the first three are counted, not listed


@pytest.mark.parametrize(
    ("fields", "limit"),
    [
        ({"prompt": "é" * 6}, "max_prompt_bytes"),  # 12 bytes, 6 characters
        ({"prompt": None, "messages": [{"role": "user", "content": "x" * 11}]}, "max_prompt_bytes"),
        ({"prompt": None, "input_ids": list(range(11))}, "max_input_ids"),
        ({"params": {"max_new_tokens": 301}}, "max_new_tokens"),
        ({"params": {"stop": ["a", "b", "c"]}}, "max_stop"),
        ({"params": {"stop": ["abcd"]}}, "max_stop_bytes"),
    ],
)
def test_limits(fields: dict[str, Any], limit: str) -> None:
    limits = RequestLimits(max_prompt_bytes=10, max_input_ids=10, max_new_tokens=300, max_stop=2, max_stop_bytes=3)
    with pytest.raises(LimitExceeded) as info:
        request(**fields).check_limits(limits)
    assert info.value.limit == limit
    assert limit in str(info.value)
    assert isinstance(info.value, InvalidRequest)
    request(params={"max_new_tokens": 300, "stop": ["abc", "d"]}).check_limits(limits)  # at every limit


def test_reprs_hide_prompts_and_tokens() -> None:
    shown = repr(request(prompt="my secret plan"))
    assert "secret" not in shown and "<14 hidden>" in shown
    assert "content='x'" not in repr(request(prompt=None, messages=[{"role": "user", "content": "x"}]))
    event = TokensEvent(seq=0, ids=[31337], text="classified")
    assert "31337" not in repr(event) and "classified" not in str(event)


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "tokens", "seq": 0, "ids": [], "text": ""},
        {"type": "progress"},
        {"type": "done"},
        {"type": "error", "code": "internal"},
    ],
)
def test_decode_event_rejects_bad_events(fields: dict[str, Any]) -> None:
    with pytest.raises(MalformedEntry):
        decode_event(msgpack.packb({"v": 1, **fields}))


def test_ms_now_is_epoch_milliseconds() -> None:
    assert 1_600_000_000_000 < ms_now() < 4_000_000_000_000


# --- properties ---------------------------------------------------------------------------------

_ids = st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True)
_epoch_ms = st.integers(0, protocol.MAX_EPOCH_MS)
_params = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(1, protocol.MAX_NEW_TOKENS),
    temperature=st.floats(0, protocol.MAX_TEMPERATURE, allow_nan=False),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, protocol.MAX_TOP_K),
    stop=st.lists(st.text(min_size=1), max_size=4),
    seed=st.none() | st.integers(protocol.MIN_SEED, protocol.MAX_SEED),
    ignore_eos=st.booleans(),
)
_inputs = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1)}),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.text(min_size=1), "content": st.text()}), min_size=1, max_size=3
            )
        }
    ),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, protocol.MAX_TOKEN_ID), min_size=1)}),
)
_requests = st.builds(
    lambda inputs, **fields: GenerateRequest(**inputs, **fields),
    _inputs,
    id=_ids,
    params=_params,
    deadline=st.none() | _epoch_ms,
    result_ttl=st.integers(1, protocol.MAX_RESULT_TTL_S),
    submitted=_epoch_ms,
)


@given(_requests)
def test_request_encode_decode_identity(req: GenerateRequest) -> None:
    assert decode_request(encode(req)) == req


@given(st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_errors(raw: bytes) -> None:
    for decode in (decode_request, decode_event, decode_worker):
        with contextlib.suppress(ProtocolError):
            decode(raw)


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
_keys = st.sampled_from(
    [
        "v",
        "id",
        "prompt",
        "messages",
        "input_ids",
        "params",
        "submitted",
        "type",
        "seq",
        "ids",
        "text",
        "code",
        "finish_reason",
        "usage",
        "heartbeat",
    ]
) | st.text(max_size=5)


@given(st.dictionaries(_keys, _values, max_size=8), st.sampled_from([None, 1, 2]))
def test_random_maps_raise_only_protocol_errors(fields: dict[str, Any], version: int | None) -> None:
    if version is not None:
        fields["v"] = version
    raw = msgpack.packb(fields)
    for decode in (decode_request, decode_event, decode_worker):
        with contextlib.suppress(ProtocolError):
            decode(raw)


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "a\udcff"},
        {"messages": [{"role": "user", "content": "a\udcff"}]},
        {"messages": [{"role": "\udcff", "content": "a"}]},
        {"prompt": "a", "params": {"stop": ["\udcff"]}},
    ],
)
def test_strings_that_are_not_utf8_are_invalid(fields: dict) -> None:
    with pytest.raises(InvalidRequest, match="UTF-8"):
        parse_request({"v": 1, "id": "x", "submitted": 1, **fields})


def test_the_dead_letter_body_keeps_its_bytes() -> None:
    """The dead-letter stream's entries are read back as they were written before it had a model."""
    before = msgpack.packb({"v": PROTOCOL_VERSION, "entry_id": "1-0", "reason": "why", "raw": b"\x81\xa1"})
    body = DeadLetterBody(entry_id="1-0", reason="why", raw=b"\x81\xa1")
    assert encode(body) == before and decode_dead_letter(before) == body
    assert "\\x81" not in repr(body)  # the entry stays out of logs
    empty = msgpack.packb({"v": PROTOCOL_VERSION, "entry_id": "2-0", "reason": "no field", "raw": b""})
    assert encode(DeadLetterBody(entry_id="2-0", reason="no field")) == empty
    for junk in (b"junk", msgpack.packb({"v": PROTOCOL_VERSION, "entry_id": "1-0", "reason": "r", "raw": "text"})):
        with pytest.raises(MalformedEntry):
            decode_dead_letter(junk)
