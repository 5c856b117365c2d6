"""`submit(n=...)` on a real redis-server, through both twins: n requests under derived ids with their own seeds,
one interleaved stream with each delta's `index`, one result with every choice, and a failure that stops the rest.

The test plays the worker: it writes events to the result streams with XADD, as the publisher does.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from client import AsyncChoices, Cancelled, Choices, Delta, InvalidRequest, QueueFull, RequestFailed, _core, protocol
from client.protocol import choice_ids
from client.store import partition_of
from tests.client.test_submit import entries
from tests.client.twins import KEYS, Twin, TwinFactory, done, emit, tokens
from tests.polling import wait_until

pytestmark = pytest.mark.redis


async def test_n_submits_n_requests_under_derived_ids_each_seeded_apart(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit("hello", n=3, seed=7, temperature=0.8, request_id="call")
    assert isinstance(job.job, Choices | AsyncChoices)
    assert job.id == "call" and [choice.id for choice in job.job.jobs] == ["call-0", "call-1", "call-2"]
    requests = await entries(server)
    assert [(r.id, r.prompt, r.params.seed, r.params.temperature) for r in requests] == [
        ("call-0", "hello", 7, 0.8),
        ("call-1", "hello", 8, 0.8),
        ("call-2", "hello", 9, 0.8),
    ]


async def test_unseeded_choices_sample_on_their_own_and_n_1_is_a_plain_job(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit("hi", n=2)
    assert [r.params.seed for r in await entries(server)] == [None, None]
    assert [r.id for r in await entries(server)] == [f"{job.id}-0", f"{job.id}-1"]
    single = await twin.submit("hi", n=1, request_id="one")
    assert not isinstance(single.job, Choices | AsyncChoices) and single.id == "one"


@pytest.mark.parametrize("n", [0, 17, True, 2.0, "2"])
async def test_n_out_of_range_is_refused_before_redis(twin: Twin, server: aioredis.Redis, n: object) -> None:
    with pytest.raises(InvalidRequest, match="n must be"):
        await twin.submit("hi", n=n)
    assert await server.xlen(KEYS.requests) == 0


@pytest.mark.parametrize("seed", [True, 1.5, "7"])
async def test_a_seed_of_another_type_is_refused_for_one_choice_or_many(
    twin: Twin, server: aioredis.Redis, seed: object
) -> None:
    for n in (1, 3):
        with pytest.raises(InvalidRequest, match="seed"):
            await twin.submit("hi", n=n, seed=seed)
    assert await server.xlen(KEYS.requests) == 0


async def test_a_seed_whose_last_choice_overflows_is_refused_whole(twin: Twin, server: aioredis.Redis) -> None:
    with pytest.raises(InvalidRequest):
        await twin.submit("hi", n=3, seed=protocol.MAX_SEED - 1)
    assert await server.xlen(KEYS.requests) == 0  # every choice is checked before the first is submitted


async def test_stream_interleaves_the_choices_by_index_and_result_holds_them_all(
    twin: Twin, server: aioredis.Redis
) -> None:
    job = await twin.submit("hi", n=2, request_id="mix")
    got: list[Delta] = []
    reading = asyncio.create_task(job.collect(got, wait_s=10))
    await emit(server, "mix-1", tokens(0, [5], "B"))
    await wait_until(lambda: len(got) == 1)
    await emit(server, "mix-0", tokens(0, [1, 2], "aa"), done("eos", 2))
    await wait_until(lambda: len(got) == 2)
    assert job.finish_reason is None  # choice 1 still runs
    await emit(server, "mix-1", tokens(1, [6], "b"), done("length", 2))
    await reading
    assert got == [Delta("B", [5], 0, index=1), Delta("aa", [1, 2], 0, index=0), Delta("b", [6], 1, index=1)]
    result = await job.result(wait_s=5)
    assert (result.request_id, result.text, result.finish_reason) == ("mix", "aa", "eos")
    assert [(c.request_id, c.text, c.finish_reason) for c in result.choices or []] == [
        ("mix-0", "aa", "eos"),
        ("mix-1", "Bb", "length"),
    ]
    assert result.usage == protocol.Usage(prompt_tokens=3, completion_tokens=4)  # the prompt once, all completions
    assert job.finish_reason == "eos"


async def test_a_failing_choice_raises_and_cancels_the_others(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit("hi", n=3, request_id="bad")
    await emit(server, "bad-0", tokens(0, [1], "a"), done("eos", 1))
    await emit(server, "bad-1", protocol.ErrorEvent(code="invalid_request", message="no"))
    with pytest.raises(RequestFailed, match="no"):
        await job.result(wait_s=10)
    assert await server.exists(KEYS.cancel("bad-2"))  # the choice still running is stopped


async def test_cancel_stops_every_choice_and_result_raises_cancelled(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit("hi", n=2, request_id="stop")
    await job.cancel()
    assert all([await server.exists(KEYS.cancel(f"stop-{i}")) for i in range(2)])
    for i in range(2):
        await emit(server, f"stop-{i}", done("cancelled", 0))
    with pytest.raises(Cancelled):
        await job.result(wait_s=5)


async def test_a_queue_without_room_for_every_choice_takes_none(make_twin: TwinFactory, server: aioredis.Redis) -> None:
    twin = make_twin(max_queue_len=2)
    with pytest.raises(QueueFull, match="no room for 3 more"):
        await twin.submit("hi", n=3, request_id="all")
    assert await server.xlen(KEYS.requests) == 0 and not await server.exists(KEYS.submitted("all-0"))
    assert [choice.id for choice in (await twin.submit("hi", n=2, request_id="all")).job.jobs] == ["all-0", "all-1"]


def split_call() -> str:
    """A call id whose first choice is alone in its partition of 3 and whose other two share another one."""
    for attempt in range(1000):
        where = [partition_of(choice, 3) for choice in choice_ids(f"split{attempt}", 3)]
        if where[0] != where[1] == where[2]:
            return f"split{attempt}"
    raise AssertionError("no such id")


@pytest.mark.parametrize("named", [False, True])
async def test_a_partition_that_refuses_part_way_cancels_the_rest_unless_the_call_was_named(
    make_twin: TwinFactory, server: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, named: bool
) -> None:
    twin = make_twin(partitions=3, max_queue_len=3)  # a share of 1 per partition: the partition of two refuses
    call = split_call()
    if not named:  # the client makes the call's id up: make it this one
        monkeypatch.setattr(_core.uuid, "uuid4", lambda: SimpleNamespace(hex=call))
    with pytest.raises(QueueFull, match="no room for 2 more"):
        await twin.submit("hi", n=3, request_id=call if named else None)
    keys = twin.client.keys_for(None, f"{call}-0")
    assert await server.xlen(keys.requests) == 1  # the first partition's choice went in
    # Kept for a retry under the call's id, which attaches to it and submits the rest; else stopped.
    assert await server.exists(keys.cancel(f"{call}-0")) == (0 if named else 1)


async def test_an_id_too_long_for_its_choices_says_so(twin: Twin, server: aioredis.Redis) -> None:
    with pytest.raises(InvalidRequest, match="too long for n=2") as caught:
        await twin.submit("hi", n=2, request_id="x" * 128)
    assert caught.value.param == "id" and await server.xlen(KEYS.requests) == 0
    assert [j.id for j in (await twin.submit("hi", n=2, request_id="x" * 126)).job.jobs] == [
        "x" * 126 + "-0",
        "x" * 126 + "-1",
    ]
