"""The submit script on a real redis-server, through both twins: idempotency, backpressure, atomicity."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
import redis.asyncio as aioredis

from client import AsyncClient, QueueFull, protocol, store
from tests.client.twins import KEYS, Twin, TwinFactory

pytestmark = pytest.mark.redis


async def entries(server: aioredis.Redis, keys: store.Keys = KEYS) -> list[protocol.GenerateRequest]:
    return [protocol.decode_request(f[protocol.ENTRY_FIELD]) for _id, f in await server.xrange(keys.requests)]


async def test_submit_writes_one_decodable_entry(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit(
        "hello", max_new_tokens=7, temperature=0.0, top_k=5, stop=["\n"], seed=1, deadline=30, request_id="r-1"
    )
    assert job.id == "r-1"
    [request] = await entries(server)
    assert (request.id, request.prompt, request.result_ttl) == ("r-1", "hello", 3600)
    assert request.params == protocol.SamplingParams(max_new_tokens=7, temperature=0.0, top_k=5, stop=["\n"], seed=1)
    assert request.deadline is not None and 29_000 < request.deadline - protocol.ms_now() <= 30_000
    assert 0 < await server.ttl(KEYS.submitted("r-1")) <= 3600


async def test_submit_is_idempotent_per_request_id(twin: Twin, server: aioredis.Redis) -> None:
    first = await twin.submit("hello", request_id="same")
    second = await twin.submit("something else", request_id="same")
    assert first.id == second.id == "same"
    assert [r.prompt for r in await entries(server)] == ["hello"]


async def test_submit_to_another_queue(twin: Twin, server: aioredis.Redis) -> None:
    await twin.submit(None, input_ids=[1, 2, 3], queue="batch")
    [request] = await entries(server, store.Keys("batch"))
    assert request.input_ids == [1, 2, 3]
    assert await server.xlen(KEYS.requests) == 0


async def test_queue_full_adds_nothing(make_twin: TwinFactory, server: aioredis.Redis) -> None:
    twin = make_twin(max_queue_len=2)
    await twin.submit(request_id="a")
    await twin.submit(request_id="b")
    with pytest.raises(QueueFull, match="'default'"):
        await twin.submit(request_id="c")
    assert await server.xlen(KEYS.requests) == 2
    assert not await server.exists(KEYS.submitted("c"))  # so a retry later is not taken for a duplicate
    # A duplicate of an accepted id is still fine at the limit, and finishing work frees room.
    assert (await twin.submit(request_id="a")).id == "a"
    first_id = (await server.xrange(KEYS.requests, count=1))[0][0]
    await server.xdel(KEYS.requests, first_id)
    assert (await twin.submit(request_id="c")).id == "c"


async def test_no_limit_when_max_queue_len_is_zero(make_twin: TwinFactory, server: aioredis.Redis) -> None:
    twin = make_twin(max_queue_len=0)
    for _ in range(5):
        await twin.submit()
    assert await server.xlen(KEYS.requests) == 5


async def test_concurrent_submits_respect_the_limit_exactly(make_twin: TwinFactory, server: aioredis.Redis) -> None:
    twin = make_twin(max_queue_len=10)
    outcomes = await asyncio.gather(*(twin.submit(request_id=f"r{i}") for i in range(50)), return_exceptions=True)
    accepted = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(accepted) == 10
    assert all(isinstance(o, QueueFull) for o in outcomes if isinstance(o, BaseException))
    assert await server.xlen(KEYS.requests) == 10
    assert len(await server.keys(KEYS.submitted("*"))) == 10


async def test_concurrent_duplicates_are_added_once(twin: Twin, server: aioredis.Redis) -> None:
    await asyncio.gather(*(twin.submit(request_id="dup") for _ in range(20)))
    assert await server.xlen(KEYS.requests) == 1


def test_an_async_client_moves_to_a_new_loop_but_refuses_two_running_at_once(redis_url: str) -> None:
    """redis-py's asyncio connections belong to their loop: a client used by one `asyncio.run` after another
    opens a new pool (the first run leaves an idle connection bound to its closed loop); a client in use on two
    running loops at once gets a clear error instead of connections shared across loops."""
    keys = store.Keys("loop-moves")
    client = AsyncClient(redis_url, queue=keys.queue)
    holding, release = threading.Event(), threading.Event()

    async def submit(request_id: str) -> str:
        return (await client.submit("hi", max_new_tokens=1, request_id=request_id)).id

    async def submit_and_hold() -> None:
        await submit("c")
        holding.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)

    assert asyncio.run(submit("a")) == "a"
    assert asyncio.run(submit("b")) == "b", "a new loop after the first one closed"
    other = threading.Thread(target=asyncio.run, args=(submit_and_hold(),))
    other.start()
    try:
        assert holding.wait(30)
        with pytest.raises(RuntimeError, match="one client per loop"):
            asyncio.run(submit("d"))
    finally:
        release.set()
        other.join(30)
    asyncio.run(client.aclose())
    with redis.Redis.from_url(redis_url) as server:
        assert [f[protocol.ENTRY_FIELD] is not None for _, f in server.xrange(keys.requests)] == [True] * 3
