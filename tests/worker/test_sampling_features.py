"""Seeds, log-probabilities, response formats and penalties through the wire, on real workers and a tiny
model: what the client gets, a seeded request resumed on another worker, and bad input refused alone."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest

from client import AsyncClient, InvalidRequest, RequestFailed
from tests.polling import wait_until

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


async def test_logprobs_and_a_response_format_reach_the_client(start_worker: Any, client: AsyncClient) -> None:
    await start_worker(real_model=True)
    job = await client.submit(input_ids=[5, 6, 7], max_new_tokens=12, temperature=0.8, seed=3, logprobs=True,
                              top_logprobs=2, ignore_eos=True)
    deltas = [delta async for delta in job.stream(timeout=60)]
    result = await job.result()
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) == 12
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in result.logprobs)
    assert any(lp.text for lp in result.logprobs) and all(isinstance(text, str) for lp in result.logprobs
                                                           for _, _, text in lp.top)
    assert [lp for delta in deltas for lp in delta.logprobs or []] == result.logprobs
    shaped = await client.submit(input_ids=[5, 6, 7], max_new_tokens=64, temperature=0,
                                 response_format=RESPONSE_FORMAT, presence_penalty=0.5)
    jsonschema.validate(json.loads((await shaped.result(timeout=60)).text), SCHEMA)


async def test_a_bad_schema_is_refused_alone_and_bad_shapes_before_submitting(
    start_worker: Any, client: AsyncClient
) -> None:
    await start_worker(real_model=True)
    good = await client.submit(input_ids=[5, 6], max_new_tokens=8, temperature=0)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    bad = await client.submit(input_ids=[5, 6], max_new_tokens=8, response_format=bad_schema)
    with pytest.raises(RequestFailed, match="does not compile") as refused:
        await bad.result(timeout=30)
    assert refused.value.code == "invalid_request"
    assert len((await good.result(timeout=30)).token_ids) > 0
    for shape in ({"type": "json_schema", "json_schema": {"name": "x"}}, {"type": "xml"}, {"type": "regex"}):
        with pytest.raises(InvalidRequest, match="response_format"):
            await client.submit(input_ids=[5, 6], response_format=shape)
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        await client.submit(input_ids=[5, 6], top_logprobs=3)
    with pytest.raises(InvalidRequest, match="presence_penalty"):
        await client.submit(input_ids=[5, 6], presence_penalty=2.5)


async def test_a_seeded_request_resumed_on_another_worker_gives_the_same_tokens(
    start_worker: Any, client: AsyncClient
) -> None:
    options = {"input_ids": [4, 5, 6], "max_new_tokens": 150, "temperature": 0.9, "seed": 11, "ignore_eos": True}
    first = await start_worker(real_model=True, drain_timeout_s=0.0, step_s=0.01)
    job = await client.submit(**options)
    seen = 0
    async for delta in job.stream(timeout=60):
        seen += len(delta.token_ids)
        if seen >= 10:
            break
    first.stop.set()  # drains for 0 s: hands the request back after its first tokens
    await asyncio.wait_for(first.task, 30)
    second = await start_worker(real_model=True, claim_interval_s=0.1)
    resumed = await job.result(timeout=120)
    assert second.worker.publisher.stats.tokens > 0  # the second worker generated the rest
    await wait_until(lambda: not second.worker.runs)
    reference = await (await client.submit(**options)).result(timeout=120)  # the same seed, uninterrupted
    assert resumed.token_ids == reference.token_ids and len(resumed.token_ids) == 150
