"""Black-box checks of the README's promises for per-request features (seed, logprobs, response formats,
request bounds), through the public client on real workers and a tiny random-weights model."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest
from redis.asyncio import Redis

from client import AsyncClient, InvalidRequest, RequestFailed, store

SEEDED = {"input_ids": [3, 9, 27, 81], "max_new_tokens": 24, "temperature": 0.9, "ignore_eos": True}


async def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch(start_worker: Any, client: AsyncClient) -> None:
    await start_worker(real_model=True)
    first = await (await client.submit(**SEEDED, seed=1234)).result(timeout=60)
    second = await (await client.submit(**SEEDED, seed=1234)).result(timeout=60)
    assert len(first.token_ids) == 24
    assert second.token_ids == first.token_ids

    others = [
        await client.submit(input_ids=[7 + i, 11, 13 + 2 * i], max_new_tokens=10 + i, temperature=0.5 + 0.05 * i,
                            seed=i, top_k=5 * i, ignore_eos=True)
        for i in range(5)
    ] + [
        await client.submit(input_ids=[40 + i] * (3 + i), max_new_tokens=20, temperature=0 if i % 2 else 1.3,
                            ignore_eos=True)
        for i in range(5)
    ]
    batched = await client.submit(**SEEDED, seed=1234)
    more = await client.submit(input_ids=[2, 4, 6], max_new_tokens=16, temperature=1.0, ignore_eos=True)
    results = await asyncio.gather(batched.result(timeout=60), *(job.result(timeout=60) for job in [*others, more]))
    assert results[0].token_ids == first.token_ids

    different = await (await client.submit(**SEEDED, seed=4321)).result(timeout=60)
    assert len(different.token_ids) == 24 and different.token_ids != first.token_ids


@pytest.mark.parametrize("k", [1, 5])
async def test_logprobs_match_the_tokens_and_their_alternatives(start_worker: Any, client: AsyncClient,
                                                                k: int) -> None:
    await start_worker(real_model=True)
    sampled = await client.submit(input_ids=[5, 8, 13], max_new_tokens=16, temperature=0.9, seed=7, logprobs=True,
                                  top_logprobs=k, ignore_eos=True)
    greedy = await client.submit(input_ids=[5, 8, 13], max_new_tokens=16, temperature=0, logprobs=True,
                                 top_logprobs=k, ignore_eos=True)
    for job, is_greedy in ((sampled, False), (greedy, True)):
        result = await job.result(timeout=60)
        assert result.logprobs is not None
        assert len(result.logprobs) == len(result.token_ids) == 16
        for token, lp in zip(result.token_ids, result.logprobs, strict=True):
            assert lp.token_id == token
            assert lp.logprob <= 0
            assert len(lp.top) == k
            values = [value for _, value, _ in lp.top]
            assert values == sorted(values, reverse=True)
            assert all(value <= 0 for value in values)
            assert lp.logprob <= values[0] + 1e-5
            if is_greedy:
                assert lp.top[0][0] == token
                assert lp.logprob == pytest.approx(values[0], abs=1e-5)


async def test_logprobs_without_alternatives(start_worker: Any, client: AsyncClient) -> None:
    await start_worker(real_model=True)
    result = await (await client.submit(input_ids=[5, 8], max_new_tokens=6, temperature=0, logprobs=True,
                                        ignore_eos=True)).result(timeout=60)
    assert result.logprobs is not None and len(result.logprobs) == 6
    assert all(lp.top == [] and lp.logprob <= 0 for lp in result.logprobs)
    plain = await (await client.submit(input_ids=[5, 8], max_new_tokens=6, temperature=0)).result(timeout=60)
    assert not plain.logprobs


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def test_response_formats_shape_the_output(start_worker: Any, client: AsyncClient) -> None:
    await start_worker(real_model=True)
    schema_jobs = [
        await client.submit(input_ids=[5, 6, 7 + i], max_new_tokens=96, temperature=t, seed=i,
                            response_format={"type": "json_schema",
                                             "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        for i, t in enumerate((0, 0.7, 1.0))
    ]
    object_jobs = [
        await client.submit(input_ids=[9, 10 + i], max_new_tokens=96, temperature=t, seed=i,
                            response_format={"type": "json_object"})
        for i, t in enumerate((0, 0.8))
    ]
    regex_jobs = [
        await client.submit(input_ids=[11, 12 + i], max_new_tokens=16, temperature=t, seed=i,
                            response_format={"type": "regex", "regex": "[0-9]{4}"})
        for i, t in enumerate((0, 1.0))
    ]
    for i, job in enumerate(schema_jobs):
        result = await job.result(timeout=60)
        context = f"schema job {i}: {result.text!r} ids={result.token_ids} finish={result.finish_reason}"
        assert result.finish_reason != "length", context
        try:
            parsed = json.loads(result.text)
        except json.JSONDecodeError as error:
            raise AssertionError(f"{context}: {error}") from error
        jsonschema.validate(parsed, SCHEMA)
    for job in object_jobs:
        result = await job.result(timeout=60)
        if result.finish_reason == "length":  # README: "unless cut by max_new_tokens"
            continue
        try:
            parsed = json.loads(result.text)
        except json.JSONDecodeError as error:
            raise AssertionError(f"json_object: {result.text!r} ids={result.token_ids}: {error}") from error
        assert isinstance(parsed, dict), result.text
    for job in regex_jobs:
        result = await job.result(timeout=60)
        assert re.fullmatch(r"[0-9]{4}", result.text), repr(result.text)


BAD_INPUTS: list[tuple[dict[str, Any], str]] = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": 10.5}, "repetition_penalty"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "regex"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": True}, "seed"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
]


@pytest.mark.parametrize(("fields", "named"), BAD_INPUTS, ids=[repr(f) for f, _ in BAD_INPUTS])
async def test_bad_input_is_refused_before_submitting(redis_url: str, client: AsyncClient, fields: dict[str, Any],
                                                      named: str) -> None:
    with pytest.raises(InvalidRequest, match=named):
        await client.submit(input_ids=[5, 6], **fields)
    redis = Redis.from_url(redis_url)
    try:
        for stream in store.Keys("default").lanes.values():
            assert await redis.xlen(stream) == 0, f"{stream} got an entry"
    finally:
        await redis.aclose()


async def test_valid_edges_are_accepted(start_worker: Any, client: AsyncClient) -> None:
    await start_worker(real_model=True)
    jobs = [
        await client.submit(input_ids=[5, 6], max_new_tokens=4, logprobs=True, top_logprobs=20, ignore_eos=True),
        await client.submit(input_ids=[5, 6], max_new_tokens=4, logprobs=True, top_logprobs=0, ignore_eos=True),
        await client.submit(input_ids=[5, 6], max_new_tokens=4, presence_penalty=2, frequency_penalty=-2,
                            repetition_penalty=10, ignore_eos=True),
        await client.submit(input_ids=[5, 6], max_new_tokens=4, seed=2**64 - 1, temperature=1, ignore_eos=True),
        await client.submit(input_ids=[5, 6], max_new_tokens=4, seed=-(2**63), temperature=1, ignore_eos=True),
    ]
    results = [await job.result(timeout=60) for job in jobs]
    assert all(len(r.token_ids) == 4 for r in results)
    assert results[0].logprobs is not None and all(len(lp.top) == 20 for lp in results[0].logprobs)


async def test_a_schema_that_cannot_compile_fails_alone(start_worker: Any, client: AsyncClient) -> None:
    await start_worker(real_model=True)
    good = await client.submit(input_ids=[5, 6, 7], max_new_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    bad = await client.submit(input_ids=[5, 6, 7], max_new_tokens=20,
                              response_format={"type": "json_schema",
                                               "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    with pytest.raises(RequestFailed) as failed:
        await bad.result(timeout=60)
    assert failed.value.code == "invalid_request"
    result = await good.result(timeout=60)
    assert len(result.token_ids) == 20
    # and the worker still serves a formatted request afterwards
    after = await client.submit(input_ids=[5, 6, 8], max_new_tokens=16, temperature=0,
                                response_format={"type": "regex", "regex": "[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{4}", (await after.result(timeout=60)).text)
