"""`reply_to`: a request's final result also lands on a shared stream, in the same write as its terminal event,
so a pipeline stage reads completions with its own consumer group: each completion once per group, also
when the request was resumed after its worker died (scripted engine, real redis-server)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import msgpack
import pytest
from redis.asyncio import Redis

from client import AsyncClient, RequestExpired
from client.protocol import Completion, decode_completion
from client.store import CONSUMER_GROUP, Keys
from testing.scripted_engine import expected_tokens, text_of
from tests.polling import wait_until

KEYS = Keys("default")
STAGE = KEYS.reply("stage2")


async def consume(redis: Redis, group: str) -> list[Completion]:
    """Everything a consumer group of the reply stream gets, acknowledging as it goes."""
    await redis.xgroup_create(STAGE, group, id="0", mkstream=True)
    seen = []
    while reply := await redis.xreadgroup(group, "c1", {STAGE: ">"}, count=100):
        for _key, entries in reply:
            for entry_id, fields in entries:
                seen.append(decode_completion(fields[b"m"]))
                await redis.xack(STAGE, group, entry_id)
    return seen


async def test_each_completion_reaches_each_consumer_group_once(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    await start_worker()
    prompts = [[3 + i, 4, 5] for i in range(20)]
    jobs = [await client.submit(input_ids=p, max_new_tokens=6, reply_to="stage2") for p in prompts]
    expired = await client.submit(
        input_ids=[3], max_new_tokens=6, reply_to="stage2", deadline=datetime.now(UTC) - timedelta(seconds=1)
    )
    results = await asyncio.gather(*(job.result(timeout=30) for job in jobs))
    with pytest.raises(RequestExpired):
        await expired.result(timeout=30)
    async with Redis.from_url(redis_url) as redis:
        for group in ("indexer", "auditor"):
            completions = await consume(redis, group)
            by_id = {c.id: c for c in completions}
            assert len(completions) == len(by_id) == 21, group
            for job, result in zip(jobs, results, strict=True):
                completion = by_id[job.id]
                assert completion.done is not None and completion.error is None
                assert (completion.text, completion.ids) == (result.text, result.token_ids)
                assert completion.done.usage == result.usage
            assert by_id[expired.id].error is not None and by_id[expired.id].error.code == "expired"


async def test_a_resumed_request_completes_once_with_its_whole_output(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    """A worker died after publishing 4 tokens; another resumes it: one completion, with all 12 tokens. A second
    request's worker died after its final write but before acknowledging: its completion is not repeated."""
    resumed = await client.submit(input_ids=[3, 4, 5], max_new_tokens=12, reply_to="stage2")
    ended = await client.submit(input_ids=[6, 7], max_new_tokens=3, reply_to="stage2")
    expected = expected_tokens([3, 4, 5], 12)
    async with Redis.from_url(redis_url) as redis:
        await redis.xgroup_create(KEYS.requests, CONSUMER_GROUP, id="0", mkstream=True)
        await redis.xreadgroup(CONSUMER_GROUP, "ghost", {KEYS.requests: ">"})  # a worker that then died
        await redis.hset(KEYS.fence(resumed.id), mapping={"a": 1, "n": 4})
        partial = {"v": 1, "type": "tokens", "seq": 0, "ids": expected[:4], "text": "".join(map(text_of, expected[:4]))}
        await redis.xadd(KEYS.result(resumed.id), {b"m": msgpack.packb(partial)})
        # `ended`: everything published, the completion too, in the dead worker's last write.
        await redis.hset(KEYS.fence(ended.id), mapping={"a": 1, "n": 4})
        tokens = {"v": 1, "type": "tokens", "seq": 0, "ids": [9, 9, 9], "text": "x"}
        usage = {"prompt_tokens": 2, "completion_tokens": 3}
        done = {"v": 1, "type": "done", "finish_reason": "length", "usage": usage}
        for event in (tokens, done):
            await redis.xadd(KEYS.result(ended.id), {b"m": msgpack.packb(event)})
        earlier = {"v": 1, "type": "completion", "id": ended.id, "text": "x", "ids": [9, 9, 9], "done": done}
        await redis.xadd(STAGE, {b"m": msgpack.packb(earlier)})

        await start_worker(lease_timeout_s=0.3, claim_interval_s=0.1)
        assert (await resumed.result(timeout=30)).token_ids == expected
        await wait_until(lambda: backlog_empty(redis))
        completions = await consume(redis, "indexer")
    assert sorted(c.id for c in completions) == sorted([resumed.id, ended.id])
    (whole,) = [c for c in completions if c.id == resumed.id]
    assert whole.ids == expected and whole.text == "".join(map(text_of, expected))


async def backlog_empty(redis: Redis) -> bool:
    return await redis.xlen(KEYS.requests) == 0


def test_reply_to_is_a_name() -> None:
    from client.errors import InvalidRequest
    from client.protocol import parse_request

    request = parse_request({"v": 1, "id": "r", "prompt": "x", "submitted": 1, "reply_to": "stage-2"})
    assert request.reply_to == "stage-2"
    for bad in ("", "has space", "{brace}", 5):
        try:
            parse_request({"v": 1, "id": "r", "prompt": "x", "submitted": 1, "reply_to": bad})
        except InvalidRequest:
            continue
        raise AssertionError(f"reply_to={bad!r} was accepted")
