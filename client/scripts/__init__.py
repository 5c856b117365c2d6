"""Every Lua script of a queue, as a typed library: one `.lua` file here per script, one wrapper class per file.

A wrapper owns its script's contract on both sides: it packs KEYS and ARGV from named arguments (`Keys` and request
ids in, never key strings built by a caller) and parses the reply into a Python type. What the Lua compares or
writes (fence fields, reason and reply codes, entry fields, the PUBLISH strides) is defined once, here, and
substituted into the source when it is loaded (`${NAME}` placeholders, `LUA_CONSTANTS`), so the two sides cannot
drift. Scripts are registered once per connection (`Scripts.register`): redis-py runs them by EVALSHA and loads
one on each node (a Cluster's, a promoted replica) that does not know it yet.

| file | wrapper | run by | what it does |
| --- | --- | --- | --- |
| `submit.lua` | `Submit` | client | idempotency marker + queue limit + XADD, atomically |
| `renew.lua` | `Renew` | worker | renews the leases of the entries the worker still owns |
| `hand_back.lua` | `HandBack` | worker | makes owned entries claimable at once; counts hand-backs and engine failures |
| `publish.lua` | `Publish` | worker | one flush of result events: fenced, idempotent, acknowledging, per request |
| `read.lua` | `Read` | worker | new requests, lane by lane, as many as the free slots, routed by cache affinity |

Every key a script touches shares its queue partition's hash tag, so each call is single-slot on a Cluster.
This module depends on nothing of the package but the protocol and replication modules; `client.store` re-exports
its constants.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cache
from importlib import resources
from string import Template
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from client.protocol import (
    AFFINITY_FIELD,
    COST_FIELD,
    ENTRY_FIELD,
    LANES,
    NOTIFY_FIELD,
    TENANT_FIELD,
    TRACE_FIELD,
    Lane,
)
from client.replication import run_script_async, run_script_sync

if TYPE_CHECKING:
    from client.store import Keys

CONSUMER_GROUP = "workers"
WAKE_NOTICE = b"r"  # field of a wake stream entry: the result keys a worker just wrote to, space-separated
WAKE_MAXLEN = 1000  # entries a wake stream keeps (about); a client further behind is covered by its sweep
WAKE_TTL_S = 600
AFFINITY_NOTICE = b"a"  # field of an affinity wake entry (`Keys.affinity_wake`): the worker an entry was assigned to
HANDED_BACK_IDLE_MS = 365 * 24 * 3600 * 1000  # idle "for a year": any worker's next XAUTOCLAIM takes it


class Fence:
    """Fields of a request's fence hash (`Keys.fence`), written by workers only, expiring with the request."""

    ATTEMPT = "a"  # raised by every claim; a write is accepted only from the current attempt
    WRITTEN = "n"  # tokens whose events are written: a retried write below it is skipped
    HANDED_BACK = "h"  # hand-backs (drains, engine failures): forgiven up to `max_hand_backs` deliveries
    ENGINE_FAILURES = "f"  # engine failures the request was implicated in: quarantined at `max_engine_failures`
    STARTED = "s"  # epoch ms the first attempt started (timings after a resume describe the whole request)
    PREEMPTED = "p"  # hand-backs to make room for an interactive request: all forgiven, limited by `max_preemptions`


class HandBackReason(IntEnum):
    """Why entries are handed back (`HandBack`): each counts a different fence field."""

    DRAIN = 0  # shutdown, a lost reader...: `Fence.HANDED_BACK`
    ENGINE_FAILURE = 1  # an engine failure implicated the request: `Fence.HANDED_BACK` and `Fence.ENGINE_FAILURES`
    PREEMPTION = 2  # room for an interactive request: `Fence.PREEMPTED` only


class SubmitOutcome(IntEnum):
    """`Submit`'s answer."""

    DUPLICATE = 0  # the id was submitted before: nothing added
    ADDED = 1
    FULL = -1  # the lane's backlog is at its limit: nothing added, not even the idempotency marker
    TENANT_FULL = -2  # the tenant's queued requests or tokens are at its quota (`Keys.tenant_limits`): nothing added
    TENANT_TOO_LARGE = -3  # the call alone passes the tenant's queued quota: nothing added, and no retry helps
    TENANTS_FULL = -4  # a new tenant, and the partition has seen its most tenants lately (`Keys.tenants_max`)


class PublishOutcome(IntEnum):
    """`Publish`'s answer for one event (an error message, a `str`, when Redis refused that event's keys)."""

    FENCED = 0  # another attempt owns the request: nothing written, nothing acknowledged
    WRITTEN = 1  # written, or already there
    BEHIND = 2  # the stream holds fewer tokens than the event follows (a failover lost writes): not written


# Error prefixes that concern the whole server: PUBLISH fails the call on them (the batch stays queued) instead of
# failing the one event whose keys met them.
SERVER_WIDE_ERRORS = ("OOM", "READONLY", "LOADING", "BUSY", "MASTERDOWN", "NOREPLICAS", "MISCONF", "CLUSTERDOWN")
PUBLISH_HEADER_KEYS = 2  # the partition's tenant counts and running requests
PUBLISH_HEADER_ARGS = 4  # group, reply MAXLEN, wake MAXLEN, wake TTL
PUBLISH_KEYS_PER_EVENT = 6  # request stream, result stream, fence hash, reply stream, wake stream, usage hash
PUBLISH_ARGS_PER_EVENT = 8  # attempt, ttl, event, seq, size, entry id to acknowledge, completion, usage
AFFINITY_MAX_KEYS = 10_000  # keys with a holder per queue partition; past it the least recently used is forgotten
# A tenant's usage in an hour's hash (`Keys.usage`): "<tenant>|requests|<outcome>" and "<tenant>|<count>" for each
# of the counts, in `pack_usage`'s order after the outcome.
USAGE_REQUESTS = "requests"
USAGE_COUNTS = ("prompt_tokens", "generated_tokens", "queue_wait_ms", "generation_ms")
FAIR_IDLE_TTL_MS = 86_400_000  # a lane's fair-share clock and idle tenants' virtual times outlive a day of silence
# A request counts against its tenant's running quota until its final event, or this long after it was moved to
# run when that event never comes (a request lost to a bug or a deleted stream): a count cannot leak for good.
TENANT_RUNNING_TTL_MS = 3_600_000
# A tenant counts against the bound on tenants (`Keys.tenants_max`) until it has not submitted for this long: the
# usage hash of an hour (`Keys.usage`) holds at most that many tenants, whatever names callers make up.
TENANT_SEEN_MS = 3_600_000


class TenantCount:
    """Fields of a tenant's quota state in `Keys.tenant_counts`, each after "<tenant>|"."""

    QUEUED = "queued"  # requests held for fair share, every lane (`submit.lua` up, `read.lua` down)
    QUEUED_TOKENS = "queued_tokens"  # their estimated tokens (`COST_FIELD`)
    RUNNING = "running"  # moved to run and not finished (`read.lua` up, `publish.lua` down, or lapsed)
    BUCKET = "bucket"  # tokens left of its rate when last used (`tokens_per_minute`)
    BUCKET_MS = "bucket_ms"  # ... and when
    REFUND = "refund"  # tokens estimated above what its finished requests used, owed back to its virtual time


# Everything the Lua sources name with `${NAME}`: Python's values, written into the source at load time.
LUA_CONSTANTS: dict[str, str | bytes | int | tuple[str, ...]] = {
    "ENTRY_FIELD": ENTRY_FIELD,
    "AFFINITY_FIELD": AFFINITY_FIELD,
    "TENANT_FIELD": TENANT_FIELD,
    "COST_FIELD": COST_FIELD,
    "NOTIFY_FIELD": NOTIFY_FIELD,
    "TRACE_FIELD": TRACE_FIELD,
    "WAKE_NOTICE": WAKE_NOTICE,
    "AFFINITY_NOTICE": AFFINITY_NOTICE,
    "AFFINITY_MAX_KEYS": AFFINITY_MAX_KEYS,
    "FAIR_IDLE_TTL_MS": FAIR_IDLE_TTL_MS,
    "TENANT_RUNNING_TTL_MS": TENANT_RUNNING_TTL_MS,
    "TENANT_SEEN_MS": TENANT_SEEN_MS,
    **{f"COUNT_{name}": getattr(TenantCount, name) for name in vars(TenantCount) if name.isupper()},
    "USAGE_REQUESTS": USAGE_REQUESTS,
    "USAGE_COUNTS": USAGE_COUNTS,
    "FENCE_ATTEMPT": Fence.ATTEMPT,
    "FENCE_WRITTEN": Fence.WRITTEN,
    "FENCE_HANDED_BACK": Fence.HANDED_BACK,
    "FENCE_ENGINE_FAILURES": Fence.ENGINE_FAILURES,
    "FENCE_PREEMPTED": Fence.PREEMPTED,
    **{f"HAND_BACK_{reason.name}": int(reason) for reason in HandBackReason},
    **{f"SUBMIT_{outcome.name}": int(outcome) for outcome in SubmitOutcome},
    **{f"PUBLISH_{outcome.name}": int(outcome) for outcome in PublishOutcome},
    "PUBLISH_HEADER_KEYS": PUBLISH_HEADER_KEYS,
    "PUBLISH_HEADER_ARGS": PUBLISH_HEADER_ARGS,
    "PUBLISH_KEYS_PER_EVENT": PUBLISH_KEYS_PER_EVENT,
    "PUBLISH_ARGS_PER_EVENT": PUBLISH_ARGS_PER_EVENT,
    "SERVER_WIDE_ERRORS": SERVER_WIDE_ERRORS,
}

_LUA_WORD = re.compile(r"[A-Za-z0-9_]+")


def _lua_literal(value: str | bytes | int | tuple[str, ...]) -> str:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, tuple):
        return "{" + ", ".join(_lua_literal(item) for item in value) + "}"
    text = value.decode() if isinstance(value, bytes) else value
    if not _LUA_WORD.fullmatch(text):  # quoted as is: only characters that need no escape in a Lua string
        raise ValueError(f"constant {text!r} is not a plain word")
    return f"'{text}'"


def template(name: str) -> str:
    """The `.lua` file of a script as shipped in the package, placeholders and all."""
    return resources.files(__name__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


@cache
def source(name: str) -> str:
    """A script's Lua source with every `${NAME}` replaced by its Python constant (a missing one raises)."""
    return Template(template(name)).substitute({key: _lua_literal(value) for key, value in LUA_CONSTANTS.items()})


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """KEYS and ARGV of one script call, as a wrapper packed them."""

    keys: list[str]
    args: list[Any]


class LuaScript:
    """One `.lua` file registered on one connection (sync or asyncio). Callers use the subclass's typed methods;
    calling it with packed `keys`/`args` runs it unparsed, as redis-py's script does, which is how
    `client.replication` runs it before its WAIT."""

    name: ClassVar[str]

    def __init__(self, redis: Any) -> None:
        self.registered: Any = redis.register_script(source(self.name))

    @property
    def sha(self) -> str:
        sha: str = self.registered.sha
        return sha

    @property
    def script(self) -> str | bytes:
        script: str | bytes = self.registered.script
        return script

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        return self.registered(keys=keys, args=args)


class Submit(LuaScript):
    """KEYS: the lane's request stream and its fair-share keys (`Keys.fairness` of the lane, less the weights),
    the tenants' limits and counts, the bound on tenants and the tenants seen, then each request's idempotency
    marker. ARGV: the lane's limit (0 = none), the
    result TTL, the client id, the trace context (`TRACE_FIELD`, b"" for none), the tenant (b"" for none), then
    per request its entry, its affinity key (`AFFINITY_FIELD`, b"" for none) and its estimated cost in tokens.
    Reply: a `SubmitOutcome` per request (all FULL, all TENANT_FULL, all TENANT_TOO_LARGE, all TENANTS_FULL, or
    each ADDED or DUPLICATE)."""

    name = "submit"

    @staticmethod
    def pack(
        keys: Keys,
        request_ids: Sequence[str],
        lane: Lane,
        entries: Sequence[bytes],
        limit: int,
        ttl_s: int,
        client_id: str,
        trace: bytes = b"",
        affinities: Sequence[bytes] | None = None,
        tenant: str = "",
        costs: Sequence[int] | None = None,
    ) -> ScriptCall:
        markers = [keys.submitted(request_id) for request_id in request_ids]
        fairness = [keys.held(lane), keys.held_order(lane), keys.fair(lane), keys.fair_idle(lane), keys.fair_readers]
        fairness += [keys.tenant_limits, keys.tenant_counts, keys.tenants_max, keys.tenants_seen]
        per_request = zip(entries, affinities or [b""] * len(entries), costs or [0] * len(entries), strict=True)
        args = [item for triple in per_request for item in triple]
        return ScriptCall([keys.lane(lane), *fairness, *markers], [limit, ttl_s, client_id, trace, tenant, *args])

    @staticmethod
    def parse(reply: Any) -> list[SubmitOutcome]:
        return [SubmitOutcome(int(answer)) for answer in reply]

    def run_sync(self, client: Any, call: ScriptCall, replicas: int = 0) -> list[SubmitOutcome]:
        """On a blocking connection, then WAIT for `replicas` (`client.replication`)."""
        return self.parse(run_script_sync(client, self, call.keys, call.args, replicas))

    async def run_async(self, client: Any, call: ScriptCall, replicas: int = 0) -> list[SubmitOutcome]:
        """On an asyncio connection, then WAIT for `replicas` (`client.replication`)."""
        return self.parse(await run_script_async(client, self, call.keys, call.args, replicas))


class Renew(LuaScript):
    """KEYS: the lane's request stream. ARGV: group, consumer, then the entry ids. Reply: the ids no longer ours."""

    name = "renew"

    @staticmethod
    def parse(reply: Any) -> set[bytes]:
        return {_bytes(entry_id) for entry_id in reply}

    async def run(self, keys: Keys, lane: Lane, consumer: str, entry_ids: Sequence[bytes]) -> set[bytes]:
        """Renews the leases of `entry_ids` still ours; returns those we lost."""
        reply = await self.registered(keys=[keys.lane(lane)], args=[CONSUMER_GROUP, consumer, *entry_ids])
        return self.parse(reply)


class HandBack(LuaScript):
    """KEYS: the lane's request stream, then one fence hash per entry. ARGV: group, consumer, idle ms, the reason
    (`HandBackReason`), then the entry ids. Reply: how many entries were ours."""

    name = "hand_back"

    @staticmethod
    def parse(reply: Any) -> int:
        return int(reply)

    async def run(
        self,
        keys: Keys,
        lane: Lane,
        consumer: str,
        entries: Sequence[tuple[bytes, str]],
        reason: HandBackReason,
        idle_ms: int = HANDED_BACK_IDLE_MS,
    ) -> int:
        """Hands back the (entry id, request id) pairs still ours; returns how many were."""
        fences = [keys.fence(request_id) for _, request_id in entries]
        code = int(HandBackReason(reason))  # a plain int: redis-py would send an IntEnum's repr
        args = [CONSUMER_GROUP, consumer, idle_ms, code, *(entry_id for entry_id, _ in entries)]
        return self.parse(await self.registered(keys=[keys.lane(lane), *fences], args=args))


@dataclass(frozen=True, slots=True)
class ReadEntry:
    lane: Lane
    entry_id: bytes
    fields: dict[bytes, bytes]


@dataclass(frozen=True, slots=True)
class ReadReply:
    """The entries read, in order. When there were none: each lane's stream, the affinity wake stream and each
    lane's held stream -> its newest entry id (for XREAD), and `retry_ms`, how soon an entry assigned to another
    worker may be taken here (None: no such entry). `assigned`, `taken` and `stolen` count this call's affinity
    moves (`read.lua`); `overflow`, the entries read here although another worker holds their key, because its queue
    was full."""

    entries: list[ReadEntry]
    last: dict[str, bytes]
    retry_ms: int | None = None
    assigned: int = 0
    taken: int = 0
    stolen: int = 0
    overflow: int = 0


@dataclass(frozen=True, slots=True)
class Routing:
    """Cache affinity for a worker's reads: `wait_ms` before this worker takes an entry assigned to another that has
    not taken it (0: this worker routes nothing, reports nothing and takes no assignment: plain pulls); a worker is
    live while its last report is younger than `live_ms`; a key keeps its holder while used within `hold_ms`."""

    wait_ms: int = 0
    live_ms: int = 5000
    hold_ms: int = 600_000  # a key unused this long is forgotten: its next request goes to the least loaded worker
    queue: int = 8  # entries that may wait for a full holder (it takes them first as slots free); then anyone runs them


ROUTED_LANES: frozenset[Lane] = frozenset({"default", "batch"})  # an interactive request is never held back
# Lanes whose reads leave a worker's kept slots to tenants with nothing running; an interactive request takes any
# free slot (it could preempt for one anyway).
KEEPING_LANES: frozenset[Lane] = frozenset({"default", "batch"})


class Read(LuaScript):
    """KEYS: the lanes' request streams, then the queue partition's affinity keys (`Keys.affinity`), then its
    fair-share keys for those lanes (`Keys.fairness`). ARGV: group,
    consumer, free, wait ms, live ms, hold ms, queue, whether to report the free slots left, the number of lanes
    and their names, then quadruples of (1-based lane index, wanted, routed, kept slots). Reply: `ReadReply`."""

    name = "read"

    @staticmethod
    def parse(keys: Keys, lanes: Sequence[Lane], reply: Any) -> ReadReply:
        read, last, retry, counts = reply
        entries = [
            ReadEntry(lanes[int(index) - 1], _bytes(entry_id), dict(zip(flat[::2], flat[1::2], strict=True)))
            for index, entry_id, flat in read
        ]
        streams = [*(keys.lane(lane) for lane in lanes), keys.affinity_wake, *(keys.held(lane) for lane in lanes)]
        newest = {stream: _bytes(entry_id) for stream, entry_id in zip(streams, last, strict=False)}
        assigned, taken, stolen, overflow = (int(count) for count in counts)
        retry_ms = int(retry) if int(retry) >= 0 else None
        return ReadReply(entries, newest, retry_ms, assigned, taken, stolen, overflow)

    async def run(
        self,
        keys: Keys,
        consumer: str,
        free: int,
        steps: Sequence[tuple[Lane, int]],
        lanes: Sequence[Lane] = LANES,
        routing: Routing = Routing(),
        report: bool = True,
        keep: int = 0,
    ) -> ReadReply:
        """At most `free` new entries of `lanes`, taken as `steps` (lane, wanted) say, routed by `routing`; with
        `report`, the free slots left (less the kept ones) are this worker's room for cache affinity. The last `keep`
        free slots go only to tenants with nothing running, on the `KEEPING_LANES`."""
        args: list[Any] = [CONSUMER_GROUP, consumer, free, routing.wait_ms, routing.live_ms, routing.hold_ms]
        args.append(routing.queue)
        args += [int(report), len(lanes), *lanes]
        for lane, wanted in steps:
            args += [lanes.index(lane) + 1, wanted, int(lane in ROUTED_LANES), keep if lane in KEEPING_LANES else 0]
        streams = [keys.lane(lane) for lane in lanes]
        reply = await self.registered(keys=[*streams, *keys.affinity, *keys.fairness(lanes)], args=args)
        return self.parse(keys, lanes, reply)


class PublishTarget(Protocol):
    """Where a request's events go (`worker.publisher.Target`), and the attempt that may write them (None:
    unfenced)."""

    @property
    def request_id(self) -> str: ...
    @property
    def lane(self) -> Lane: ...
    @property
    def ttl_s(self) -> int: ...
    @property
    def attempt(self) -> int | None: ...
    @property
    def reply_to(self) -> str | None: ...
    @property
    def notify(self) -> str | None: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def cost(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PublishItem:
    """One event for `Publish`, and the request stream entry it acknowledges (b"": none)."""

    target: PublishTarget
    event: bytes  # b"": acknowledge only
    seq: int
    size: int
    ack: bytes = b""
    completion: bytes = b""  # for `target.reply_to`, appended with the event
    usage: bytes = b""  # a final event's usage for `target.tenant` (`pack_usage`), counted with the event


def pack_usage(
    ttl_s: int,
    tenant: str,
    outcome: str,
    cost: int,
    prompt: int,
    generated: int,
    queue_wait_ms: int,
    generation_ms: int,
) -> bytes:
    """A final event's `PublishItem.usage`: what `publish.lua` adds to the tenant's counts of the hour, and the
    request's estimated tokens (`COST_FIELD`; 0: none), of which it refunds what was not used."""
    numbers = (max(0, int(value)) for value in (cost, prompt, generated, queue_wait_ms, generation_ms))
    return "|".join([str(ttl_s), tenant, outcome.replace("|", "/"), *map(str, numbers)]).encode()


class Publish(LuaScript):
    """KEYS: `PUBLISH_HEADER_KEYS`, then `PUBLISH_KEYS_PER_EVENT` per event. ARGV: `PUBLISH_HEADER_ARGS`, then
    `PUBLISH_ARGS_PER_EVENT` per event (see `publish.lua`). Reply: per event a `PublishOutcome`, or Redis's error
    message for its keys."""

    name = "publish"

    @staticmethod
    def pack(where: Keys, items: Sequence[PublishItem], reply_maxlen: int) -> ScriptCall:
        hour = int(time.time()) // 3600  # the usage bucket: this hour's
        keys: list[str] = [where.tenant_counts, where.tenant_running]
        args: list[Any] = [CONSUMER_GROUP, reply_maxlen, WAKE_MAXLEN, WAKE_TTL_S]
        for item in items:
            target = item.target
            result = where.result(target.request_id)
            reply = where.reply(target.reply_to) if target.reply_to is not None else result
            wake = where.wake(target.notify) if target.notify is not None else result
            usage = where.usage(hour) if item.usage else result
            keys += [where.lane(target.lane), result, where.fence(target.request_id), reply, wake, usage]
            attempt = "" if target.attempt is None else target.attempt
            args += [attempt, target.ttl_s, item.event, item.seq, item.size, item.ack, item.completion, item.usage]
        return ScriptCall(keys, args)

    @staticmethod
    def parse(reply: Any) -> list[PublishOutcome | str]:
        return [_publish_outcome(outcome) for outcome in reply]

    async def run(
        self, client: Any, where: Keys, items: Sequence[PublishItem], reply_maxlen: int, replicas: int = 0
    ) -> list[PublishOutcome | str]:
        """One call for `items` (all of partition `where`), then WAIT for `replicas` (`client.replication`)."""
        call = self.pack(where, items, reply_maxlen)
        return self.parse(await run_script_async(client, self, call.keys, call.args, replicas))


@dataclass(frozen=True)
class Scripts:
    """Every script, registered on one Redis connection (sync or asyncio)."""

    submit: Submit
    renew: Renew
    hand_back: HandBack
    publish: Publish
    read: Read

    @classmethod
    def register(cls, redis: Any) -> Scripts:
        return cls(Submit(redis), Renew(redis), HandBack(redis), Publish(redis), Read(redis))


SCRIPTS: tuple[type[LuaScript], ...] = (Submit, Renew, HandBack, Publish, Read)


def _publish_outcome(outcome: Any) -> PublishOutcome | str:
    if isinstance(outcome, bytes):
        return outcome.decode(errors="replace")
    return outcome if isinstance(outcome, str) else PublishOutcome(int(outcome))


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
