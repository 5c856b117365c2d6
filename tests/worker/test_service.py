"""A worker in this process (the scripted engine, a real redis-server) driven through the client: the service's
logic, fast; the real engine is exercised by tests/engine, tests/e2e and the poison tests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import msgpack
import pytest
from redis.asyncio import Redis
from redis.exceptions import SlotNotCoveredError, WatchError

from client import AsyncClient, AsyncJob, RequestExpired, RequestFailed
from client.protocol import decode_event, decode_request, ms_now
from client.store import CONSUMER_GROUP, Keys
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until
from worker.cancels import CancelListener
from worker.intake import Intake

KEYS = Keys("default")


async def backlog_is_empty(redis: Redis) -> bool:
    return await redis.xlen(KEYS.requests) == 0


async def raw_entries(redis: Redis, key: str) -> list[Any]:
    return [decode_event(fields[b"m"]) for _, fields in await redis.xrange(key)]


async def test_requests_round_trip_and_leave_no_backlog(start_worker: Any, client: AsyncClient, redis_url: str) -> None:
    await start_worker()
    prompts = [[3 + i, 4, 5, 6 + i] for i in range(6)]
    expected = [expected_tokens(p, 12) for p in prompts]
    jobs = [await client.submit(input_ids=p, max_new_tokens=12, temperature=0) for p in prompts]
    results = await asyncio.gather(*(job.result(timeout=30) for job in jobs))
    for result, want in zip(results, expected, strict=True):
        assert result.token_ids == want
        assert result.finish_reason == "length"
        assert result.usage.completion_tokens == len(want) and result.usage.prompt_tokens == 4
        assert result.timings.total_ms is not None and result.timings.total_ms >= 0
    async with Redis.from_url(redis_url) as redis:
        await wait_until(lambda: backlog_is_empty(redis))  # acknowledged and deleted
        assert (await redis.xpending(KEYS.requests, CONSUMER_GROUP))["pending"] == 0
        assert 0 < await redis.ttl(KEYS.result(jobs[0].id)) <= 3600


async def test_a_worker_recreates_the_group_when_redis_comes_back_without_its_data(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    """Redis restarted empty (no persistence) drops the consumer group: the worker used to fail every read with
    NOGROUP forever; it recreates the group and serves what is submitted next."""
    await start_worker()
    assert (await (await client.submit(input_ids=[3, 4], max_new_tokens=2)).result(timeout=30)).token_ids
    async with Redis.from_url(redis_url) as redis:
        await redis.flushall()
    job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=4, temperature=0)
    assert (await job.result(timeout=30)).token_ids == expected_tokens([3, 4, 5], 4)


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
    job = await client.submit(input_ids=[3, 4], max_new_tokens=50, deadline=datetime.now(UTC) - timedelta(seconds=1))
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
        await wait_until(lambda: backlog_is_empty(redis))


async def test_heartbeat_reports_the_worker(start_worker: Any, client: AsyncClient) -> None:
    running = await start_worker()
    await (await client.submit(input_ids=[3, 4], max_new_tokens=5, temperature=0, ignore_eos=True)).result(timeout=30)

    async def reported() -> bool:
        return any(w.tokens_generated == 5 for w in (await client.status()).workers)

    await wait_until(reported)
    status = await client.status()
    (info,) = status.workers
    assert info.id == running.worker.settings.worker_id
    assert info.kv_total_blocks == 2048 // 16 and info.tokens_generated == 5 and info.running == 0
    assert status.depth == 0


async def test_request_claimed_too_often_goes_to_the_dead_letters(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    job = await client.submit(input_ids=[3, 4], max_new_tokens=5, temperature=0)
    async with Redis.from_url(redis_url) as redis:
        await redis.xgroup_create(KEYS.requests, CONSUMER_GROUP, id="0", mkstream=True)
        await redis.xreadgroup(CONSUMER_GROUP, "ghost", {KEYS.requests: ">"})  # a worker that then died
        await redis.hset(KEYS.fence(job.id), "h", 100)  # handed back 100 times: beyond the forgiven ones, they count
        await start_worker(lease_timeout_s=0.3, claim_interval_s=0.1, max_deliveries=1, max_hand_backs=0)
        with pytest.raises(RequestFailed) as failure:
            await job.result(timeout=30)
        assert failure.value.code == "delivery_limit"
        (dead,) = await redis.xrange(KEYS.dead)
        assert "max_deliveries 1" in msgpack.unpackb(dead[1][b"m"])["reason"]
        await wait_until(lambda: backlog_is_empty(redis))


async def test_dead_workers_request_is_claimed_and_resumed(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    """A worker died after publishing 4 tokens: another claims the request and continues the same stream."""
    running = await start_worker(lease_timeout_s=0.3, claim_interval_s=0.1)
    expected = expected_tokens([3, 4, 5], 12)
    running.stop.set()
    await running.task
    job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=12, temperature=0)
    async with Redis.from_url(redis_url) as redis:
        (entry_id, fields), *_ = (await redis.xreadgroup(CONSUMER_GROUP, "ghost", {KEYS.requests: ">"}))[0][1]
        submitted = decode_request(fields[b"m"]).submitted
        first_start, first_token = submitted + 100, submitted + 300  # what the dead worker recorded
        await redis.hset(KEYS.fence(job.id), mapping={"a": 1, "n": 4, "s": first_start})
        event = {"v": 1, "type": "tokens", "seq": 0, "ids": expected[:4], "text": "partial"}
        await redis.xadd(KEYS.result(job.id), {b"m": msgpack.packb(event)}, id=f"{first_token}-0")
        await start_worker(lease_timeout_s=0.3, claim_interval_s=0.1)
        result = await job.result(timeout=30)
        assert result.token_ids == expected
        # Timings describe the whole request: the first attempt's start and first token, not the resumed one's.
        assert (result.timings.queue_ms, result.timings.ttft_ms) == (100, 300)
        assert await redis.hget(KEYS.fence(job.id), "a") == b"2"  # the claim raised the attempt
        events = [decode_event(f[b"m"]) for _, f in await redis.xrange(KEYS.result(job.id))]
        seqs = [e.seq for e in events if e.type == "tokens"]
        assert seqs[0] == 0 and seqs[1] == 4 and entry_id


async def test_engine_failure_hands_the_request_back_and_it_completes(start_worker: Any, client: AsyncClient) -> None:
    running = await start_worker(lease_timeout_s=5.0, claim_interval_s=0.1, step_s=0.01)
    job = await client.submit(input_ids=[5, 6, 7], max_new_tokens=30, temperature=0)
    async for _ in job.stream(timeout=30):
        running.worker.engine.fail_next_step()  # the engine dies under it after its first token
        break
    result = await job.result(timeout=60)
    assert result.token_ids == expected_tokens([5, 6, 7], 30)  # resumed where the published tokens stop
    assert running.worker.engine.stats().restarts == 1 and running.worker.metrics.claims._value.get() >= 1


async def test_second_signal_ends_the_drain_and_hands_back(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    running = await start_worker(drain_timeout_s=60.0, step_s=0.01)
    job = await client.submit(input_ids=[3, 4], max_new_tokens=480, temperature=0, ignore_eos=True)
    async for _ in job.stream(timeout=30):
        break  # it is generating now
    running.stop.set()  # first signal: drain
    with pytest.raises(TimeoutError):  # still draining: the request may finish within the timeout
        await asyncio.wait_for(asyncio.shield(running.task), 0.3)
    running.hurry.set()  # second signal
    await asyncio.wait_for(running.task, 10)
    async with Redis.from_url(redis_url) as redis:
        (pending,) = await redis.xpending_range(KEYS.requests, CONSUMER_GROUP, min="-", max="+", count=10)
    assert pending["time_since_delivered"] > 3600 * 1000  # handed back: claimable by any worker at once


async def test_intake_pauses_while_undelivered_output_is_over_its_bound(
    start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.publisher import Publisher

    running = await start_worker(max_buffered_events=2)
    worker = running.worker
    assert worker.free_slots() == worker.engine.free_slots() > 0
    monkeypatch.setattr(Publisher, "backlog", property(lambda self: 3))  # as if Redis were away
    assert worker.free_slots() == 0


async def test_claiming_its_own_request_restarts_it_as_one_stream(start_worker: Any, client: AsyncClient) -> None:
    """A worker whose lease lapsed (its renewals failed) may claim its own request: the old run stops and the
    new attempt continues the same stream."""
    running = await start_worker(lease_timeout_s=0.2, lease_renew_s=30.0, claim_interval_s=0.1, max_deliveries=1000)
    expected = expected_tokens([3, 4, 5, 6], 400)
    job = await client.submit(input_ids=[3, 4, 5, 6], max_new_tokens=400, temperature=0)
    result = await job.result(timeout=60)
    assert result.token_ids == expected
    assert running.worker.metrics.claims._value.get() >= 1


async def test_a_worker_rides_out_the_errors_redis_pys_cluster_client_raises_outside_redis_error(
    start_worker: Any, client: AsyncClient
) -> None:
    """During a shard's failover redis-py's cluster client raises `SlotNotCoveredError` (no `RedisError`) and, from
    its asyncio client, `AttributeError` from a connection torn down under a command. The worker's loops (read,
    publish, renew, heartbeat) treat both as Redis being away: a stream that was running ends whole, and the
    worker serves new requests after."""
    running = await start_worker(step_s=0.01)
    redis = running.worker.redis
    send = redis.execute_command
    failing_until = 0.0

    async def torn(*args: Any, **options: Any) -> Any:
        if asyncio.get_running_loop().time() < failing_until:
            if args[0] in ("HSET", "EVALSHA"):
                raise AttributeError("'NoneType' object has no attribute 'writelines'")
            raise SlotNotCoveredError("Slot 6918 is not covered by the cluster")
        return await send(*args, **options)

    redis.execute_command = torn  # type: ignore[method-assign]
    job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=60, temperature=0)
    seen: list[int] = []
    async for delta in job.stream(timeout=60):
        seen += delta.token_ids
        if len(seen) == 5:
            failing_until = asyncio.get_running_loop().time() + 1.5
    assert seen == expected_tokens([3, 4, 5], 60)
    assert failing_until > 0 and not running.task.done()
    after = await client.submit(input_ids=[7, 8], max_new_tokens=4, temperature=0)
    assert (await after.result(timeout=30)).token_ids == expected_tokens([7, 8], 4)


async def test_a_worker_whose_cancellation_redis_py_swallows_still_stops(
    start_worker: Any, client: AsyncClient
) -> None:
    """redis-py can lose a cancellation (on Python 3.11 its send path's `wait_for` returns the result instead):
    simulated here by a call that catches it and answers. The worker's task ends all the same, without draining
    (its requests stay pending for another worker to claim, as after a crash)."""
    running = await start_worker(step_s=0.01)
    redis = running.worker.redis
    send = redis.execute_command

    in_the_read_loop = asyncio.Event()

    async def swallowing(*args: Any, **options: Any) -> Any:
        if asyncio.current_task() is running.task:
            in_the_read_loop.set()
            with contextlib.suppress(asyncio.CancelledError):  # lost: from above, the call returns normally
                await asyncio.sleep(0.2)
        return await send(*args, **options)

    job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=500)
    async for _ in job.stream(timeout=30):
        break
    redis.execute_command = swallowing  # type: ignore[method-assign]
    await asyncio.wait_for(in_the_read_loop.wait(), 10)
    running.task.cancel()
    await asyncio.wait([running.task], timeout=10)
    assert running.task.cancelled()
    assert (await client.status()).pending == 1  # not handed back: a cancelled worker is a crashed one


async def test_a_worker_whose_helper_dies_drains_and_exits_with_the_error(
    start_worker: Any, client: AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that can no longer hear cancels (or renew leases, or publish) must not serve on half-blind: it
    stops, and `run` raises, so the process exits non-zero and its supervisor restarts it."""

    async def dies(self: CancelListener, finished: asyncio.Event) -> None:
        raise KeyError("a bug in the cancel listener")

    monkeypatch.setattr(CancelListener, "run", dies)
    running = await start_worker()
    with pytest.raises(RuntimeError, match="worker loop died") as raised:
        await asyncio.wait_for(running.task, 30)
    assert isinstance(raised.value.__cause__, KeyError)


async def test_a_stream_that_lost_its_last_writes_is_resumed_from_what_it_holds(
    start_worker: Any, client: AsyncClient, redis_url: str
) -> None:
    """What a failover with asynchronous replication can do: the promoted replica lacks the last events of a
    running request's stream (and its fence counts only what it holds). Simulated here by cutting the stream's
    tail and the fence's count together, mid-stream. The worker must not write on past the hole: it hands the
    request back, it is resumed from what the stream holds, and the stream ends whole, without a gap."""
    await start_worker(step_s=0.01)
    job = await client.submit(input_ids=[3, 4, 5], max_new_tokens=120, temperature=0)
    seen: list[int] = []
    cut = False
    async with Redis.from_url(redis_url) as redis:
        async for delta in job.stream(timeout=60):
            seen += delta.token_ids
            if len(seen) >= 30 and not cut:
                await cut_the_tail(redis, job.id, keep=10)
                cut = True
        events = await raw_entries(redis, KEYS.result(job.id))
    assert seen == expected_tokens([3, 4, 5], 120)  # the reader saw each token once (the repeats are skipped)
    tokens = [event for event in events if event.type == "tokens"]
    assert [t.seq for t in tokens] == list(itertools.accumulate([0] + [len(t.ids) for t in tokens[:-1]]))  # no gap
    assert [i for t in tokens for i in t.ids] == expected_tokens([3, 4, 5], 120)
    assert events[-1].type == "done"


async def cut_the_tail(redis: Redis, request_id: str, keep: int) -> None:
    """Deletes a result stream's entries after the first `keep` and sets the fence's token count to what is left,
    in one transaction against the worker's writes."""
    result, fence = KEYS.result(request_id), KEYS.fence(request_id)
    async with redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                await pipe.watch(result, fence)
                entries = await pipe.xrange(result)
                left = [decode_event(fields[b"m"]) for _, fields in entries[:keep]]
                pipe.multi()
                pipe.xdel(result, *[entry_id for entry_id, _ in entries[keep:]])
                pipe.hset(fence, "n", sum(len(event.ids) for event in left if event.type == "tokens"))
                await pipe.execute()
                return
            except WatchError:
                continue


async def test_a_cancel_that_comes_between_the_marks_read_and_the_start_still_cancels(
    start_worker: Any, client: AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intake reads a request's cancel mark, then the engine starts it: a cancel whose message arrives in
    between found nothing to cancel in the engine and was lost (the request ran to its end). The listener remembers
    it, and the start applies it."""
    running = await start_worker(step_s=0.01)
    listener = running.worker.cancels[0]
    prepare = Intake.prepare

    async def cancel_after_the_read(self: Intake, accepted: list[Any], *args: Any, **kwargs: Any) -> Any:
        ready, refused = await prepare(self, accepted, *args, **kwargs)  # the mark read: not cancelled
        for item in ready:
            await AsyncJob.attach(client, item.accepted.request.id).cancel()
            await wait_until(lambda item=item: listener.heard(item.accepted.request.id))
        return ready, refused

    monkeypatch.setattr(Intake, "prepare", cancel_after_the_read)
    job = await client.submit(input_ids=[3, 4], max_new_tokens=300)
    async for _ in job.stream(timeout=30):
        pass
    assert job.finish_reason == "cancelled"
