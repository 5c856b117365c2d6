"""Cache affinity in the read script (`read.lua`), against a real redis-server: an entry goes to the live worker its
key hashes to when that worker has a free slot, the owner takes it first, anyone takes it after the wait, and
nothing is routed that must not wait (interactive requests, a full owner, a worker gone quiet)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from client.protocol import AFFINITY_FIELD, Lane
from client.scripts import AFFINITY_MAX_KEYS, CONSUMER_GROUP, ReadReply, Routing, Scripts
from client.store import Keys
from worker.intake import Intake

KEYS = Keys("affinity")
ROUTING = Routing(wait_ms=200, live_ms=3000, queue=0)  # a full holder gets nothing (see QUEUED)
ENTRY = {b"m": b"x"}


@pytest.fixture
async def conn(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    for stream in KEYS.lanes.values():
        await client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    yield client
    await client.aclose()


def owned_by(owner: str, others: list[str]) -> bytes:
    """A key that rendezvous hashing gives to `owner` among `owner` and `others`."""

    def score(worker: str, key: str) -> str:
        return hashlib.sha1(f"{worker}\n{key}".encode()).hexdigest()

    for i in range(1000):
        key = f"k{i:04d}"
        if all(score(owner, key) > score(other, key) for other in others):
            return key.encode()
    raise AssertionError("no key found")


async def read(lib: Scripts, worker: str, free: int, lane: Lane = "default", routing: Routing = ROUTING) -> ReadReply:
    return await lib.read.run(KEYS, worker, free, [(lane, free)], [lane], routing)


async def add(conn: aioredis.Redis, key: bytes | None, lane: Lane = "default") -> bytes:
    fields = dict(ENTRY) if key is None else {**ENTRY, AFFINITY_FIELD: key}
    entry_id: bytes = await conn.xadd(KEYS.lane(lane), fields)  # type: ignore[arg-type]
    return entry_id


async def deliveries(conn: aioredis.Redis, entry_id: bytes, lane: Lane = "default") -> tuple[str, int]:
    [info] = await conn.xpending_range(KEYS.lane(lane), CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
    return info["consumer"].decode(), int(info["times_delivered"])


async def test_an_entry_goes_to_the_worker_its_key_hashes_to_and_counts_one_delivery(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "a", 4)  # both report a free slot: both live
    await read(lib, "b", 4)
    entry_id = await add(conn, owned_by("b", ["a"]))
    by_a = await read(lib, "a", 4)
    assert by_a.entries == [] and by_a.assigned == 1
    assert await deliveries(conn, entry_id) == ("b", 1)  # in b's pending list, not yet counted twice
    assert (await conn.hget(KEYS.affinity_workers, "b") or b"").startswith(b"3 ")  # one of b's 4 slots is spoken for
    by_b = await read(lib, "b", 4)
    assert [e.entry_id for e in by_b.entries] == [entry_id] and by_b.taken == 1
    assert await deliveries(conn, entry_id) == ("b", 1)
    assert await conn.zcard(KEYS.affinity_assigned) == 0


async def test_the_owner_of_a_key_takes_its_entries_itself_and_entries_without_a_key_go_to_whoever_reads(
    conn: aioredis.Redis,
) -> None:
    lib = Scripts.register(conn)
    await read(lib, "a", 4)
    await read(lib, "b", 4)
    mine, plain = await add(conn, owned_by("a", ["b"])), await add(conn, None)
    got = await read(lib, "a", 4)
    assert [e.entry_id for e in got.entries] == [mine, plain] and got.assigned == 0


async def test_a_full_owner_gets_nothing_so_no_slot_stays_empty_while_requests_wait(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "b", 0)  # b reports no free slot
    await read(lib, "a", 4)
    entry_id = await add(conn, owned_by("b", ["a"]))
    got = await read(lib, "a", 4)
    assert [e.entry_id for e in got.entries] == [entry_id] and got.assigned == 0


async def test_an_owner_gets_no_more_than_the_slots_it_reported(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "b", 2)
    await read(lib, "a", 8)
    key = owned_by("b", ["a"])
    ids = [await add(conn, key) for _ in range(5)]
    got = await read(lib, "a", 8)
    assert got.assigned == 2 and [e.entry_id for e in got.entries] == ids[2:]


async def test_an_assignment_not_taken_within_the_wait_is_taken_by_anyone(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "b", 4)  # b reports, then never reads again: slow, or killed
    await read(lib, "a", 4)
    entry_id = await add(conn, owned_by("b", ["a"]))
    first = await read(lib, "a", 4)
    assert first.assigned == 1
    early = await read(lib, "a", 4)
    assert early.entries == [] and early.retry_ms is not None and 0 < early.retry_ms <= ROUTING.wait_ms
    await asyncio.sleep(early.retry_ms / 1000 + 0.02)
    late = await read(lib, "a", 4)
    assert [e.entry_id for e in late.entries] == [entry_id] and late.stolen == 1
    assert await deliveries(conn, entry_id) == ("a", 1)


async def test_an_assignment_a_lease_claim_took_meanwhile_is_dropped(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "b", 4)
    await read(lib, "a", 4)
    entry_id = await add(conn, owned_by("b", ["a"]))
    assert (await read(lib, "a", 4)).assigned == 1
    await conn.xautoclaim(KEYS.requests, CONSUMER_GROUP, "c", 0, start_id="0-0")  # a lease claim: delivery 2
    by_b = await read(lib, "b", 4)
    assert by_b.entries == [] and await conn.zcard(KEYS.affinity_assigned) == 0
    assert await deliveries(conn, entry_id) == ("c", 2)


async def test_interactive_entries_are_never_routed(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "b", 4, "interactive")
    await read(lib, "a", 4, "interactive")
    entry_id = await add(conn, owned_by("b", ["a"]), "interactive")
    got = await read(lib, "a", 4, "interactive")
    assert [e.entry_id for e in got.entries] == [entry_id] and got.assigned == 0


async def test_a_worker_that_has_not_reported_lately_owns_nothing(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "a", 4)
    await conn.hset(KEYS.affinity_workers, "b", "4 1000")  # reported in 1970: gone
    key = owned_by("b", ["a"])
    entry_id = await add(conn, key)
    got = await read(lib, "a", 4)
    assert [e.entry_id for e in got.entries] == [entry_id] and got.assigned == 0
    assert not await conn.hexists(KEYS.affinity_workers, "b")  # long gone: pruned


async def test_routing_off_takes_what_it_reads(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "b", 4)
    entry_id = await add(conn, owned_by("b", ["a"]))
    got = await read(lib, "a", 4, routing=Routing(wait_ms=0))
    assert [e.entry_id for e in got.entries] == [entry_id] and got.assigned == 0


async def test_a_full_worker_reports_it_and_a_stopping_one_leaves(conn: aioredis.Redis, redis_url: str) -> None:
    lib = Scripts.register(conn)
    intake = Intake(conn, KEYS, "b", limits=None, dead_maxlen=10, scripts=lib, routing=ROUTING)  # type: ignore[arg-type]
    await read(lib, "b", 4)
    await intake.report_full()
    assert (await conn.hget(KEYS.affinity_workers, "b") or b"").startswith(b"0 ")
    await read(lib, "a", 4)
    entry_id = await add(conn, owned_by("b", ["a"]))
    assert [e.entry_id for e in (await read(lib, "a", 4)).entries] == [entry_id]
    await intake.leave()
    assert not await conn.hexists(KEYS.affinity_workers, "b")


async def test_a_full_workers_look_for_an_interactive_request_does_not_report_room(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "b", 0)
    await lib.read.run(KEYS, "b", 1, [("interactive", 1)], ["interactive"], ROUTING, report=False)
    assert (await conn.hget(KEYS.affinity_workers, "b") or b"").startswith(b"0 ")
    await read(lib, "a", 4)
    entry_id = await add(conn, owned_by("b", ["a"]))
    assert [e.entry_id for e in (await read(lib, "a", 4)).entries] == [entry_id]  # b is full: a runs it


async def test_a_worker_with_routing_off_takes_no_assignment_and_reports_nothing(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "b", 4)
    await read(lib, "a", 4)
    entry_id = await add(conn, owned_by("b", ["a"]))
    assert (await read(lib, "a", 4)).assigned == 1
    await asyncio.sleep(ROUTING.wait_ms / 1000 + 0.05)
    off = await read(lib, "c", 4, routing=Routing(wait_ms=0))
    assert off.entries == [] and off.stolen == 0 and not await conn.hexists(KEYS.affinity_workers, "c")
    assert [e.entry_id for e in (await read(lib, "a", 4)).entries] == [entry_id]  # a routing worker does


async def holder_after_read(lib: Scripts, conn: aioredis.Redis, reader: str, key: bytes) -> str:
    """Who a new entry of `key` goes to when `reader` reads it (the reader itself, or the worker given it)."""
    entry_id = await add(conn, key)
    got = await read(lib, reader, 8)
    if [e.entry_id for e in got.entries] == [entry_id]:
        await conn.xack(KEYS.requests, CONSUMER_GROUP, entry_id)
        return reader
    worker, _ = await deliveries(conn, entry_id)
    await conn.zrem(KEYS.affinity_assigned, *await conn.zrange(KEYS.affinity_assigned, 0, -1))
    await conn.xack(KEYS.requests, CONSUMER_GROUP, entry_id)
    await read(lib, worker, 8)  # the holder reports its room again
    return worker


async def test_keys_are_spread_evenly_and_keep_their_holder(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "a", 8)
    await read(lib, "b", 8)
    keys = [f"key{i}".encode() for i in range(4)]
    first = [await holder_after_read(lib, conn, "a", key) for key in keys]
    assert sorted(first) == ["a", "a", "b", "b"]  # four keys, two workers: two each, whatever the hashes say
    again = [await holder_after_read(lib, conn, reader, key) for reader in ("b", "a") for key in keys]
    assert again == first + first  # whoever reads them
    assert await conn.hgetall(KEYS.affinity_loads) == {b"a": b"2", b"b": b"2"}


async def test_a_joining_worker_takes_keys_until_the_fleet_is_even_and_a_dead_ones_move(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, "a", 8)
    keys = [f"key{i}".encode() for i in range(6)]
    assert [await holder_after_read(lib, conn, "a", key) for key in keys] == ["a"] * 6  # alone
    await read(lib, "b", 8)  # joins
    joined = [await holder_after_read(lib, conn, "a", key) for key in keys]
    assert joined == ["b", "b", "b", "a", "a", "a"]  # keys move as they are used, until 3 and 3
    await conn.hset(KEYS.affinity_workers, "b", "8 1000")  # b goes silent: its keys come back to a
    assert [await holder_after_read(lib, conn, "a", key) for key in keys] == ["a"] * 6


async def test_a_key_unused_for_the_hold_time_is_forgotten(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    short = Routing(wait_ms=200, live_ms=3000, hold_ms=100)
    await lib.read.run(KEYS, "a", 8, [], ["default"], short)
    await add(conn, b"once")
    await lib.read.run(KEYS, "a", 8, [("default", 8)], ["default"], short)
    assert await conn.hget(KEYS.affinity_holders, "once") == b"a"
    await asyncio.sleep(0.15)
    await lib.read.run(KEYS, "a", 8, [("default", 8)], ["default"], short)
    assert await conn.hget(KEYS.affinity_holders, "once") is None
    assert await conn.zcard(KEYS.affinity_used) == 0 and await conn.hget(KEYS.affinity_loads, "a") == b"0"


async def test_every_prompt_new_keeps_the_held_keys_bounded(conn: aioredis.Redis) -> None:
    """Hostile traffic: more distinct keys than `AFFINITY_MAX_KEYS`; the least recently used are forgotten, the
    loads stay equal to what is held, and a key used again keeps its holder."""
    lib = Scripts.register(conn)
    await read(lib, "a", 8)
    await read(lib, "b", 8)
    total = AFFINITY_MAX_KEYS + 500
    async with conn.pipeline(transaction=False) as pipe:
        for i in range(total):
            pipe.xadd(KEYS.lane("default"), {**ENTRY, AFFINITY_FIELD: f"hostile-{i}"})
        await pipe.execute()
    read_by = {"a": 0, "b": 0}
    while sum(read_by.values()) < total:
        for worker in read_by:  # each takes its own and what is assigned to it; no slot is ever short
            reply = await read(lib, worker, 1000)
            read_by[worker] += len(reply.entries)
    assert sum(read_by.values()) == total and min(read_by.values()) > 0
    held = await conn.hgetall(KEYS.affinity_holders)
    assert len(held) == await conn.zcard(KEYS.affinity_used) == AFFINITY_MAX_KEYS
    assert b"hostile-0" not in held and b"hostile-" + str(total - 1).encode() in held  # the oldest went first
    loads = {k.decode(): int(v) for k, v in (await conn.hgetall(KEYS.affinity_loads)).items()}
    assert loads == {w: sum(1 for h in held.values() if h == w.encode()) for w in ("a", "b")}
    last = b"hostile-" + str(total - 1).encode()
    again = await add(conn, last)
    holder = held[last].decode()
    reply = await read(lib, holder, 1)
    assert [e.entry_id for e in reply.entries] == [again]


QUEUED = Routing(wait_ms=200, live_ms=3000, queue=3)


async def served_then_full(lib: Scripts, conn: aioredis.Redis, holder: str, other: str) -> bytes:
    """A key `holder` has served one entry of (so holds, its prompt start cached), then `holder` full; `other` has
    free slots."""
    key = owned_by(holder, [other])
    await lib.read.run(KEYS, other, 8, [], ["default"], QUEUED)
    first = await add(conn, key)
    served = await lib.read.run(KEYS, holder, 1, [("default", 1)], ["default"], QUEUED)
    assert [e.entry_id for e in served.entries] == [first]
    await lib.read.run(KEYS, holder, 0, [], ["default"], QUEUED)
    assert await conn.hget(KEYS.affinity_holders, key) == holder.encode()
    return key


async def test_a_new_key_whose_holder_would_be_full_runs_where_it_is_read(conn: aioredis.Redis) -> None:
    """Nothing of it is cached anywhere, so it does not wait for a slot at a full worker (where the tenant's later
    requests could start first elsewhere): the reader runs it, and holds the key when that keeps the keys even."""
    lib = Scripts.register(conn)
    await lib.read.run(KEYS, "b", 0, [], ["default"], QUEUED)  # b is full
    await lib.read.run(KEYS, "a", 8, [], ["default"], QUEUED)
    key = owned_by("b", ["a"])
    entry = await add(conn, key)
    by_a = await lib.read.run(KEYS, "a", 8, [("default", 8)], ["default"], QUEUED)
    assert [e.entry_id for e in by_a.entries] == [entry] and by_a.assigned == 0
    assert await conn.hget(KEYS.affinity_holders, key) == b"a"
    loads = {k.decode(): int(v) for k, v in (await conn.hgetall(KEYS.affinity_loads)).items()}
    assert loads.get("a") == 1 and loads.get("b", 0) == 0
    again = await add(conn, key)  # its holder now: a takes it even with b free
    await lib.read.run(KEYS, "b", 8, [], ["default"], QUEUED)
    by_b = await lib.read.run(KEYS, "b", 8, [("default", 8)], ["default"], QUEUED)
    assert by_b.entries == [] and by_b.assigned == 1
    assert [e.entry_id for e in (await lib.read.run(KEYS, "a", 8, [("default", 8)], ["default"], QUEUED)).entries] == [
        again
    ]


async def test_a_full_holder_gets_up_to_its_queue_and_takes_it_first(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    key = await served_then_full(lib, conn, "b", "a")
    ids = [await add(conn, key) for _ in range(5)]
    by_a = await lib.read.run(KEYS, "a", 8, [("default", 8)], ["default"], QUEUED)
    assert by_a.assigned == 3 and [e.entry_id for e in by_a.entries] == ids[3:]  # the queue is full: a runs the rest
    assert by_a.overflow == 2
    later = await add(conn, key)
    by_b = await lib.read.run(KEYS, "b", 2, [("default", 2)], ["default"], QUEUED)  # two slots freed
    assert [e.entry_id for e in by_b.entries] == ids[:2] and by_b.taken == 2  # its queue first, in order
    by_b = await lib.read.run(KEYS, "b", 2, [("default", 2)], ["default"], QUEUED)
    assert [e.entry_id for e in by_b.entries] == [ids[2], later]


async def test_what_waits_for_a_full_holder_goes_elsewhere_only_when_nothing_new_is_left(conn: aioredis.Redis) -> None:
    """However long it waited: under a backlog every entry waits, and the holder's queue is bounded."""
    lib = Scripts.register(conn)
    waiting = await add(conn, await served_then_full(lib, conn, "b", "a"))
    assert (await lib.read.run(KEYS, "a", 8, [("default", 8)], ["default"], QUEUED)).assigned == 1
    await asyncio.sleep(10 * QUEUED.wait_ms / 1000 + 0.05)
    await lib.read.run(KEYS, "b", 0, [], ["default"], QUEUED)  # b is still full, and says so
    fresh = await add(conn, owned_by("a", ["b"]))
    first = await lib.read.run(KEYS, "a", 1, [("default", 1)], ["default"], QUEUED)
    assert [e.entry_id for e in first.entries] == [fresh]  # new work before what waits for b
    second = await lib.read.run(KEYS, "a", 1, [("default", 1)], ["default"], QUEUED)
    assert [e.entry_id for e in second.entries] == [waiting] and second.stolen == 1  # else a slot stays empty


async def test_what_waits_for_a_silent_worker_is_taken_before_new_work(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    waiting = await add(conn, await served_then_full(lib, conn, "b", "a"))
    assert (await lib.read.run(KEYS, "a", 8, [("default", 8)], ["default"], QUEUED)).assigned == 1
    await conn.hset(KEYS.affinity_workers, "b", "0 1000")  # b went silent (killed)
    await asyncio.sleep(QUEUED.wait_ms / 1000 + 0.05)
    fresh = await add(conn, b"anything")
    got = await lib.read.run(KEYS, "a", 1, [("default", 1)], ["default"], QUEUED)
    assert [e.entry_id for e in got.entries] == [waiting] and got.stolen == 1
    assert [e.entry_id for e in (await lib.read.run(KEYS, "a", 1, [("default", 1)], ["default"], QUEUED)).entries] == [
        fresh
    ]
