"""Fair share between tenants in the submit and read scripts, against a real redis-server: while a worker that
moves held requests reads the queue, each tenant's requests are held and move to the lane's stream in fair order
(least virtual time first: tokens moved over the tenant's weight), FIFO within a tenant."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from client import AsyncClient, QueueFull
from client.protocol import ENTRY_FIELD, TENANT_FIELD, Lane, RequestLimits, decode_request
from client.scripts import Routing, Scripts
from client.store import Keys
from worker.intake import Intake

QUEUE = "fair"
KEYS = Keys(QUEUE)
PLAIN = Routing()  # no cache affinity: the order is fair share's alone


def intake(conn: aioredis.Redis) -> Intake:
    return Intake(conn, KEYS, "w", RequestLimits(), dead_maxlen=100, routing=PLAIN)


@pytest.fixture
async def conn(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A connection to a Redis whose lanes have the workers' group, as a worker creates them."""
    async with aioredis.Redis.from_url(redis_url) as client:
        await intake(client).ensure_group()
        yield client


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(redis_url, queue=QUEUE, max_queue_len=0) as client:
        yield client


async def read(lib: Scripts, free: int, lane: Lane = "default", worker: str = "w") -> list[tuple[str, str]]:
    """(tenant, request id) of each entry one read takes."""
    reply = await lib.read.run(KEYS, worker, free, [(lane, free)], [lane], PLAIN)
    return [
        (entry.fields.get(TENANT_FIELD, b"").decode(), decode_request(entry.fields[ENTRY_FIELD]).id)
        for entry in reply.entries
    ]


async def drain(lib: Scripts, reads: int, free: int = 1) -> list[tuple[str, str]]:
    taken: list[tuple[str, str]] = []
    for _ in range(reads):
        taken += await read(lib, free)
    return taken


async def flood(client: AsyncClient, tenant: str, count: int, tokens: int = 10, lane: Lane = "default") -> None:
    """`count` requests of `tenant`, ids `<tenant>-<i>`, each costing 6 prompt tokens and `tokens` new ones."""
    for i in range(count):
        await client.submit(
            input_ids=[5] * 6, max_new_tokens=tokens, tenant=tenant, request_id=f"{tenant}-{i}", priority=lane
        )


async def test_without_a_worker_that_moves_them_requests_are_not_held(
    conn: aioredis.Redis, client: AsyncClient
) -> None:
    """A fleet of workers that predate fair share reads only the lane's stream: clients hold nothing for it."""
    await flood(client, "a", 3)
    assert await conn.xlen(KEYS.lane("default")) == 3 and await conn.exists(KEYS.held("default")) == 0
    entry = (await conn.xrange(KEYS.lane("default"), count=1))[0][1]
    assert entry[TENANT_FIELD] == b"a"


async def test_a_tenant_that_floods_first_does_not_make_another_wait_behind_it(
    conn: aioredis.Redis, client: AsyncClient
) -> None:
    lib = Scripts.register(conn)
    await read(lib, 1)  # a worker of this release reads: clients hold tenants' requests from now on
    await flood(client, "a", 60)
    await flood(client, "b", 5)
    assert await conn.xlen(KEYS.lane("default")) == 0 and await conn.xlen(KEYS.held("default")) == 65
    taken = await drain(lib, 12)
    assert [t for t, _ in taken].count("b") == 5  # b's five within a dozen reads, not after a's sixty
    assert [i for t, i in taken if t == "a"] == [f"a-{i}" for i in range(7)]  # FIFO within a tenant
    assert [i for t, i in taken if t == "b"] == [f"b-{i}" for i in range(5)]


async def test_weights_share_the_tokens(conn: aioredis.Redis, client: AsyncClient) -> None:
    lib = Scripts.register(conn)
    await read(lib, 1)
    await conn.hset(KEYS.tenant_weights, mapping={"heavy": 3})  # "light" has the default weight, 1
    await flood(client, "heavy", 80)
    await flood(client, "light", 80)
    shares = Counter(t for t, _ in await drain(lib, 10, free=4))
    assert shares == {"heavy": 30, "light": 10}


async def test_shares_count_tokens_not_requests(conn: aioredis.Redis, client: AsyncClient) -> None:
    """Each request costs its prompt and `max_new_tokens` (6 + 10 against 6 + 58: a quarter as many big ones)."""
    lib = Scripts.register(conn)
    await read(lib, 1)
    await flood(client, "small", 100, tokens=10)
    await flood(client, "big", 100, tokens=58)
    shares = Counter(t for t, _ in await drain(lib, 25, free=2))
    assert shares == {"small": 40, "big": 10}


async def test_a_tenant_that_was_idle_banks_no_credit(conn: aioredis.Redis, client: AsyncClient) -> None:
    """`b` joins after `a` ran alone for 40 requests: it starts at the lane's clock, so the two alternate rather
    than `b` taking 40 in a row."""
    lib = Scripts.register(conn)
    await read(lib, 1)
    await flood(client, "a", 80)
    assert {t for t, _ in await drain(lib, 40)} == {"a"}  # alone: all of the fleet
    await flood(client, "b", 40)
    shares = Counter(t for t, _ in await drain(lib, 20))
    assert abs(shares["a"] - shares["b"]) <= 2, shares


async def test_held_requests_count_against_the_lane_limit(redis_url: str, conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    await read(lib, 1)
    async with AsyncClient(redis_url, queue=QUEUE, max_queue_len=3) as limited:
        for i in range(3):
            await limited.submit(input_ids=[5], max_new_tokens=1, tenant="a", request_id=f"a-{i}")
        with pytest.raises(QueueFull):
            await limited.submit(input_ids=[5], max_new_tokens=1, tenant="b", request_id="b-0")
    assert await conn.xlen(KEYS.held("default")) == 3


async def test_lanes_keep_their_order_and_each_has_its_own_fair_queue(
    conn: aioredis.Redis, client: AsyncClient
) -> None:
    lib = Scripts.register(conn)
    await read(lib, 1)
    await flood(client, "a", 5)
    job = await client.submit(input_ids=[5], max_new_tokens=1, tenant="b", priority="interactive", request_id="urgent")
    reply = await lib.read.run(KEYS, "w", 2, [("interactive", 2), ("default", 2)], ["interactive", "default"], PLAIN)
    assert [decode_request(e.fields[ENTRY_FIELD]).id for e in reply.entries] == [job.id, "a-0"]


async def test_a_blocked_worker_wakes_on_a_held_request(redis_url: str, conn: aioredis.Redis) -> None:
    """An idle worker's blocking read watches the held streams too: a tenant's request does not wait out the
    block."""
    reader = intake(conn)
    assert await reader.read(1, [("default", 1)], block_ms=None) == []  # marks this worker as one that moves held
    async with AsyncClient(redis_url, queue=QUEUE) as client:
        waiting = asyncio.create_task(reader.read(1, [("default", 1)], block_ms=20_000))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await client.submit(input_ids=[5], max_new_tokens=1, tenant="a", request_id="late")
        async with asyncio.timeout(5):
            assert await waiting == []  # woken: the next read takes it
    [decision] = await reader.read(1, [("default", 1)], block_ms=None)
    assert decision.entry_id is not None


async def test_a_tenant_must_be_a_name(client: AsyncClient) -> None:
    from client import InvalidRequest

    with pytest.raises(InvalidRequest, match="tenant"):
        await client.submit(input_ids=[5], max_new_tokens=1, tenant="no spaces")
    with pytest.raises(ValueError, match="tenant"):
        AsyncClient(tenant="{brace}")


async def test_the_status_counts_held_requests_as_waiting(conn: aioredis.Redis, client: AsyncClient) -> None:
    lib = Scripts.register(conn)
    await read(lib, 1)
    await flood(client, "a", 4)
    await read(lib, 1)  # one moved and taken: pending 1, held 3
    status = await client.status()
    [default] = [lane for lane in status.lanes if lane.lane == "default"]
    assert (default.held, default.depth, default.pending, default.lag) == (3, 4, 1, 3)
    assert (status.depth, status.lag) == (4, 3) and default.backlog_tokens == 4 * 16


# --- kept slots (`LLMQ_IDLE_TENANT_SLOTS`): the last free slots go only to tenants with nothing running ---------


async def read_kept(lib: Scripts, free: int, keep: int, lane: Lane = "default", routing: Routing = PLAIN) -> list[str]:
    """The request ids one read takes, `free` slots free and `keep` of them kept."""
    reply = await lib.read.run(KEYS, "w", free, [(lane, free)], [lane], routing, keep=keep)
    return [decode_request(entry.fields[ENTRY_FIELD]).id for entry in reply.entries]


async def test_a_kept_slot_goes_only_to_a_tenant_with_nothing_running(
    conn: aioredis.Redis, client: AsyncClient
) -> None:
    lib = Scripts.register(conn)
    await read(lib, 1)  # a worker of this release reads: clients hold tenants' requests from now on
    await flood(client, "a", 5)
    assert await read_kept(lib, 2, keep=1) == ["a-0"]  # one open slot; a runs one now, so the kept one stays free
    assert await read_kept(lib, 1, keep=1) == []
    await flood(client, "b", 2)
    assert await read_kept(lib, 1, keep=1) == ["b-0"]  # b had nothing running
    assert await read_kept(lib, 1, keep=1) == []  # now both run something
    assert await read_kept(lib, 2, keep=1) == ["a-1"]  # the open slot, in fair order (a tie, broken by name)
    assert await read_kept(lib, 3, keep=0) == ["b-1", "a-2", "a-3"]  # nothing kept: every free slot, fair order


async def test_one_read_fills_an_open_slot_and_a_kept_one(conn: aioredis.Redis, client: AsyncClient) -> None:
    lib = Scripts.register(conn)
    await read(lib, 1)
    await flood(client, "a", 3)
    await flood(client, "b", 1)
    assert await read_kept(lib, 2, keep=1) == ["a-0", "b-0"]  # a's turn in fair order (a tie, by name), then b's


async def test_the_interactive_lane_takes_a_kept_slot(conn: aioredis.Redis, client: AsyncClient) -> None:
    lib = Scripts.register(conn)
    await read(lib, 1)  # a worker of this release reads: clients hold tenants' requests from now on
    await flood(client, "a", 3, lane="interactive")
    assert await read_kept(lib, 1, keep=0, lane="interactive") == ["a-0"]
    assert await read_kept(lib, 1, keep=1, lane="interactive") == ["a-1"]  # a runs one, yet it takes the last slot


async def test_entries_on_the_stream_take_only_open_slots(conn: aioredis.Redis, client: AsyncClient) -> None:
    """Entries a client added straight to the stream (no worker read lately, so nothing was held) carry no
    fair-share state: a kept slot is not theirs. Nor does a quiet tenant's request move for it while they wait
    unread: it would go behind them, and the next read would take one of them."""
    lib = Scripts.register(conn)
    await read(lib, 1)
    await conn.delete(KEYS.fair_readers)  # no reader lately: a client adds to the stream itself
    await flood(client, "a", 3)
    assert await conn.xlen(KEYS.lane("default")) == 3
    assert await read_kept(lib, 2, keep=1) == ["a-0"]  # the read marks the readers: clients hold from now on
    assert await read_kept(lib, 1, keep=1) == []
    await flood(client, "q", 1)
    assert await read_kept(lib, 1, keep=1) == []  # q waits held, not behind a-1 and a-2
    assert await conn.xlen(KEYS.held("default")) == 1
    assert await read_kept(lib, 3, keep=1) == ["a-1", "a-2", "q-0"]  # the stream read, q takes the kept slot


async def test_a_quiet_tenants_request_runs_where_it_moved_not_at_a_full_holder(
    conn: aioredis.Redis, client: AsyncClient
) -> None:
    """With slots kept, a request of a tenant with nothing running is never given to its key's holder by cache
    affinity: a holder whose open slots are full would leave it waiting for one, though a slot is free here."""
    lib = Scripts.register(conn)
    routing = Routing(wait_ms=50)
    await read_kept(lib, 1, keep=1, routing=routing)  # clients hold from now on
    await conn.hset(KEYS.affinity_workers, "other", f"0 {int(time.time() * 1000)}")  # live, no open slot
    await conn.hset(KEYS.affinity_loads, "w", 5)  # a new key goes to the worker holding fewer: "other"
    await flood(client, "q", 1)
    assert await read_kept(lib, 2, keep=1, routing=routing) == ["q-0"]  # moved in its turn, read here
    assert await conn.zcard(KEYS.affinity_assigned) == 0


async def test_cache_affinity_hears_only_the_open_slots(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    routing = Routing(wait_ms=50)
    await read_kept(lib, 5, keep=2, routing=routing)
    free, _ = (await conn.hget(KEYS.affinity_workers, "w") or b"").split()
    assert int(free) == 3
