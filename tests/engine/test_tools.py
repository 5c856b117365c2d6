"""Tool calls in the engine, on a tiny random model whose chat template renders tools (Hermes style): the calls'
grammar makes well-formed calls with arguments valid under their schema, whatever the weights, per tool choice;
a resume in the middle of a call goes on as the uninterrupted run; a template without tools is refused. A seeded
request samples the same tokens alone and in a batch, so the requests of a test run together."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from client.tool_calls import SYNTAXES, ToolCall, ToolCallParser
from testing.tiny_models import TOOL_CHAT_TEMPLATE, save_tiny_model
from worker.engine import EngineRequest, Finish, GenerationParams, RequestRejected, Resume

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["city", "days", "where", "notes"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tools"), "qwen2", chat_template=TOOL_CHAT_TEMPLATE)


async def run(engine: Any, request: EngineRequest) -> tuple[str, list[int], Finish | None, str | None]:
    text, tokens, finish, syntax = "", [], None, None
    async for delta in engine.submit(request):
        text += delta.text
        tokens += delta.token_ids
        finish, syntax = delta.finish_reason, delta.tool_syntax or syntax
    return text, tokens, finish, syntax


def parsed(text: str, syntax: str | None) -> tuple[str, list[ToolCall]]:
    assert syntax == "hermes"
    parser = ToolCallParser(SYNTAXES[syntax], "r")
    content = parser.feed(text)[0] + parser.finish()
    return content, parser.tool_calls()


def tool_request(request_id: str, seed: int | None = None, **fields: Any) -> EngineRequest:
    params = GenerationParams(max_new_tokens=300, temperature=1.0 if seed is not None else 0.0, seed=seed)
    return EngineRequest(request_id, messages=ASK, tools=TOOLS, params=params, **fields)


def assert_valid(calls: list[ToolCall]) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])  # strict JSON: no raw control chars


@pytest.mark.parametrize("parallel", [True, False])
async def test_required_answers_are_calls_valid_under_their_schemas(
    tool_model_dir: Path, make_engine: Any, parallel: bool
) -> None:
    engine = await make_engine(tool_model_dir, max_running=16)
    requests = [
        tool_request(f"r{seed}", seed, tool_choice="required", parallel_tool_calls=parallel) for seed in range(8)
    ]
    ended = 0
    for text, _, finish, syntax in await asyncio.gather(*(run(engine, request) for request in requests)):
        content, calls = parsed(text, syntax)
        if finish == Finish.LENGTH:  # cut short inside a call: nothing more to hold it to
            continue
        ended += 1
        assert finish == Finish.EOS and content == ""  # nothing but calls
        assert_valid(calls)
        if not parallel:
            assert len(calls) == 1
    assert ended >= 4  # a random model rambles in a string now and then, but the grammar ends most calls


async def test_a_named_choice_is_one_call_of_that_function(tool_model_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(tool_model_dir)
    named = {"type": "function", "function": {"name": "get_weather"}}
    requests = [tool_request(f"n{seed}", seed, tool_choice=named) for seed in range(4)]
    for text, _, finish, syntax in await asyncio.gather(*(run(engine, request) for request in requests)):
        content, calls = parsed(text, syntax)
        if finish != Finish.LENGTH:
            assert content == "" and [call.name for call in calls] == ["get_weather"]
            assert_valid(calls)


async def test_auto_parses_and_none_renders_the_tools_but_names_no_syntax(
    tool_model_dir: Path, make_engine: Any
) -> None:
    engine = await make_engine(tool_model_dir)
    _, _, _, syntax = await run(engine, tool_request("auto", 3))
    assert syntax == "hermes"
    none = engine.submit(tool_request("none", 3, tool_choice="none"))
    plain = engine.submit(EngineRequest("plain", messages=ASK, params=GenerationParams(max_new_tokens=2)))
    deltas = [delta async for delta in none]
    assert all(delta.tool_syntax is None for delta in deltas)
    assert none.prompt_tokens > plain.prompt_tokens + 50  # the tools are in the prompt
    async for _ in plain:
        pass


async def test_a_resume_inside_a_call_goes_on_as_the_uninterrupted_run(tool_model_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(tool_model_dir)
    text, tokens, _, syntax = await run(engine, tool_request("whole", tool_choice="required"))
    _, calls = parsed(text, syntax)
    assert calls and calls[0].arguments
    cut = next(i for i in range(1, len(tokens)) if '"arguments": {' in engine.tokenizer.decode(tokens[:i]))
    delivered = engine.tokenizer.decode(tokens[: cut + 3], skip_special_tokens=True)
    resumed = tool_request("resumed", tool_choice="required", resume=Resume(tokens[: cut + 3], delivered))
    rest_text, rest, _, _ = await run(engine, resumed)
    assert tokens[: cut + 3] + rest == tokens
    assert delivered + rest_text == text


async def test_conversations_with_calls_and_answers_render_through_the_template(
    tool_model_dir: Path, make_engine: Any
) -> None:
    engine = await make_engine(tool_model_dir)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}
    turns = [*ASK, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "9"}]
    stream = engine.submit(
        EngineRequest("turns", messages=turns, tools=TOOLS, params=GenerationParams(max_new_tokens=2))
    )
    rendered = engine.tokenizer.decode(stream.request.prompt_ids)
    assert '{"name": "get_time", "arguments": {"tz": "CET"}}' in rendered and "<tool_response>\n9" in rendered
    async for _ in stream:
        pass
    broken = [*ASK, {"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(RequestRejected) as caught:
        engine.submit(EngineRequest("broken", messages=broken, params=GenerationParams(max_new_tokens=2)))
    assert caught.value.param == "messages"


async def test_a_template_without_tools_is_refused_naming_tools(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    for choice in ("auto", "none"):
        with pytest.raises(RequestRejected) as caught:
            engine.submit(tool_request(choice, tool_choice=choice))
        assert caught.value.param == "tools" and "no tool support" in str(caught.value)
