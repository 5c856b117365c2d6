"""A worker in this process (real engine on a tiny model, real redis-server) driven through the client."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, RequestExpired, RequestFailed
from client.protocol import CONSUMER_GROUP, Keys, decode_event, ms_now
from worker.engine import EngineRequest, SamplingParams

KEYS = Keys("default")


async def engine_greedy(worker: Any, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """The engine's own greedy output for a prompt, straight from the engine, bypassing Redis."""
    stream = worker.engine.submit(
        EngineRequest(
            f"direct-{len(input_ids)}-{max_new_tokens}",
            input_ids=input_ids,
            params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0),
        )
    )
    return [token async for delta in stream for token in delta.token_ids]


async def raw_entries(redis: Redis, key: str) -> list[Any]:
    return [decode_event(fields[b"m"]) for _, fields in await redis.xrange(key)]


async def test_requests_round_trip_and_leave_no_backlog(start_worker: Any, client: AsyncClient, redis_url: str) -> None:
    running = await start_worker()
    prompts = [[3 + i, 4, 5, 6 + i] for i in range(6)]
    expected = [await engine_greedy(running.worker, p, 12) for p in prompts]
    jobs = [await client.submit(input_ids=p, max_new_tokens=12, temperature=0) for p in prompts]
    results = await asyncio.gather(*(job.result(timeout=30) for job in jobs))
    for result, want in zip(results, expected, strict=True):
        assert result.token_ids == want
        assert result.finish_reason in ("length", "eos")
        assert result.usage.completion_tokens == len(want) and result.usage.prompt_tokens == 4
        assert result.timings.total_ms is not None and result.timings.total_ms >= 0
    async with Redis.from_url(redis_url) as redis:
        await asyncio.sleep(0.1)
        assert await redis.xlen(KEYS.requests) == 0  # acknowledged and deleted
        assert (await redis.xpending(KEYS.requests, CONSUMER_GROUP))["pending"] == 0
        assert 0 < await redis.ttl(KEYS.result(jobs[0].id)) <= 3600


async def test_stream_yields_deltas_that_add_up(start_worker: Any, client: AsyncClient) -> None:
    await start_worker()
    job = await client.submit(prompt="The quick brown fox 😀", max_new_tokens=20, temperature=0, ignore_eos=True)
    deltas = [delta async for delta in job.stream(timeout=30)]
    result = await AsyncJob.attach(client, job.id).result(timeout=5)
    assert "".join(d.text for d in deltas) == result.text
    assert [t for d in deltas for t in d.token_ids] == result.token_ids and len(result.token_ids) == 20
    assert [d.seq for d in deltas] == sorted(d.seq for d in deltas) and deltas[0].seq == 0


async def test_cancel_mid_stream(start_worker: Any, client: AsyncClient) -> None:
    await start_worker()
    job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=400, temperature=0, ignore_eos=True)
    seen = 0
    async for delta in job.stream(timeout=30):
        seen += len(delta.token_ids)
        if seen >= 3:
            await job.cancel()
    assert job.finish_reason == "cancelled" and seen < 400


async def test_cancel_before_start_is_answered_without_generating(client: AsyncClient, start_worker: Any) -> None:
    job = await client.submit(input_ids=[3, 4], max_new_tokens=50, temperature=0)
    await job.cancel()  # no worker yet: only the mark is there when one reads the request
    await start_worker()
    deltas = [delta async for delta in job.stream(timeout=30)]
    assert deltas == [] and job.finish_reason == "cancelled"


async def test_expired_deadline_is_never_generated(client: AsyncClient, start_worker: Any, redis_url: str) -> None:
    job = await client.submit(input_ids=[3, 4], max_new_tokens=50, deadline=0.2)
    await asyncio.sleep(0.4)
    await start_worker()
    with pytest.raises(RequestExpired):
        await job.result(timeout=30)
    async with Redis.from_url(redis_url) as redis:
        events = await raw_entries(redis, KEYS.result(job.id))
    assert [e.type for e in events] == ["error"] and events[0].code == "expired"


async def xadd_raw(redis: Redis, body: bytes) -> None:
    await redis.xadd(KEYS.requests, {b"m": body})


def request_body(request_id: str, **fields: Any) -> bytes:
    base = {
        "v": 1,
        "id": request_id,
        "input_ids": [3, 4, 5],
        "params": {"max_new_tokens": 6, "temperature": 0.0},
        "submitted": ms_now(),
    }
    return msgpack.packb({**base, **fields})


async def test_bad_entries_get_errors_or_dead_letters_and_good_ones_complete(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    await start_worker()
    async with Redis.from_url(redis_url) as redis:
        good_before = await client.submit(input_ids=[3, 4, 5], max_new_tokens=6, temperature=0)
        await xadd_raw(redis, b"\x00\xffnot msgpack at all")
        await xadd_raw(redis, request_body("wrong-version", v=99))
        await xadd_raw(redis, request_body("unknown-field", colour="blue"))
        await xadd_raw(redis, request_body("negative-temp", params={"temperature": -1.0}))
        await xadd_raw(redis, request_body("too-long", input_ids=[3] * 600))  # context is 512
        good_after = await client.submit(input_ids=[3, 4, 5], max_new_tokens=6, temperature=0)

        first, second = await asyncio.gather(good_before.result(timeout=30), good_after.result(timeout=30))
        assert first.token_ids == second.token_ids and len(first.token_ids) == 6

        expected = {
            "wrong-version": "unsupported_version",
            "unknown-field": "invalid_request",
            "negative-temp": "invalid_request",
            "too-long": "invalid_request",
        }
        for request_id, code in expected.items():
            with pytest.raises(RequestFailed) as failure:
                await AsyncJob.attach(client, request_id).result(timeout=10)
            assert failure.value.code == code, request_id
        dead = await redis.xrange(KEYS.dead)
        assert len(dead) == 1 and msgpack.unpackb(dead[0][1][b"m"])["raw"] == b"\x00\xffnot msgpack at all"
        await asyncio.sleep(0.1)
        assert await redis.xlen(KEYS.requests) == 0


async def test_heartbeat_reports_the_worker(start_worker: Any, client: AsyncClient) -> None:
    running = await start_worker()
    await (await client.submit(input_ids=[3, 4], max_new_tokens=5, temperature=0, ignore_eos=True)).result(timeout=30)
    await asyncio.sleep(0.5)
    status = await client.status()
    (info,) = status.workers
    assert info.id == running.worker.settings.worker_id
    assert info.kv_total_blocks == 2048 // 16 and info.tokens_generated == 5 and info.running == 0
    assert status.depth == 0
