"""Tool calling in the OpenAI translation: `tools`, `tool_choice` and conversations that carry calls become
`submit` arguments the wire accepts, and calls come back in OpenAI's whole and streamed shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from client import Delta, Result
from client.batch import output_line, parse_line
from client.errors import InvalidRequest
from client.openai_format import CHAT, COMPLETIONS, FieldError, choice_body, openai_param, translate
from client.protocol import GenerateRequest, Timings, Usage, parse_request
from client.tool_calls import ToolCall, ToolCallDelta
from gateway.chunks import ChunkMaker

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
]


def wire(options: dict[str, Any]) -> GenerateRequest:
    """The request `submit` would send for these options (sampling fields go under params)."""
    inputs = {"messages", "prompt", "input_ids", "tools"}
    fields = {name: value for name, value in options.items() if name in inputs}
    params = {name: value for name, value in options.items() if name not in inputs}
    return parse_request({"id": "r", "submitted": 1, **fields, "params": params})


def test_tools_and_a_conversation_with_calls_become_a_valid_wire_request() -> None:
    asked = translate(
        {"messages": CONVERSATION, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}, CHAT
    )
    assert asked.options["tools"] == [WEATHER]
    assert (asked.options["tool_choice"], asked.options["parallel_tool_calls"]) == ("required", False)
    assert asked.options["messages"][1] == {"role": "assistant", "tool_calls": [CALL]}
    assert asked.options["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    request = wire(asked.options)
    assert request.params.tool_choice == "required" and request.tools is not None
    assert request.messages is not None and request.messages[1].tool_calls is not None


@pytest.mark.parametrize("extra", [{"tools": []}, {"tool_choice": "none"}, {"tools": [], "tool_choice": "none"}])
def test_no_tools_is_a_plain_chat(extra: dict[str, Any]) -> None:
    asked = translate({"messages": [CONVERSATION[0]], **extra}, CHAT)
    assert "tools" not in asked.options
    assert wire(asked.options).tools is None


@pytest.mark.parametrize("name", ["tools", "tool_choice", "parallel_tool_calls"])
def test_tool_fields_are_refused_on_completions(name: str) -> None:
    value = {"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True}[name]
    with pytest.raises(FieldError) as caught:
        translate({"prompt": "hi", name: value}, COMPLETIONS)
    assert caught.value.field == name


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),  # names must be unique
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_tool_settings_the_wire_refuses_name_the_openai_field(extra: dict[str, Any], param: str) -> None:
    asked = translate({"messages": [CONVERSATION[0]], **extra}, CHAT)
    with pytest.raises(InvalidRequest) as caught:
        wire(asked.options)
    assert openai_param(caught.value.param or "", CHAT) == param


def test_a_whole_answer_with_calls_has_null_content_and_finishes_with_tool_calls() -> None:
    calls = [ToolCall("call_a", "get_weather", '{"city": "Paris"}'), ToolCall("call_b", "get_time", "{}")]
    choice = choice_body(CHAT, 0, "", "eos", tool_calls=calls)
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }
    assert choice["finish_reason"] == "tool_calls"
    assert choice_body(CHAT, 0, "Let me look.", "eos", tool_calls=calls)["message"]["content"] == "Let me look."
    assert choice_body(CHAT, 0, "", "length", tool_calls=calls)["finish_reason"] == "length"  # cut short
    assert choice_body(CHAT, 0, "hi", "eos", tool_calls=[])["message"] == {"role": "assistant", "content": "hi"}


def test_streamed_calls_have_openais_delta_shape() -> None:
    chunks = ChunkMaker(CHAT, "r", "m", 0)
    named = Delta(text="", token_ids=[1], seq=0, tool_calls=[ToolCallDelta(0, '{"ci', "call_a", "get_weather")])
    first = chunks.text(named, first=True)["choices"][0]["delta"]
    assert first == {
        "role": "assistant",
        "tool_calls": [
            {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}
        ],
    }
    more = chunks.text(Delta(text="", token_ids=[2], seq=1, tool_calls=[ToolCallDelta(0, 'ty": "Paris"}')]))
    assert more["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]}
    assert chunks.finish("eos", called=True)["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks.finish("eos")["choices"][0]["finish_reason"] == "stop"
    assert chunks.text(Delta(text="", token_ids=[3], seq=2))["choices"][0]["delta"] == {"content": ""}


def test_a_batch_line_with_tools_submits_them_and_writes_the_calls_in_its_output() -> None:
    body = {"model": "m", "messages": CONVERSATION[:1], "tools": [WEATHER], "tool_choice": "required"}
    line = parse_line(1, json.dumps({"custom_id": "c1", "url": CHAT, "body": body}), "file")
    assert line.problem is None and line.options["tools"] == [WEATHER] and line.options["tool_choice"] == "required"
    calls = [ToolCall("call_a", "get_weather", '{"city": "Lima"}')]
    usage = Usage(prompt_tokens=9, completion_tokens=5)
    result = Result(line.request_id, "", [1, 2], "eos", usage, Timings(), tool_calls=calls)
    message = json.loads(output_line(line, "m", result))["response"]["body"]["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
