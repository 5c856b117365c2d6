"""The Lua scripts as a typed library (`client.scripts`): each `.lua` file ships in the package and has one wrapper,
every constant the Lua compares or writes comes from Python, and each wrapper's packing and parsing against a real
redis-server."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import get_type_hints

import pytest
import redis
import redis.asyncio as aioredis

from client import scripts
from client.protocol import Lane
from client.scripts import (
    CONSUMER_GROUP,
    LUA_CONSTANTS,
    PUBLISH_ARGS_PER_EVENT,
    PUBLISH_HEADER_ARGS,
    PUBLISH_HEADER_KEYS,
    PUBLISH_KEYS_PER_EVENT,
    SCRIPTS,
    Fence,
    HandBackReason,
    PublishItem,
    PublishOutcome,
    Scripts,
    SubmitOutcome,
)
from client.store import Keys

KEYS = Keys("scripts")
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
LITERAL = re.compile(r"'([^']*)'")
# What the Lua may still spell itself: Redis's own words and syntax, never a field, code or name of ours.
REDIS_WORDS = {
    *("EXISTS", "XLEN", "SET", "EX", "XADD", "XPENDING", "XCLAIM", "JUSTID", "IDLE", "HINCRBY", "HMGET", "HSET"),
    *("EXPIRE", "MAXLEN", "XACK", "XDEL", "XREADGROUP", "GROUP", "COUNT", "STREAMS", "XREVRANGE"),
    *("HKEYS", "HDEL", "TIME", "ZADD", "ZRANGE", "ZREM", "WITHSCORES", "XRANGE", "PEXPIRE", "HGET"),
    *("ZRANGEBYSCORE", "-inf", "LIMIT", "ZSCORE", "ZRANGEBYLEX", "PX", "ZCARD", "[", "(", "\\0", "\\1"),
    *("GET", "ZREMRANGEBYSCORE", "XINFO", "GROUPS", "name", "last-delivered-id"),
    *("", "*", "~", ">", "+", "-", "0", "0-0", " ", "table", "\\n"),  # "table": a Lua type name
    # Lua string patterns, which parse `read.lua`'s own records (its affinity set's members, its workers' reports)
    *("^(%-?%d+) (%d+)", "^(%S+) (%S+) (%d+) (%S+)"),
    # ... and the fair share's: a held entry's id, and its record in the held order ("tenant\0padded id\0id")
    *("^(%d+)-(%d+)", "%z[^%z]*%z(.+)"),
    # ... and usage's: a final event's counts, "|"-separated (`pack_usage`)
    *("[^|]+", "|", "HINCRBY"),
    # ... and quotas': a tenant's limits (`TenantLimits.pack`) and its running requests ("tenant\0entry id")
    *("^(%d+) (%d+)", "^(%d+) (%d+) (%d+) (%d+)", "^[^%z]*", "HINCRBYFLOAT", "HEXISTS"),
    # ... and a cost refused before any write (a message, not a code)
    "ERR a cost must be a whole number of tokens in [0, 2^53]",
}


def lua_templates() -> dict[str, str]:
    folder = resources.files("client.scripts")
    return {
        entry.name.removesuffix(".lua"): entry.read_text() for entry in folder.iterdir() if entry.name.endswith(".lua")
    }


def test_every_lua_file_ships_in_the_package_and_has_one_wrapper() -> None:
    templates = lua_templates()
    assert sorted(templates) == sorted(script.name for script in SCRIPTS)
    for script in SCRIPTS:
        shipped = resources.files("client.scripts").joinpath(f"{script.name}.lua")
        assert shipped.is_file() and scripts.template(script.name) == shipped.read_text() == templates[script.name]
    assert get_type_hints(Scripts) == {
        "submit": scripts.Submit,
        "renew": scripts.Renew,
        "hand_back": scripts.HandBack,
        "publish": scripts.Publish,
        "read": scripts.Read,
    }


def test_every_constant_the_lua_uses_comes_from_python() -> None:
    used: set[str] = set()
    for name, template in lua_templates().items():
        placeholders = set(PLACEHOLDER.findall(template))
        assert placeholders <= set(LUA_CONSTANTS), f"{name}.lua names constants Python lacks"
        used |= placeholders
        code = "\n".join(line.split("--", 1)[0] for line in template.splitlines())  # comments may name anything
        assert set(LITERAL.findall(code)) <= REDIS_WORDS, f"{name}.lua spells a constant itself"
        assert not re.search(r"return\s+-?\d", code), f"{name}.lua returns a bare number, not a named code"
        rendered = scripts.source(name)
        assert "${" not in rendered and "$" not in rendered
    default_branch = {"HAND_BACK_DRAIN"}  # hand_back.lua's `else`: any reason but the two it names
    assert used | default_branch == set(LUA_CONSTANTS), "a constant no script uses"


def test_rendered_constants_are_pythons_values() -> None:
    hand_back, publish = scripts.source("hand_back"), scripts.source("publish")
    assert f"'{Fence.PREEMPTED}', 1)" in hand_back and f"reason == {int(HandBackReason.PREEMPTION)} then" in hand_back
    assert f"'HMGET', fence, '{Fence.ATTEMPT}', '{Fence.WRITTEN}')" in publish
    assert f"{PUBLISH_KEYS_PER_EVENT}, {PUBLISH_ARGS_PER_EVENT}, {PUBLISH_HEADER_ARGS}" in publish
    assert f"return all({int(SubmitOutcome.FULL)})" in scripts.source("submit")


@dataclass(frozen=True)
class Target:
    request_id: str
    lane: Lane = "default"
    ttl_s: int = 60
    attempt: int | None = None
    reply_to: str | None = None
    notify: str | None = None
    tenant: str | None = None
    cost: int = 0


def test_publish_packs_its_strides() -> None:
    usage = scripts.pack_usage(3600, "billing", "stop", 40, 5, 7, 10, 20)
    items = [
        PublishItem(Target("r1", attempt=2, reply_to="out", notify="c1"), b"e", 0, 1, ack=b"1-0", usage=usage),
        PublishItem(Target("r2", "batch", 30), b"", 0, 1),
    ]
    call = scripts.Publish.pack(KEYS, items, reply_maxlen=10)
    assert len(call.keys) == PUBLISH_HEADER_KEYS + PUBLISH_KEYS_PER_EVENT * 2
    assert len(call.args) == PUBLISH_HEADER_ARGS + PUBLISH_ARGS_PER_EVENT * 2
    assert call.keys[:2] == [KEYS.tenant_counts, KEYS.tenant_running]
    del call.keys[:2]
    assert call.keys[:5] == [KEYS.requests, KEYS.result("r1"), KEYS.fence("r1"), KEYS.reply("out"), KEYS.wake("c1")]
    assert call.keys[5].startswith(f"{KEYS.tag}:usage:")  # this hour's
    # r2 has no reply stream, no client to wake and no usage: its result stream stands in for each
    assert call.keys[6:] == [KEYS.lane("batch"), KEYS.result("r2"), KEYS.fence("r2"), *[KEYS.result("r2")] * 3]
    assert call.args[:4] == [CONSUMER_GROUP, 10, scripts.WAKE_MAXLEN, scripts.WAKE_TTL_S]
    assert call.args[4:12] == [2, 60, b"e", 0, 1, b"1-0", b"", b"3600|billing|stop|40|5|7|10|20"]
    assert call.args[12:14] == ["", 30] and call.args[-1] == b""


@pytest.fixture
async def conn(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    async with aioredis.Redis.from_url(redis_url) as server:
        for stream in KEYS.lanes.values():
            await server.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        yield server


def test_submit_wrapper_on_a_blocking_connection(redis_url: str) -> None:
    keys = Keys("scripts-sync")
    with redis.Redis.from_url(redis_url) as server:
        submit = Scripts.register(server).submit
        added, duplicate, full = SubmitOutcome.ADDED, SubmitOutcome.DUPLICATE, SubmitOutcome.FULL
        assert submit.run_sync(server, submit.pack(keys, ["s1"], "default", [b"x"], 2, 60, "c")) == [added]
        assert submit.run_sync(server, submit.pack(keys, ["s1"], "default", [b"x"], 2, 60, "c")) == [duplicate]
        # A call's requests go in together or not at all: one more fits, two do not (not even their markers).
        assert submit.run_sync(server, submit.pack(keys, ["s2", "s3"], "default", [b"y", b"z"], 2, 60, "c")) == [
            full,
            full,
        ]
        assert not server.exists(keys.submitted("s2"))
        both = submit.pack(keys, ["s1", "s2"], "default", [b"x", b"y"], 2, 60, "c")
        assert submit.run_sync(server, both) == [duplicate, added]  # only the new one needs room
        assert [fields for _, fields in server.xrange(keys.requests)] == [
            {b"m": b"x", b"n": b"c"},
            {b"m": b"y", b"n": b"c"},
        ]


async def test_read_renew_hand_back_and_publish_wrappers(conn: aioredis.Redis) -> None:
    lib = Scripts.register(conn)
    call = lib.submit.pack(KEYS, ["r1"], "batch", [b"x"], 0, 60, "c1")
    assert await lib.submit.run_async(conn, call) == [SubmitOutcome.ADDED]
    empty = await lib.read.run(KEYS, "w", 0, [("batch", 1)])
    assert empty.entries == [] and empty.last[KEYS.lane("batch")] != b"0-0" and empty.last[KEYS.requests] == b"0-0"
    read = await lib.read.run(KEYS, "w", 4, [("interactive", 1), ("batch", 2)])
    [entry] = read.entries
    assert (entry.lane, entry.fields) == ("batch", {b"m": b"x", b"n": b"c1"}) and read.last == {}
    assert await lib.renew.run(KEYS, "batch", "w", [entry.entry_id, b"9-9"]) == {b"9-9"}
    await conn.hset(KEYS.fence("r1"), Fence.ATTEMPT, 1)
    handed = await lib.hand_back.run(KEYS, "batch", "w", [(entry.entry_id, "r1")], HandBackReason.ENGINE_FAILURE)
    assert handed == 1  # and the reason reached the Lua as a number: it counted the engine failure
    assert await conn.hmget(KEYS.fence("r1"), Fence.HANDED_BACK, Fence.ENGINE_FAILURES) == [b"1", b"1"]
    await conn.xclaim(KEYS.lane("batch"), CONSUMER_GROUP, "w", 0, [entry.entry_id])
    await conn.set(KEYS.result("broken"), "not a stream")
    r1 = Target("r1", "batch", attempt=1)
    items = [
        PublishItem(Target("r1", "batch", attempt=1, notify="c1"), b"t", 0, 1),
        PublishItem(r1, b"t", 3, 1),  # follows tokens never written
        PublishItem(Target("r1", "batch", attempt=7), b"t", 0, 1),  # another attempt's
        PublishItem(Target("broken", "batch"), b"t", 0, 1),
        PublishItem(r1, b"d", 1, 1, ack=entry.entry_id),
    ]
    answers = await lib.publish.run(conn, KEYS, items, reply_maxlen=10)
    assert answers[:3] == [PublishOutcome.WRITTEN, PublishOutcome.BEHIND, PublishOutcome.FENCED]
    assert isinstance(answers[3], str) and "WRONGTYPE" in answers[3] and answers[4] is PublishOutcome.WRITTEN
    assert [fields[b"m"] for _, fields in await conn.xrange(KEYS.result("r1"))] == [b"t", b"d"]
    assert await conn.hget(KEYS.fence("r1"), Fence.WRITTEN) == b"2"
    assert await conn.xlen(KEYS.lane("batch")) == 0  # acknowledged and deleted
    [(_, notice)] = await conn.xrange(KEYS.wake("c1"))
    assert notice == {scripts.WAKE_NOTICE: KEYS.result("r1").encode()}
