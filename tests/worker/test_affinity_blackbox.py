"""Black-box: cache affinity across workers, from the documentation only.

The contract: docs/workers.md ("Settings": `LLMQ_AFFINITY_WAIT_MS`; "Prefix caching"; "Cache affinity across
workers"), docs/protocol.md (the entry field `k` and the `:affinity:*` keys), docs/operations/metrics.md
(`llmq:affinity_entries_total`) and the CHANGELOG's "Cache affinity" bullet. The surface used: the client
(`AsyncClient`, `Client`, `AsyncJob.attach`), `client.affinity.affinity_key`, the key names of `client.store.Keys`,
worker `Settings` through the `start_worker` fixture (in-process workers on a real redis-server; the scripted
engine's `submitted` list says which worker ran which request), and each worker's Prometheus registry.

Workers get fixed ids, so rendezvous hashing gives every run the same owners: a test that needs keys on more than
one worker passes or fails the same way every time. Routing tests that must see every request of a key on its
owner use a long `LLMQ_AFFINITY_WAIT_MS` (seconds), so a worker slowed by a busy machine is not stolen from.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Cancelled, Client
from client.affinity import affinity_key
from client.protocol import ENTRY_FIELD, GenerateRequest, decode_request, encode, ms_now
from client.store import Keys
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until

KEYS = Keys("default")
AFFINITY_FIELD = b"k"  # docs/protocol.md: "A fourth field `k` is the request's cache-affinity key"
HEX16 = re.compile(rb"[0-9a-fA-F]{16}")  # "16 hex digits"
OUTCOMES = ("assigned", "taken", "stolen", "overflow")
RESULT_TIMEOUT_S = 20.0
LONG_WAIT_MS = 5000  # routing tests: an owner with a free slot always takes its entries within this


# --- helpers ---------------------------------------------------------------------------------------------------


def request(**fields: Any) -> GenerateRequest:
    values: dict[str, Any] = {"id": "r-1", "submitted": ms_now(), **fields}
    return GenerateRequest(**values)


def key_of(**fields: Any) -> bytes:
    return affinity_key(request(**fields))


def prompt(key: int, question: int, width: int = 300) -> str:
    """A prompt whose first `width` characters depend only on `key` (a "document"), then a question."""
    head = f"document {key:03d}: "
    return (head + "lorem ipsum dolor sit amet " * 20)[:width] + f" question {question}?"


def affinity_counts(running: Any) -> dict[str, float]:
    """`llmq:affinity_entries_total` of one worker, by `outcome`, read from its registry as /metrics serves it."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(running.worker.metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == "llmq:affinity_entries_total":
                counts[sample.labels["outcome"]] = sample.value
    return counts


def fleet_counts(workers: Sequence[Any]) -> dict[str, float]:
    totals = dict.fromkeys(OUTCOMES, 0.0)
    for running in workers:
        for outcome, value in affinity_counts(running).items():
            totals[outcome] += value
    return totals


def ran_on(workers: Sequence[Any], request_id: str) -> list[int]:
    """Indexes of the workers whose scripted engine ran `request_id`."""
    return [i for i, running in enumerate(workers) if request_id in running.worker.engine.submitted]


async def reports(redis: Redis, keys: Keys = KEYS) -> dict[str, list[int]]:
    """`:affinity:workers`: worker -> the numbers of its report (free slots, then the Redis time it reported)."""
    raw = await redis.hgetall(keys.affinity_workers)
    return {
        name.decode(errors="replace"): [int(n) for n in re.findall(rb"-?\d+", value)] for name, value in raw.items()
    }


async def wait_reported(redis: Redis, names: Sequence[str], keys: Keys = KEYS) -> None:
    async def reported() -> bool:
        return set(names) <= set(await reports(redis, keys))

    await wait_until(reported, 10)


async def redis_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return seconds * 1000 + micros // 1000


async def run_sequentially(client: AsyncClient, prompts: Sequence[str], **options: Any) -> list[str]:
    """Submits each prompt after the previous one finished; checks every answer is the scripted one."""
    ids = []
    tokens = options.pop("max_new_tokens", 2)
    for text in prompts:
        job = await client.submit(prompt=text, max_new_tokens=tokens, **options)
        result = await job.result(timeout=RESULT_TIMEOUT_S)
        assert result.token_ids == expected_tokens(list(text.encode()), tokens)
        ids.append(job.id)
    return ids


async def run_burst(client: AsyncClient, prompts: Sequence[str], tokens: int = 2) -> list[str]:
    jobs = [await client.submit(prompt=text, max_new_tokens=tokens) for text in prompts]
    for job, text in zip(jobs, prompts, strict=True):
        result = await job.result(timeout=RESULT_TIMEOUT_S)
        assert result.token_ids == expected_tokens(list(text.encode()), tokens), job.id
    return [job.id for job in jobs]


def assert_each_key_on_one_worker(workers: Sequence[Any], ids_by_key: dict[int, list[str]]) -> dict[int, int]:
    """Every request of a key ran exactly once, all on one worker; returns key -> that worker."""
    owners = {}
    for key, ids in ids_by_key.items():
        where = [ran_on(workers, request_id) for request_id in ids]
        assert all(len(w) == 1 for w in where), f"key {key}: a request ran twice or never: {where}"
        assert len({w[0] for w in where}) == 1, f"key {key}: its requests ran on several workers: {where}"
        owners[key] = where[0][0]
    return owners


async def pending_total(redis: Redis, keys: Keys = KEYS) -> int:
    """Entries delivered (or given) to a worker and not acknowledged, over every lane of one partition."""
    total = 0
    for stream in keys.lanes.values():
        with contextlib.suppress(Exception):  # a lane nobody created yet
            total += (await redis.xpending(stream, "workers"))["pending"]
    return total


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    connection = Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


@contextlib.asynccontextmanager
async def fake_report(redis: Redis, name: str, free: int = 8) -> AsyncIterator[None]:
    """A worker that reports free slots in `:affinity:workers` (in the format live workers write) and never
    reads: one that died right after it reported, kept fresh for as long as the block runs."""

    done = asyncio.Event()

    async def report_until_done() -> None:
        while not done.is_set():
            await redis.hset(KEYS.affinity_workers, name, f"{free} {await redis_ms(redis)}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.1)

    # Stopped by an event, not cancelled: a cancel landing inside a redis-py call can be swallowed by it.
    task = asyncio.create_task(report_until_done())
    try:
        await wait_until(lambda: redis.hexists(KEYS.affinity_workers, name), 5)
        yield
    finally:
        done.set()
        await asyncio.wait_for(task, 10)


# --- the key -----------------------------------------------------------------------------------------------------


def test_key_of_a_text_prompt_is_its_first_256_characters() -> None:
    base = "s" * 256
    key = key_of(prompt=base + " first question")
    assert HEX16.fullmatch(key), key
    assert key_of(prompt=base + " a different, much longer question " * 20) == key
    assert key_of(prompt=base) == key
    assert key_of(prompt="t" + base[1:] + " first question") != key  # first character
    assert key_of(prompt=base[:255] + "t" + " first question") != key  # the 256th character
    assert key_of(prompt=base[:100]) != key_of(prompt=base[:101])  # a short prompt is all start
    # characters, not bytes: these share their first 300 UTF-8 bytes but differ at character 150
    assert key_of(prompt="é" * 150 + "a" + "é" * 200) != key_of(prompt="é" * 150 + "b" + "é" * 200)
    # nothing but the prompt's start: not the id, the sampling parameters or the deadline
    assert (
        affinity_key(
            request(
                id="another-id",
                prompt=base + "?",
                params={"max_new_tokens": 7, "temperature": 0.5, "seed": 3},
                deadline=ms_now() + 60_000,
            )
        )
        == key
    )


def test_key_of_token_ids_is_their_first_64() -> None:
    ids = list(range(10, 74))  # 64 ids
    key = key_of(input_ids=[*ids, 1, 2, 3])
    assert HEX16.fullmatch(key), key
    assert key_of(input_ids=[*ids, 9, 9, 9, 9, 9, 9]) == key
    assert key_of(input_ids=ids) == key
    assert key_of(input_ids=[*ids[:63], 99, 1, 2, 3]) != key  # the 64th id
    assert key_of(input_ids=[99, *ids[1:], 1, 2, 3]) != key
    assert key_of(input_ids=ids[:10]) != key_of(input_ids=ids[:11])


def test_key_of_chat_messages_is_their_start_role_then_content() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 12}  # > 256 characters alone
    key = key_of(messages=[system, {"role": "user", "content": "What is 2 + 2?"}])
    assert HEX16.fullmatch(key), key
    # the same leading message: the same key, whatever follows (another question, a longer conversation)
    assert key_of(messages=[system, {"role": "user", "content": "Name a prime."}]) == key
    conversation = [
        system,
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    assert key_of(messages=conversation) == key
    # a different start: the content, or the role of the same content
    assert key_of(messages=[{"role": "system", "content": "Be brief. " + system["content"]}]) != key
    assert key_of(messages=[{"role": "developer", "content": system["content"]}]) != key
    # a short system prompt leaves the question inside the window
    short = {"role": "system", "content": "Be brief."}
    assert key_of(messages=[short, {"role": "user", "content": "a"}]) != key_of(
        messages=[short, {"role": "user", "content": "b"}]
    )
    # an assistant turn made only of tool calls (no content) has a key too
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tool_turns = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    assert HEX16.fullmatch(key_of(messages=tool_turns))


async def test_every_entry_carries_its_key_the_same_from_the_sync_and_async_clients(
    redis_url: str, client: AsyncClient, redis: Redis
) -> None:
    """No worker runs: the entries stay in the lane streams, where field `k` is the key of what `m` holds."""
    system = {"role": "system", "content": "Answer in French. " * 20}
    inputs: list[dict[str, Any]] = [
        {"prompt": prompt(1, 1)},
        {"prompt": prompt(1, 2)},
        {"messages": [system, {"role": "user", "content": "Hello?"}]},
        {"input_ids": list(range(3, 80))},
    ]

    def submit_sync() -> list[str]:
        with Client(redis_url) as sync_client:
            return [sync_client.submit(**fields, max_new_tokens=2).id for fields in inputs]

    async_ids = [(await client.submit(**fields, max_new_tokens=2)).id for fields in inputs]
    sync_ids = await asyncio.to_thread(submit_sync)
    choices = await client.submit(prompt=prompt(2, 1), n=3, max_new_tokens=2)
    batch = await client.submit(prompt=prompt(1, 3), max_new_tokens=2, priority="batch")

    entries: dict[str, tuple[bytes, GenerateRequest]] = {}
    for lane in ("default", "batch"):
        for _, fields in await redis.xrange(KEYS.lane(lane)):
            body = decode_request(fields[ENTRY_FIELD])
            assert AFFINITY_FIELD in fields, f"entry of {body.id} has no field k: {sorted(fields)}"
            entries[body.id] = (fields[AFFINITY_FIELD], body)
    for request_id, (key, body) in entries.items():
        assert key == affinity_key(body), request_id
        assert HEX16.fullmatch(key), key
    for async_id, sync_id in zip(async_ids, sync_ids, strict=True):
        assert entries[async_id][0] == entries[sync_id][0]
    assert entries[async_ids[0]][0] == entries[async_ids[1]][0]  # one document, two questions
    assert len({entries[i][0] for i in async_ids[1:]}) == 3  # text, chat and ids starts differ
    assert len({entries[f"{choices.id}-{i}"][0] for i in range(3)}) == 1  # the n choices of one call
    assert entries[batch.id][0] == entries[async_ids[0]][0]  # the batch lane's entries carry it too


# --- routing -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arrival", ["sequential", "burst"])
async def test_requests_that_start_alike_run_on_one_worker(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, arrival: str
) -> None:
    names = ["aff-a", "aff-b", "aff-c"]
    workers = [await start_worker(worker_id=n, affinity_wait_ms=LONG_WAIT_MS, max_running=32) for n in names]
    await wait_reported(redis, names)
    keys, questions = 8, 3
    prompts = [prompt(k, q) for q in range(questions) for k in range(keys)]  # interleaved: k0 k1 ... k7 k0 ...
    if arrival == "sequential":
        ids = await run_sequentially(client, prompts)
    else:
        ids = await run_burst(client, prompts)
    ids_by_key = {k: [ids[q * keys + k] for q in range(questions)] for k in range(keys)}
    owners = assert_each_key_on_one_worker(workers, ids_by_key)
    assert len(set(owners.values())) >= 2, f"every key on one worker: {owners}"

    counts = fleet_counts(workers)
    assert counts["assigned"] > 0, counts  # readers gave entries to their owners
    assert counts["assigned"] == counts["taken"] + counts["stolen"], counts  # each moved entry was taken once
    assert counts["stolen"] == 0, counts  # owners with free slots took theirs within the (long) wait
    # docs/protocol.md: one wake entry per move (`a` = the worker given it), and nothing left assigned
    wake = await redis.xrange(KEYS.affinity_wake)
    assert len(wake) == counts["assigned"]
    assert {fields[b"a"].decode() for _, fields in wake} <= set(names)
    assert await redis.zcard(KEYS.affinity_assigned) == 0
    assert await pending_total(redis) == 0
    for key in (KEYS.affinity_workers, KEYS.affinity_assigned, KEYS.affinity_wake):  # "each with a TTL"
        if await redis.exists(key):
            assert await redis.ttl(key) > 0, key


async def test_a_full_owner_does_not_hold_work_back(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Two workers of one slot each, with no queue for a full worker (`LLMQ_AFFINITY_QUEUE=0`); the owner of a
    prompt's start is busy: the same start runs on the other. The wait is the longest allowed, so an entry given to
    the full owner would not finish within the test."""
    names = ["full-a", "full-b"]
    workers = [
        await start_worker(worker_id=n, affinity_wait_ms=60_000, affinity_queue=0, max_running=1, step_s=0.05)
        for n in names
    ]
    await wait_reported(redis, names)
    texts = [prompt(7, q, width=260) for q in range(5)]
    [first] = await run_sequentially(client, texts[:1], max_new_tokens=1)
    [owner] = ran_on(workers, first)
    other = 1 - owner

    async def owner_reports(free: int) -> bool:
        return (await reports(redis))[names[owner]][0] == free

    await wait_until(lambda: owner_reports(1), 10)  # free again after the first, as far as the others know
    long_job = await client.submit(prompt=texts[1], max_new_tokens=200)  # about 10 s of steps
    await wait_until(lambda: long_job.id in workers[owner].worker.engine.submitted, 10)
    await wait_until(lambda: owner_reports(0), 10)
    assigned_before = fleet_counts(workers)["assigned"]
    shorts = await run_sequentially(client, texts[2:], max_new_tokens=1)
    assert [ran_on(workers, i) for i in shorts] == [[other]] * 3
    assert workers[owner].worker.engine.stats().running == 1  # the long one still runs there
    assert fleet_counts(workers)["assigned"] == assigned_before  # the reader ran them itself
    await long_job.cancel()
    with pytest.raises(Cancelled):
        await long_job.result(timeout=RESULT_TIMEOUT_S)


async def test_interactive_requests_are_never_routed(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    names = ["lane-a", "lane-b"]
    workers = [await start_worker(worker_id=n, affinity_wait_ms=LONG_WAIT_MS) for n in names]
    await wait_reported(redis, names)
    prompts = [prompt(k, q) for q in range(2) for k in range(10)]
    await run_sequentially(client, prompts, priority="interactive")
    assert fleet_counts(workers) == dict.fromkeys(OUTCOMES, 0.0)
    assert not await redis.exists(KEYS.affinity_wake)
    # the same prompts in the default lane are routed (the counters do count)
    await run_sequentially(client, prompts)
    assert fleet_counts(workers)["assigned"] > 0


async def test_wait_zero_on_every_worker_is_plain_pulls(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    workers = [await start_worker(worker_id=n, affinity_wait_ms=0) for n in ("off-a", "off-b")]
    await wait_until(lambda: redis.hlen(KEYS.workers), 10)  # heartbeats: both serve
    prompts = [prompt(k, q) for q in range(4) for k in range(4)]
    ids = [*await run_burst(client, prompts), *await run_sequentially(client, prompts)]
    assert all(len(ran_on(workers, i)) == 1 for i in ids)
    assert fleet_counts(workers) == dict.fromkeys(OUTCOMES, 0.0)
    for key in (KEYS.affinity_workers, KEYS.affinity_assigned, KEYS.affinity_wake):
        assert not await redis.exists(key), f"{key} written with routing off"


async def test_a_worker_with_routing_off_owns_no_key_beside_one_with_it_on(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """A fleet in the middle of turning routing off (or on): every request is served, once."""
    workers = [
        await start_worker(worker_id="mixed-on", affinity_wait_ms=50),
        await start_worker(worker_id="mixed-off", affinity_wait_ms=0),
    ]
    await wait_reported(redis, ["mixed-on"])
    prompts = [prompt(k, q) for q in range(2) for k in range(8)]
    ids = [*await run_sequentially(client, prompts), *await run_burst(client, prompts)]
    assert all(len(ran_on(workers, i)) == 1 for i in ids)
    assert set(await reports(redis)) == {"mixed-on"}
    assert await pending_total(redis) == 0


# --- failures, joins and departures ------------------------------------------------------------------------------


async def test_an_entry_given_to_a_dead_worker_is_taken_after_the_wait_without_a_delivery(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """A fake report (a worker that died right after it reported) owns some keys; what is given to it stays in
    the lane's pending list under its name, is listed in `:affinity:assigned`, and is taken by a live worker
    after the wait. `max_deliveries=1`: a move counted as a delivery would dead-letter the request."""
    worker = await start_worker(worker_id="live-a", affinity_wait_ms=4000, max_deliveries=1)
    await wait_reported(redis, ["live-a"])
    async with fake_report(redis, "ghost"):
        texts = [prompt(k, 0) for k in range(12)]
        jobs = [await client.submit(prompt=text, max_new_tokens=2) for text in texts]

        async def given_to_ghost() -> list[bytes]:
            return [m for m in await redis.zrange(KEYS.affinity_assigned, 0, -1) if m.split()[-1:] == [b"ghost"]]

        await wait_until(given_to_ghost, 10)
        [member, *_] = await given_to_ghost()
        parts = member.decode().split()
        assert len(parts) == 4, member  # "lane entry-id deliveries worker"
        held = await redis.xpending_range(KEYS.requests, "workers", min="-", max="+", count=100, consumername="ghost")
        assert parts[1] in {entry["message_id"].decode() for entry in held}, (member, held)
        assert all(entry["times_delivered"] == 1 for entry in held), held

        for job, text in zip(jobs, texts, strict=True):
            result = await job.result(timeout=RESULT_TIMEOUT_S)
            assert result.token_ids == expected_tokens(list(text.encode()), 2)
    counts = affinity_counts(worker)
    assert counts["stolen"] >= 1, counts
    assert counts["assigned"] == counts["taken"] + counts["stolen"] >= 1, counts
    assert await redis.zcard(KEYS.affinity_assigned) == 0
    assert await pending_total(redis) == 0
    assert await redis.xlen(KEYS.dead) == 0


async def test_a_stale_or_full_report_is_given_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """A report older than ten read blocks (at least 3 s) is no live worker, and one with no free slot owns keys
    it cannot take: with no queue for a full worker (`LLMQ_AFFINITY_QUEUE=0`), neither is given an entry, and the
    reader runs the full one's entries itself (`overflow`). The wait is the longest allowed, so an entry given to
    either would not finish within the test."""
    worker = await start_worker(worker_id="stale-live", affinity_wait_ms=60_000, affinity_queue=0)
    await wait_reported(redis, ["stale-live"])
    await redis.hset(KEYS.affinity_workers, "stale-ghost", f"8 {await redis_ms(redis) - 10_000}")
    async with fake_report(redis, "full-ghost", free=0):
        await run_sequentially(client, [prompt(k, q) for q in range(2) for k in range(12)])
        await run_burst(client, [prompt(k, 2) for k in range(12)])
    counts = affinity_counts(worker)
    assert counts.pop("overflow") >= 1, counts
    assert counts == dict.fromkeys(("assigned", "taken", "stolen"), 0.0)
    assert await redis.zcard(KEYS.affinity_assigned) == 0


async def test_a_fresh_report_of_a_dead_worker_loses_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """The default wait (50 ms), two live workers and a ghost that keeps reporting free slots."""
    workers = [await start_worker(worker_id=n) for n in ("dead-a", "dead-b")]
    await wait_reported(redis, ["dead-a", "dead-b"])
    async with fake_report(redis, "ghost", free=32):
        prompts = [prompt(k, q) for q in range(2) for k in range(12)]
        ids = [*await run_sequentially(client, prompts), *await run_burst(client, prompts)]
    assert all(len(ran_on(workers, i)) == 1 for i in ids)
    counts = fleet_counts(workers)
    assert counts["stolen"] >= 1, counts
    assert counts["assigned"] == counts["taken"] + counts["stolen"], counts
    assert await pending_total(redis) == 0


async def test_a_worker_killed_mid_run_loses_nothing(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """A worker's task is cancelled while it runs requests (its report is left to age out); the survivor
    finishes everything, each answer whole and exactly once."""
    quick = {"lease_timeout_s": 1.0, "lease_renew_s": 0.2, "claim_interval_s": 0.2, "step_s": 0.01}
    victim = await start_worker(worker_id="kill-a", **quick)
    survivor = await start_worker(worker_id="kill-b", **quick)
    await wait_reported(redis, ["kill-a", "kill-b"])
    tokens = 40
    first = [prompt(k, 0) for k in range(10)]
    jobs = [await client.submit(prompt=text, max_new_tokens=tokens) for text in first]
    await wait_until(lambda: victim.worker.engine.stats().running > 0, 10)
    while not victim.task.done():  # until it is gone (a cancel landing inside a redis-py call may be swallowed)
        victim.task.cancel()
        await asyncio.wait([victim.task], timeout=1)
    # submitted while the dead worker's report is still fresh: some are given to it
    second = [prompt(k, 1) for k in range(10)]
    jobs += [await client.submit(prompt=text, max_new_tokens=tokens) for text in second]
    for job, text in zip(jobs, first + second, strict=True):
        result = await job.result(timeout=RESULT_TIMEOUT_S)
        assert result.token_ids == expected_tokens(list(text.encode()), tokens), job.id
    assert survivor.worker.engine.submitted  # it took over
    assert await pending_total(redis) == 0


async def test_a_joining_worker_gets_keys_and_a_leaving_one_gives_them_back(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """The wait is the longest allowed: an entry given to a worker that had left would not finish in time."""
    settings = {"affinity_wait_ms": 60_000}
    first = await start_worker(worker_id="join-a", **settings)
    await wait_reported(redis, ["join-a"])
    keys = list(range(12))
    ids = await run_sequentially(client, [prompt(k, 0) for k in keys])
    assert all(ran_on([first], i) == [0] for i in ids)
    assert affinity_counts(first)["assigned"] == 0  # alone, it owns every key

    second = await start_worker(worker_id="join-b", **settings)
    await wait_reported(redis, ["join-a", "join-b"])
    workers = [first, second]
    ids = await run_sequentially(client, [prompt(k, q) for q in (1, 2) for k in keys])
    owners = assert_each_key_on_one_worker(workers, {k: [ids[k], ids[len(keys) + k]] for k in keys})
    assert 1 in owners.values(), f"the joining worker got no key: {owners}"
    assert 0 in owners.values(), f"the first worker kept no key: {owners}"

    second.stop.set()
    second.hurry.set()
    await asyncio.wait_for(second.task, 30)
    assert "join-b" not in await reports(redis)  # "a stopping worker leaves at once"
    before = affinity_counts(first)
    ids = await run_sequentially(client, [prompt(k, 3) for k in keys])
    assert all(ran_on(workers, i) == [0] for i in ids)
    assert affinity_counts(first) == before  # nothing given to the departed worker, nothing stolen back


async def test_each_partition_keeps_its_own_reports(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Routing keeps its keys per partition; the default wait, since a worker waiting for work watches one
    partition at a time (an entry given to it in another may wait out the wait)."""
    names = ["part-a", "part-b"]
    workers = [await start_worker(worker_id=n, queue_partitions=2) for n in names]
    for keys in KEYS.partitioned(2):
        await wait_reported(redis, names, keys)
    prompts = [prompt(k, q) for q in range(2) for k in range(6)]
    ids = await run_sequentially(client, prompts)
    assert all(len(ran_on(workers, i)) == 1 for i in ids)
    for keys in KEYS.partitioned(2):
        assert await pending_total(redis, keys) == 0


# --- hostile input ------------------------------------------------------------------------------------------------


HOSTILE_KEYS: dict[str, bytes | None] = {
    "absent": None,  # an older client
    "empty": b"",
    "not hex": b"zzzzzzzzzzzzzzzz",
    "too short": b"ab",
    "upper hex": b"DEADBEEFDEADBEEF",
    "negative": b"-1",
    "binary": bytes(range(256)),
    "lua pattern": b"%s%d%[^]*.+?$()",
    "newlines": b"a\r\n*3\r\n$3\r\nDEL\r\n",
    "huge": b"f" * 1_000_000,
    "a worker's name": b"hostile-a",
}


async def test_a_garbage_key_field_is_still_served(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """Entries written with XADD as docs/protocol.md describes them (`m` the request, `k` anything)."""
    workers = [await start_worker(worker_id=n) for n in ("hostile-a", "hostile-b")]
    await wait_reported(redis, ["hostile-a", "hostile-b"])
    expected: dict[str, list[int]] = {}
    for index, (case, key) in enumerate(HOSTILE_KEYS.items()):
        for lane in ("default", "interactive"):
            request_id = f"hostile-{index}-{lane}"
            body = request(id=request_id, prompt=f"{case} {prompt(index, 0)}", params={"max_new_tokens": 3})
            fields = {ENTRY_FIELD: encode(body)}
            if key is not None:
                fields[AFFINITY_FIELD] = key
            await redis.xadd(KEYS.lane(lane), fields)
            expected[request_id] = expected_tokens(list(body.prompt.encode()), 3)
    for request_id, tokens in expected.items():
        result = await AsyncJob.attach(client, request_id).result(timeout=RESULT_TIMEOUT_S)
        assert result.token_ids == tokens, request_id
    assert not any(w.task.done() for w in workers)
    assert all(len(ran_on(workers, i)) == 1 for i in expected)
    await run_sequentially(client, [prompt(k, 0) for k in range(4)])  # and they go on serving
    assert await pending_total(redis) == 0
    assert await redis.xlen(KEYS.dead) == 0


async def test_garbage_in_the_reports_does_not_stop_the_workers(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """`:affinity:workers` is shared state any process on the Redis can write: a report that does not parse,
    a negative or huge count, a timestamp far in the past or future."""
    workers = [await start_worker(worker_id=n) for n in ("junk-a", "junk-b")]
    await wait_reported(redis, ["junk-a", "junk-b"])
    now = await redis_ms(redis)
    await redis.hset(
        KEYS.affinity_workers,
        mapping={
            "junk-words": "not a report",
            "junk-empty": "",
            "junk-negative": f"-5 {now}",
            "junk-huge": f"99999999999999999999999 {now}",
            "junk-old": "8 1",
            "junk-future": f"8 {now + 10**9}",
            b"\xff\xfe\x00": f"8 {now}",
        },
    )
    prompts = [prompt(k, q) for q in range(2) for k in range(8)]
    ids = [*await run_sequentially(client, prompts), *await run_burst(client, prompts)]
    assert all(len(ran_on(workers, i)) == 1 for i in ids)
    assert not any(w.task.done() for w in workers)
    assert await pending_total(redis) == 0


# --- metrics -----------------------------------------------------------------------------------------------------


async def test_the_outcome_series_exist_from_the_start(start_worker: Callable[..., Any], redis: Redis) -> None:
    workers = [await start_worker(worker_id="series-a"), await start_worker(worker_id="series-b", affinity_wait_ms=0)]
    await wait_reported(redis, ["series-a"])
    for running in workers:
        assert affinity_counts(running) == dict.fromkeys(OUTCOMES, 0.0)


# --- real engines ------------------------------------------------------------------------------------------------

DOCUMENTS = [[10 + (7 * d + 13 * i) % 400 for i in range(96)] for d in range(2)]  # 6 pages of 16 tokens each


def real_prompts() -> list[list[int]]:
    """Two documents (96 shared token ids each, beyond the key's 64) with three questions each, interleaved."""
    return [[*DOCUMENTS[d], *(20 + 8 * q + j for j in range(8))] for q in range(3) for d in range(2)]


async def stop_all(workers: Sequence[Any]) -> None:
    for running in workers:
        running.stop.set()
        running.hurry.set()
    await asyncio.wait([running.task for running in workers], timeout=30)
    assert all(running.task.done() for running in workers)


async def serve_real(
    client: AsyncClient, workers: Sequence[Any], burst: bool
) -> tuple[list[list[int]], int, list[int]]:
    """Greedy answers to `real_prompts()`, the prompt tokens the fleet computed, and each worker's request count."""
    options: dict[str, Any] = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    if burst:
        jobs = [await client.submit(input_ids=ids, **options) for ids in real_prompts()]
        outputs = [(await job.result(timeout=60)).token_ids for job in jobs]
    else:
        outputs = []
        for ids in real_prompts():
            job = await client.submit(input_ids=ids, **options)
            outputs.append((await job.result(timeout=60)).token_ids)
    stats = [running.worker.engine.stats() for running in workers]
    return outputs, sum(s.prefill_tokens for s in stats), [sum(s.requests_finished.values()) for s in stats]


@pytest.mark.parametrize("burst", [False, True], ids=["sequential", "burst"])
async def test_real_engines_compute_a_shared_start_once_and_answer_the_same(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis, burst: bool
) -> None:
    """One worker alone is the reference: its answers, and the prompt tokens it computes (each document once).
    Two workers with affinity: the same answers and exactly the reference's prefill, though both serve. Two with
    routing off: the same answers, and at least as much prefill (how much more depends on who reads first)."""
    [alone] = fleet = [await start_worker(real_model=True, worker_id="real-a", affinity_wait_ms=LONG_WAIT_MS)]
    reference, reference_prefill, _ = await serve_real(client, fleet, burst)
    await stop_all(fleet)

    fleet = [
        await start_worker(real_model=True, worker_id=name, affinity_wait_ms=LONG_WAIT_MS)
        for name in ("ra", "rb")  # names under which the two documents have different owners
    ]
    await wait_reported(redis, ["ra", "rb"])
    outputs, prefill, served = await serve_real(client, fleet, burst)
    await stop_all(fleet)
    assert outputs == reference
    assert served == [3, 3], served  # each document's questions on one worker, the two documents on two
    assert prefill == reference_prefill

    fleet = [await start_worker(real_model=True, worker_id=name, affinity_wait_ms=0) for name in ("off-a", "off-b")]
    await wait_until(lambda: redis.hlen(KEYS.workers), 10)
    outputs, plain_prefill, _ = await serve_real(client, fleet, burst)
    await stop_all(fleet)
    assert outputs == reference
    assert plain_prefill >= prefill
    assert alone.task.done()
