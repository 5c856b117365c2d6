"""The pure parts: OpenAI bodies -> `submit` arguments (shared with `llmq batch`), lanes, the error table,
the timeout header and API key checks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.datastructures import Headers
from starlette.requests import Request

from client import TokenLogprob
from client.errors import (
    Cancelled,
    InvalidRequest,
    LimitExceeded,
    QueueFull,
    RedisUnavailable,
    RequestExpired,
    RequestFailed,
    ResultTimeout,
)
from client.openai_format import (
    CHAT,
    COMPLETIONS,
    MAX_N,
    Echo,
    FieldError,
    choice_body,
    choices_body,
    echo_of,
    lane_for,
    logprobs_body,
    openai_param,
    token_offsets,
    translate,
)
from client.protocol import Usage, choice_ids, is_valid_name, total_usage
from gateway.auth import authorized, bearer_token
from gateway.bodies import read_body
from gateway.chunks import ChunkMaker
from gateway.completions import request_timeout
from gateway.errors import SHOULD_RETRY, APIError, from_exception, once_submitted
from gateway.request_ids import idempotent_request_id, request_id_for
from gateway.sse import event

USER = [{"role": "user", "content": "hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_chat_body_becomes_submit_arguments() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "kind"}]}
        ],
        "max_tokens": 9,
        "max_completion_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "stop": "x",
        "seed": 3,
        "user": "u1",
        "n": 1,
        "logprobs": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        "service_tier": "default",
    }
    out = translate(body, CHAT)
    assert out.options == {
        "messages": [{"role": "system", "content": "be kind"}],
        "max_new_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "stop": ["x"],
        "seed": 3,
        "priority": "default",
    }
    assert (out.model, out.stream, out.include_usage, out.user, out.lane) == ("m", True, True, "u1", "default")


def test_logprobs_penalties_and_response_formats_are_applied() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    chat = translate(
        {
            "messages": USER,
            "logprobs": True,
            "top_logprobs": 2,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.1,
            "repetition_penalty": 1.2,
            "response_format": schema,
        },
        CHAT,
    ).options
    assert (chat["logprobs"], chat["top_logprobs"], chat["response_format"]) == (True, 2, schema)
    assert (chat["presence_penalty"], chat["frequency_penalty"], chat["repetition_penalty"]) == (0.5, 0.1, 1.2)
    completion = translate({"prompt": "hi", "logprobs": 3, "response_format": {"type": "text"}}, COMPLETIONS)
    assert (completion.options["logprobs"], completion.options["top_logprobs"]) == (True, 3)
    assert "response_format" not in completion.options  # text is no constraint
    assert "logprobs" not in translate({"messages": USER, "logprobs": False}, CHAT).options


def test_logprobs_in_openai_shapes() -> None:
    logprobs = [TokenLogprob(5, -0.5, "Hi", [(5, -0.5, "Hi"), (6, -1.5, "Ho")]), TokenLogprob(7, -0.1, "!", [])]
    chat = logprobs_body(CHAT, logprobs)
    assert chat is not None and chat["content"][0] == {
        "token": "Hi",
        "logprob": -0.5,
        "bytes": [72, 105],
        "top_logprobs": [
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
            {"token": "Ho", "logprob": -1.5, "bytes": [72, 111]},
        ],
    }
    assert logprobs_body(COMPLETIONS, logprobs, "Hi!", text_offset=3) == {
        "tokens": ["Hi", "!"],
        "token_logprobs": [-0.5, -0.1],
        "top_logprobs": [{"Hi": -0.5, "Ho": -1.5}, {}],
        "text_offset": [3, 5],
    }
    assert logprobs_body(CHAT, None) is None


def test_text_offsets_follow_the_text_across_partial_characters_and_dropped_spaces() -> None:
    # "ò" comes as two tokens that each decode alone to U+FFFD; counting their decodings drifted by one
    tokens = ["Hello", " R", "\ufffd", "\ufffd", "W", " text"]
    text = "Hello RòW text"
    offsets = token_offsets(tokens, text)
    assert offsets == [0, 5, 7, 7, 8, 9]
    assert all(text.startswith(t, o) for t, o in zip(tokens, offsets, strict=True) if "\ufffd" not in t)
    assert token_offsets(["hello", "world"], " hello world") == [1, 7]  # a leading space dropped alone
    assert token_offsets(["a", "\ufffd b", "c"], "aé bc") == [0, 1, 4]  # a character's tail, then more text
    assert token_offsets(["x", "y"], "zz") == [0, 1]  # not found: the running count, as before


def test_completions_prompt_forms_and_default_length() -> None:
    assert translate({"prompt": "hi"}, COMPLETIONS).options == {"prompt": "hi", "max_new_tokens": 16}
    assert translate({"prompt": ["hi"], "max_tokens": 3}, COMPLETIONS).options["prompt"] == "hi"
    assert translate({"prompt": [5, 6]}, COMPLETIONS).options["input_ids"] == [5, 6]
    assert translate({"prompt": [[5, 6]]}, COMPLETIONS).options["input_ids"] == [5, 6]
    assert "max_new_tokens" not in translate({"messages": USER}, CHAT).options  # the queue's default


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": "get_weather"}, "tools"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"something_new": 1}, "something_new"),
        ({"service_tier": "scale"}, "service_tier"),
        ({"temperature": 1000}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages[0].tool_calls[0].function"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "function", "content": "42", "name": "f"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": 1, "content": "hi"}]}, "messages[0].role"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(body: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as caught:
        translate({"messages": USER, **body}, CHAT)
    assert caught.value.field == field and isinstance(caught.value, InvalidRequest)


def test_n_is_read_apart_from_the_submit_options() -> None:
    asked = translate({"messages": USER, "n": 3, "seed": 7}, CHAT, n_allowed=True)
    assert asked.n == 3 and "n" not in asked.options and asked.options["seed"] == 7
    assert translate({"prompt": "hi", "n": MAX_N}, COMPLETIONS, n_allowed=True).n == MAX_N
    assert translate({"messages": USER, "n": 1}, CHAT).n == 1  # the no-op value, accepted anywhere


@pytest.mark.parametrize(
    ("body", "allowed"),
    [
        ({"n": 2}, False),  # `llmq batch` answers one choice per line
        ({"n": MAX_N + 1}, True),
        ({"n": 0}, True),
        ({"n": True}, True),  # a boolean is not a count
        ({"n": 2.0}, True),
        ({"n": 2, "seed": 2**64 - 1}, True),  # the second choice's seed would be out of range
    ],
)
def test_n_is_bounded_and_refused_by_name(body: dict[str, Any], allowed: bool) -> None:
    with pytest.raises(FieldError) as caught:
        translate({"messages": USER, **body}, CHAT, n_allowed=allowed)
    assert caught.value.field == ("seed" if "seed" in body else "n")


def test_best_of_stays_refused_with_n() -> None:
    with pytest.raises(FieldError) as caught:
        translate({"prompt": "hi", "n": 2, "best_of": 2}, COMPLETIONS, n_allowed=True)
    assert caught.value.field == "best_of"


def test_choice_ids_derive_from_the_call_id() -> None:
    assert choice_ids("abc", 1) == ["abc"]  # one choice keeps the call's id, as before `n`
    assert choice_ids("idem-1f", 3) == ["idem-1f-0", "idem-1f-1", "idem-1f-2"]
    assert all(is_valid_name(request_id) for request_id in choice_ids("idem-" + "f" * 32, MAX_N))


def test_n_choices_answer_with_their_indexes_and_the_prompt_counted_once() -> None:
    usage = total_usage([Usage(prompt_tokens=5, completion_tokens=3), Usage(prompt_tokens=5, completion_tokens=4)])
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 7)
    choices = [choice_body(CHAT, i, text, "eos") for i, text in enumerate(["a", "b"])]
    body = choices_body(CHAT, "id", "m", 1, choices, usage)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "stop"),
        (1, "b", "stop"),
    ]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert choices_body(COMPLETIONS, "id", "m", 1, choices, usage)["object"] == "text_completion"


def test_streamed_chunks_name_their_choice() -> None:
    for url in (CHAT, COMPLETIONS):
        chunks = ChunkMaker(url, "id", "m", 1)
        assert chunks.text(None, first=True, index=2)["choices"][0]["index"] == 2
        empty: dict[str, Any] = {"delta": {}} if url == CHAT else {"text": ""}
        assert chunks.finish("length", 1)["choices"][0] == {
            "index": 1,
            **empty,
            "logprobs": None,
            "finish_reason": "length",
        }


def test_completions_refuse_several_prompts_and_chat_fields() -> None:
    with pytest.raises(FieldError, match="prompt"):
        translate({"prompt": ["a", "b"]}, COMPLETIONS)
    with pytest.raises(FieldError) as caught:  # `llmq batch` does not echo yet
        translate({"prompt": "a", "echo": True}, COMPLETIONS)
    assert caught.value.field == "echo"


def test_echo_scores_the_prompt_on_completions_only() -> None:
    scored = translate({"prompt": "ab", "echo": True, "logprobs": 2, "max_tokens": 0}, COMPLETIONS, echo_allowed=True)
    assert scored.echo and scored.options["prompt_logprobs"] == 2 and scored.options["max_new_tokens"] == 0
    plain = translate({"prompt": [5, 6], "echo": True}, COMPLETIONS, echo_allowed=True)  # its texts come scored
    assert plain.echo and plain.options["prompt_logprobs"] == 0 and "logprobs" not in plain.options
    streamed = translate({"prompt": [5, 6], "echo": True, "stream": True}, COMPLETIONS, echo_allowed=True)
    assert streamed.echo and streamed.options["prompt_logprobs"] == 0
    as_sent = translate({"prompt": "ab", "echo": True, "max_tokens": 2}, COMPLETIONS, echo_allowed=True)
    assert as_sent.echo and "prompt_logprobs" not in as_sent.options  # echoed as sent: nothing to score
    assert not translate({"prompt": "a", "echo": False}, COMPLETIONS, echo_allowed=True).echo  # SDKs may send it
    assert "prompt_logprobs" not in translate({"messages": USER, "echo": False}, CHAT, echo_allowed=True).options
    for body, url in (
        ({"messages": USER, "echo": True}, CHAT),  # OpenAI has no echo on chat
        ({"prompt": "a", "echo": "yes"}, COMPLETIONS),
    ):
        with pytest.raises(FieldError) as caught:
            translate(body, url, echo_allowed=True)
        assert caught.value.field == "echo"
    with pytest.raises(FieldError) as caught:  # without echo, nothing allows an empty answer
        translate({"prompt": "a", "max_tokens": 0}, COMPLETIONS, echo_allowed=True)
    assert caught.value.field == "max_tokens"
    assert openai_param("params.prompt_logprobs", COMPLETIONS) == "echo"


PROMPT_SCORES = [None, TokenLogprob(9, -1.25, " sky", [(9, -1.25, " sky"), (4, -2.0, " sea")])]
GENERATED = [TokenLogprob(3, -0.5, " is", [(3, -0.5, " is"), (8, -1.0, " was")])]


def test_an_echo_comes_before_the_generated_tokens_with_the_first_score_null() -> None:
    asked = translate({"prompt": "The sky", "echo": True, "logprobs": 2}, COMPLETIONS, echo_allowed=True)
    echo = echo_of(asked, PROMPT_SCORES, ["The", " sky"])
    assert echo == Echo("The sky", ["The", " sky"], PROMPT_SCORES)
    choice = choice_body(COMPLETIONS, 0, " is", "length", GENERATED, echo)
    assert choice["text"] == "The sky is"
    assert choice["logprobs"] == {
        "tokens": ["The", " sky", " is"],
        "token_logprobs": [None, -1.25, -0.5],
        "top_logprobs": [None, {" sky": -1.25, " sea": -2.0}, {" is": -0.5, " was": -1.0}],
        "text_offset": [0, 3, 7],
    }
    assert echo_of(asked, PROMPT_SCORES) == Echo("The sky")  # without the tokens' texts: the prompt as sent
    assert logprobs_body(COMPLETIONS, None, echo=echo) == {
        "tokens": ["The", " sky"],
        "token_logprobs": [None, -1.25],
        "top_logprobs": [None, {" sky": -1.25, " sea": -2.0}],
        "text_offset": [0, 3],
    }


def test_an_echo_without_logprobs_is_text_alone_and_token_ids_echo_their_texts() -> None:
    asked = translate({"prompt": "The sky", "echo": True, "max_tokens": 0}, COMPLETIONS, echo_allowed=True)
    echo = echo_of(asked, PROMPT_SCORES, ["The", " sky"])
    assert echo == Echo("The sky")
    choice = choice_body(COMPLETIONS, 0, "", "length", echo=echo)
    assert choice["text"] == "The sky" and choice["logprobs"] is None
    ids = translate({"prompt": [1, 9], "echo": True, "logprobs": 0}, COMPLETIONS, echo_allowed=True)
    by_ids = echo_of(ids, PROMPT_SCORES, ["The", " sky"])
    assert by_ids is not None and by_ids.text == "The sky" and by_ids.tokens == ["The", " sky"]
    assert echo_of(translate({"prompt": "x"}, COMPLETIONS, echo_allowed=True), PROMPT_SCORES) is None


def test_service_tiers_map_to_lanes_in_one_place() -> None:
    assert lane_for(None) == lane_for("auto") == lane_for("default") == "default"
    assert (lane_for("priority"), lane_for("flex")) == ("interactive", "batch")
    assert translate({"prompt": "a", "service_tier": "flex"}, COMPLETIONS).options["priority"] == "batch"
    assert "priority" not in translate({"prompt": "a"}, COMPLETIONS).options  # the caller's default lane


@pytest.mark.parametrize(
    ("error", "status", "code", "retry"),
    [
        (FieldError("n", "no"), 400, "invalid_request", False),
        (LimitExceeded("max_new_tokens", "too many"), 400, "invalid_request", False),
        (InvalidRequest("bad"), 400, "invalid_request", False),
        (QueueFull("full"), 429, "queue_full", True),  # nothing was queued
        (RequestExpired("expired", "late"), 408, "expired", False),
        (ResultTimeout("r", 1.0, 0), 408, "timeout", False),
        (RequestFailed("invalid_request", "too long for the context"), 400, "invalid_request", False),
        (RequestFailed("engine_failed", "boom", retryable=True), 503, "engine_failed", True),  # it has ended
        (RequestFailed("delivery_limit", "workers kept dying"), 503, "delivery_limit", False),
        (RequestFailed("poison_request", "kills engines"), 500, "poison_request", False),
        (RequestFailed("internal", "bug"), 500, "internal", False),
        (RequestFailed("from_the_future", "?", retryable=True), 503, "from_the_future", True),
        (Cancelled(type("R", (), {"request_id": "r", "token_ids": []})()), 409, "cancelled", False),
        (RedisUnavailable("away"), 503, "unavailable", True),  # before the submit: nothing was queued
        (RuntimeError("bug"), 500, "internal", False),
    ],
)
def test_error_table(error: Exception, status: int, code: str, retry: bool) -> None:
    answer = from_exception(error, retry_after_s=2)
    assert (answer.status, answer.code, answer.retry) == (status, code, retry)
    body = answer.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert (answer.headers.get("Retry-After") == "2") == (status == 429)
    response = answer.response("req-1")
    assert response.headers[SHOULD_RETRY] == ("true" if retry else "false")
    assert response.headers["x-request-id"] == "req-1"


@pytest.mark.parametrize(
    ("error", "plain", "idempotent"),
    [
        (RedisUnavailable("away"), False, True),  # it may still run: only a retry that follows it is safe
        (RequestFailed("engine_failed", "boom", retryable=True), True, False),  # ended: a key would repeat it
        (QueueFull("full"), True, True),  # nothing added, not even the id
        (Cancelled(type("R", (), {"request_id": "r", "token_ids": []})()), False, False),
        (ResultTimeout("r", 1.0, 0), False, False),
        (RequestFailed("invalid_request", "no"), False, False),
    ],
)
def test_retry_safety_once_a_generation_may_exist(error: Exception, plain: bool, idempotent: bool) -> None:
    assert once_submitted(from_exception(error, retry_after_s=1), idempotent=False).retry is plain
    assert once_submitted(from_exception(error, retry_after_s=1), idempotent=True).retry is idempotent


def refused(code: str, wire: str | None) -> RequestFailed:
    """A worker's refusal naming `wire` (set as an attribute: it works with and without `RequestFailed.param`)."""
    error = RequestFailed(code, "refused")
    error.param = wire
    return error


@pytest.mark.parametrize(
    ("wire", "url", "field", "param"),
    [
        ("params.max_new_tokens", CHAT, "max_tokens", "max_tokens"),
        ("params.max_new_tokens", CHAT, "max_completion_tokens", "max_completion_tokens"),
        ("input_ids", COMPLETIONS, "max_tokens", "prompt"),
        ("input_ids", CHAT, "max_tokens", "messages"),  # a chat's input is its messages, whatever the worker saw
        ("messages", CHAT, "max_tokens", "messages"),
        ("prompt", COMPLETIONS, "max_tokens", "prompt"),
        ("params.top_logprobs", COMPLETIONS, "max_tokens", "logprobs"),
        ("params.top_logprobs", CHAT, "max_tokens", "top_logprobs"),
        ("params.response_format", CHAT, "max_tokens", "response_format"),
        ("params.stop", COMPLETIONS, "max_tokens", "stop"),
        (None, CHAT, "max_tokens", None),  # a worker older than the field
    ],
)
def test_worker_refusals_name_the_openai_field(wire: str | None, url: str, field: str, param: str | None) -> None:
    answer = from_exception(refused("invalid_request", wire), retry_after_s=1, url=url, max_tokens_field=field)
    assert (answer.status, answer.param, answer.retry) == (400, param, False)
    expired = from_exception(refused("expired", None), retry_after_s=1, url=url)
    assert (expired.status, expired.code, expired.param) == (408, "expired", None)


def test_limit_errors_name_the_openai_field() -> None:
    assert from_exception(LimitExceeded("max_new_tokens", "x"), retry_after_s=1).param == "max_tokens"
    assert from_exception(LimitExceeded("max_stop", "x"), retry_after_s=1).param == "stop"
    budget = from_exception(
        LimitExceeded("max_new_tokens", "x"), retry_after_s=1, max_tokens_field="max_completion_tokens"
    )
    assert budget.param == "max_completion_tokens"
    prompt = from_exception(LimitExceeded("max_prompt_bytes", "x"), retry_after_s=1, url=CHAT)
    assert prompt.param == "messages"


def test_timeout_header() -> None:
    assert request_timeout(None, 600) == 600
    assert request_timeout("2.5", 600) == 2.5
    assert request_timeout("9999", 600) == 600  # at most the gateway's own
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(APIError) as caught:
            request_timeout(bad, 600)
        assert caught.value.status == 400 and caught.value.param == "X-Request-Timeout"


def test_bearer_keys() -> None:
    keys: list[tuple[bytes, str | None]] = [(b"k1", None), (b"k2", "billing")]
    assert authorized("Bearer k2", keys) == (True, "billing") and authorized("bearer k1", keys) == (True, None)
    for header in (None, "", "Bearer", "Bearer k3", "Basic k1", "k1", "Bearer k1x"):
        assert authorized(header, keys) == (False, None), header
    assert bearer_token("Bearer  k1 ") == "k1" and bearer_token("Basic k1") is None and bearer_token(None) is None


def test_idempotency_keys_name_one_generation_per_api_key_and_endpoint() -> None:
    first = idempotent_request_id("key-a", "order-17", CHAT)
    assert first == idempotent_request_id("key-a", "order-17", CHAT) and first.startswith("idem-")
    others = {idempotent_request_id("key-b", "order-17", CHAT), idempotent_request_id(None, "order-17", CHAT)}
    others |= {idempotent_request_id("anonymous", "order-17", CHAT), idempotent_request_id("key-a", "order-18", CHAT)}
    others |= {idempotent_request_id("key-a", "order-17", COMPLETIONS)}
    assert first not in others and len(others) == 5
    assert is_valid_name(first) and "key-a" not in first and "order-17" not in first
    assert request_id_for(Headers({"idempotency-key": "order-17"}), "key-a", CHAT) == (first, True)
    fresh, idempotent = request_id_for(Headers({}), "key-a", CHAT)
    assert not idempotent and is_valid_name(fresh) and fresh != request_id_for(Headers({}), "key-a", CHAT)[0]
    for bad in ("", "x" * 256):
        with pytest.raises(APIError) as caught:
            request_id_for(Headers({"idempotency-key": bad}), None, CHAT)
        assert caught.value.status == 400 and caught.value.param == "Idempotency-Key"


def test_an_event_stays_one_line_for_readers_that_split_on_unicode_line_breaks() -> None:
    text = "a\u2028b\x85c\u2029d\ne"  # a model may write any of these; httpx's iter_lines breaks at each
    lines = event({"text": text}).decode().splitlines()
    assert len(lines) == 2 and lines[1] == "" and lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: ")) == {"text": text}


STRICT = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
# What popular SDKs and frameworks put in a body by default (docs/gateway.md, "Fields SDKs send by default").
SDK_DEFAULTS = {
    "openai parse(response_format=Model)": {
        "response_format": {"type": "json_schema", "json_schema": {"schema": STRICT, "name": "M", "strict": True}}
    },
    "openai stream with usage": {
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    },
    "langchain ChatOpenAI (older)": {"stream": False, "n": 1, "temperature": 0.7},
    "langchain ChatOpenAI streaming": {"stream": True, "stream_options": {"include_usage": True}},
    "langchain named message": {"messages": [{"role": "user", "content": "hi", "name": "alice"}]},
    "litellm": {"stream": False, "max_tokens": 8, "user": "u-1"},
    "no-op knobs": {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "store": False, "logprobs": False},
    "hints": {
        "metadata": {"team": "x"},
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit"},
        "safety_identifier": "hashed-user",
        "modalities": ["text"],
        "audio": None,
    },
}


@pytest.mark.parametrize("extra", list(SDK_DEFAULTS.values()), ids=list(SDK_DEFAULTS))
def test_fields_sdks_send_by_default_are_accepted(extra: dict[str, Any]) -> None:
    asked = translate({"model": "m", "messages": USER, **extra}, CHAT)
    assert asked.options["messages"] == [{"role": "user", "content": "hi"}]
    assert not {"metadata", "prompt_cache_key", "n", "tools", "store", "name"} & set(asked.options)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"verbosity": "low"}, "verbosity"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"store": True}, "store"),
        ({"prompt_cache_key": 5}, "prompt_cache_key"),
        ({"metadata": "x"}, "metadata"),
        ({"stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
        ({"messages": [{"role": "user", "content": "hi", "name": 3}]}, "messages[0].name"),
    ],
)
def test_fields_that_would_change_the_answer_are_refused_by_name(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as caught:
        translate({"model": "m", "messages": USER, **extra}, CHAT)
    assert caught.value.field == field


def streamed(chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None) -> Request:
    """A request whose body arrives in `chunks` (no content-length unless `headers` say one)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "headers": headers or []}, receive)


async def test_a_body_is_read_under_its_limit_whether_or_not_its_length_is_declared() -> None:
    assert await read_body(streamed([b"ab", b"cd"]), 4) == b"abcd"
    with pytest.raises(APIError) as caught:  # undeclared: refused once the count passes the limit
        await read_body(streamed([b"ab", b"cd", b"e"]), 4)
    assert (caught.value.status, caught.value.code) == (413, "request_too_large")
    refusal = APIError(413, "The file is too big.", code="file_too_large", param="file")
    with pytest.raises(APIError) as declared:  # declared: refused before a byte is read
        await read_body(streamed([b"ab"], [(b"content-length", b"99")]), 4, refusal)
    assert declared.value is refusal
