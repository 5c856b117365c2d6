"""Tool calls through the client library and real worker processes: calls whose arguments hold to their schema,
streamed deltas that assemble into the result's calls, and a call that survives its worker's kill -9 (resumed by
another worker into the very calls an uninterrupted run makes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from redis.asyncio import Redis

from client import AsyncClient, Result
from client.protocol import decode_completion
from client.store import Keys
from client.tool_calls import SYNTAXES, ToolCallDelta, ToolCallParser
from testing.fault_cluster import Cluster, wait_for_workers
from testing.tiny_models import TOOL_CHAT_TEMPLATE, save_tiny_model

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 30},
    },
    "required": ["city", "days", "notes"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tool-model")
    return save_tiny_model(folder, "llama", max_positions=1024, chat_template=TOOL_CHAT_TEMPLATE)


@pytest.fixture
def cluster(tmp_path: Path, model_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, model_dir)
    cluster.start_worker("w0")
    yield cluster
    cluster.close()


def assert_valid_calls(result: Result) -> None:
    assert result.tool_calls, result
    assert "<tool_call>" not in result.text
    for call in result.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert len({call.id for call in result.tool_calls}) == len(result.tool_calls)


def assembled(deltas: list[ToolCallDelta]) -> list[tuple[str | None, str | None, str]]:
    calls: dict[int, list[Any]] = {}
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = [delta.id, delta.name, ""]
        calls[delta.index][2] += delta.arguments
    return [tuple(calls[index]) for index in sorted(calls)]  # type: ignore[misc]


async def test_required_calls_hold_to_their_schema_and_stream_as_the_result_has_them(cluster: Cluster) -> None:
    async with AsyncClient(cluster.url) as client:
        await wait_for_workers(client, 1)
        for seed in range(6):
            options: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "seed": seed, "max_new_tokens": 200}
            job = await client.submit(messages=ASK, temperature=1.0, **options)
            deltas: list[ToolCallDelta] = []
            content = ""
            async for delta in job.stream(60):
                deltas += delta.tool_calls or []
                content += delta.text
            result = await job.result(60)
            if result.finish_reason == "length":  # a random model may go on until cut short: nothing to check
                continue
            assert_valid_calls(result)
            assert result.finish_reason == "eos"
            assert content == result.text
            assert assembled(deltas) == [(c.id, c.name, c.arguments) for c in result.tool_calls or []]
        named = {"type": "function", "function": {"name": "get_time"}}
        single = await client.submit(
            messages=ASK, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, reply_to="stage2"
        )
        result = await single.result(60)
        assert [call.name for call in result.tool_calls or []] == ["get_time"]
        async with Redis.from_url(cluster.url) as redis:  # a pipeline stage reading completions parses them alike
            [(_, [(_, fields)])] = await redis.xread({Keys("default").reply("stage2"): "0"})
        completion = decode_completion(fields[b"m"])
        assert completion.done is not None and completion.done.tool_syntax is not None
        parser = ToolCallParser(SYNTAXES[completion.done.tool_syntax], completion.id)
        parser.feed(completion.text)
        assert parser.tool_calls() == result.tool_calls


async def test_a_call_resumed_after_its_worker_is_killed_is_the_call_an_uninterrupted_run_makes(
    cluster: Cluster,
) -> None:
    options: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_new_tokens": 400}
    async with AsyncClient(cluster.url) as client:
        await wait_for_workers(client, 1)
        reference = await (await client.submit(messages=ASK, request_id="reference", **options)).result(120)
        job = await client.submit(messages=ASK, request_id="killed", **options)
        deltas: list[ToolCallDelta] = []
        stream = job.stream(120)
        async for delta in stream:
            deltas += delta.tool_calls or []
            if any(d.arguments for d in deltas):  # inside the first call's arguments
                break
        cluster.kill("w0")
        cluster.start_worker("w1")
        async for delta in stream:
            deltas += delta.tool_calls or []
        result = await job.result(120)
    assert result.token_ids == reference.token_ids  # greedy: the resumed run goes on as the first would have
    assert [(c.name, c.arguments) for c in result.tool_calls or []] == [
        (c.name, c.arguments) for c in reference.tool_calls or []
    ]
    assert assembled(deltas) == [(c.id, c.name, c.arguments) for c in result.tool_calls or []]
    if result.finish_reason == "eos":
        assert_valid_calls(result)
    finished_by_w1 = [line for line in cluster.log("w1").splitlines() if '"finished"' in line and '"killed"' in line]
    assert finished_by_w1, "the request ended before its worker was killed: nothing was resumed"
