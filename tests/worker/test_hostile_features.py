"""Hostile values of the sampling features, written raw to the stream (no client checks), all at once beside
normal requests on a real worker: each gets a typed answer, and the normal requests are served meanwhile."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from client import AsyncClient, AsyncJob, RequestFailed
from client.protocol import ms_now

NESTED: dict[str, Any] = {"type": "object"}
for _ in range(200):  # a deeply nested schema, under the size bound
    NESTED = {"type": "object", "properties": {"a": NESTED}, "required": ["a"]}

HOSTILE_PARAMS: list[dict[str, Any]] = [
    {"top_logprobs": 20.0, "logprobs": True},
    {"top_logprobs": 2**63, "logprobs": True},
    {"logprobs": 1},
    {"presence_penalty": float("nan")},
    {"frequency_penalty": float("inf")},
    {"repetition_penalty": 1e-300},
    {"repetition_penalty": 10.0, "presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": NESTED}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": "y" * 70000}}}},
    {"response_format": {"type": "regex", "regex": "(a+)+$"}},
    {"response_format": {"type": "regex", "regex": "["}},
    {"response_format": {"type": "regex", "regex": ""}},
    {"response_format": {"type": "json_object"}, "ignore_eos": True},
    {"response_format": "json"},
    {"response_format": {"type": "json_object", "extra": 1}},
    {"seed": 2**64 - 1, "temperature": 1.0},
    {"seed": -(2**63), "temperature": 100.0, "top_k": 2**31 - 1, "logprobs": True, "top_logprobs": 20},
]


async def test_hostile_feature_values_get_typed_answers_while_others_are_served(
    start_worker: Any, client: AsyncClient
) -> None:
    running = await start_worker(real_model=True, max_running=16)
    raw = []
    for i, params in enumerate(HOSTILE_PARAMS * 20):  # 360 entries
        body = {"v": 1, "id": f"hostile-{i}", "input_ids": [5, 6], "params": {"max_new_tokens": 8, **params},
                "submitted": ms_now(), "result_ttl": 600}
        await running.worker.redis.xadd(client.keys.requests, {b"m": msgpack.packb(body)})
        raw.append(AsyncJob.attach(client, body["id"]))
    normal = [await client.submit(input_ids=[7, 8, i % 50], max_new_tokens=6, temperature=0) for i in range(100)]

    async def outcome(job: AsyncJob) -> str:
        try:
            await job.result(timeout=120)
            return "ok"
        except RequestFailed as error:
            return error.code

    outcomes = await asyncio.gather(*(outcome(job) for job in raw))
    served = await asyncio.gather(*(job.result(timeout=120) for job in normal))
    assert set(outcomes) <= {"ok", "invalid_request"}, outcomes
    by_case = [set(outcomes[i :: len(HOSTILE_PARAMS)]) for i in range(len(HOSTILE_PARAMS))]
    assert all(len(answers) == 1 for answers in by_case)  # every copy of a case answered alike
    assert by_case[6] == by_case[16] == by_case[17] == {"ok"}  # values at the bounds run
    assert by_case[5] == {"invalid_request"}  # a repetition penalty that would overflow the logits
    assert all(len(result.token_ids) == 6 for result in served)
    assert running.worker.engine.stats().restarts == 0 and not running.task.done()
