"""The Redis data model of a queue, in one place: key names and the status query; the scripts and what they share
with Python (fence fields, codes, the consumer group) are in `client.scripts`, re-exported here. Both sides import
it (the worker too), so it depends on nothing but the protocol and scripts modules.

Keys of a queue share the hash tag `{<prefix>:<queue>}` (one Redis Cluster slot); `Keys` names them all. A queue
spread over P partitions (`LLMQ_QUEUE_PARTITIONS`) has P such tags, `{<prefix>:<queue>}` and `{<prefix>:<queue>#p}`
for p = 1 .. P-1 ('#' is in no queue name), each its own slot; a request lives in one, `partition_of` its id.
Scripts are registered once per connection (`Scripts.register`), one typed wrapper per `.lua` file.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from client.errors import MalformedEntry
from client.protocol import (
    DEFAULT_PREFIX,
    LANES,
    Lane,
    PrefixCacheInfo,
    WorkerInfo,
    decode_prefix_cache,
    decode_request,
    decode_worker,
    is_valid_name,
    ms_now,
)
from client.scripts import CONSUMER_GROUP as CONSUMER_GROUP
from client.scripts import WAKE_MAXLEN as WAKE_MAXLEN
from client.scripts import WAKE_NOTICE as WAKE_NOTICE
from client.scripts import WAKE_TTL_S as WAKE_TTL_S
from client.scripts import Fence as Fence
from client.scripts import Scripts as Scripts

MAX_PARTITIONS = 1024


@dataclass(frozen=True)
class Keys:
    """Key names of one queue; all share the hash tag `{<prefix>:<queue>}`, so a queue is one shard."""

    queue: str
    prefix: str = DEFAULT_PREFIX
    partition: int = 0

    def __post_init__(self) -> None:
        for what, name in (("queue", self.queue), ("prefix", self.prefix)):
            if not is_valid_name(name):
                raise ValueError(f"{what} {name!r} must be 1-128 characters of [A-Za-z0-9._:-]")
        if not 0 <= self.partition < MAX_PARTITIONS:
            raise ValueError(f"partition must be in [0, {MAX_PARTITIONS}), got {self.partition}")

    @property
    def tag(self) -> str:
        suffix = f"#{self.partition}" if self.partition else ""
        return f"{{{self.prefix}:{self.queue}{suffix}}}"

    @property
    def home(self) -> Keys:
        """Partition 0, which holds what the whole queue shares: the workers' heartbeats and the fleet's rate."""
        return self if self.partition == 0 else replace(self, partition=0)

    def partitioned(self, count: int) -> list[Keys]:
        """The keys of each of `count` partitions of this queue, partition 0 (today's keys) first."""
        if not 1 <= count <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be in [1, {MAX_PARTITIONS}], got {count}")
        return [replace(self, partition=p) for p in range(count)]

    @property
    def requests(self) -> str:
        """Stream of the default lane's unfinished requests, read by consumer group `CONSUMER_GROUP`."""
        return f"{self.tag}:requests"

    def lane(self, lane: str) -> str:
        """Stream of one lane's unfinished requests (`LANES`); the default lane's is `requests`, as before lanes."""
        return self.requests if lane == "default" else f"{self.requests}:{lane}"

    @property
    def lanes(self) -> dict[Lane, str]:
        """Every lane's request stream, highest lane first."""
        return {lane: self.lane(lane) for lane in LANES}

    @property
    def fleet_rate(self) -> str:
        """Tokens per second the fleet generated lately, as the workers' heartbeats measure it (with a TTL)."""
        return f"{self.home.tag}:tokens_per_s"

    @property
    def dead(self) -> str:
        """Stream of dead letters."""
        return f"{self.tag}:dead"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel; each message is the id of a request to cancel."""
        return f"{self.tag}:cancel"

    @property
    def workers(self) -> str:
        """Hash: worker id -> msgpack `WorkerInfo` (the queue's, in partition 0)."""
        return f"{self.home.tag}:workers"

    @property
    def prefix_caches(self) -> str:
        """Hash: worker id -> msgpack `PrefixCacheInfo`, beside `workers` (the queue's, in partition 0)."""
        return f"{self.home.tag}:prefix_caches"

    @property
    def affinity_assigned(self) -> str:
        """Sorted set of entries read by one worker and assigned to another by cache affinity (`read.lua`)."""
        return f"{self.tag}:affinity:assigned"

    @property
    def affinity_workers(self) -> str:
        """Hash: worker id -> "free slots, epoch ms" as its last read reported them, for cache affinity."""
        return f"{self.tag}:affinity:workers"

    @property
    def affinity_wake(self) -> str:
        """Stream a worker appends to when it assigns an entry to another: the workers' blocking reads wake."""
        return f"{self.tag}:affinity:wake"

    @property
    def affinity_holders(self) -> str:
        """Hash: affinity key -> the worker that holds it (its requests go there), for cache affinity."""
        return f"{self.tag}:affinity:holders"

    @property
    def affinity_used(self) -> str:
        """Sorted set of affinity keys by when a request last used one (unused ones lose their holder)."""
        return f"{self.tag}:affinity:used"

    @property
    def affinity_loads(self) -> str:
        """Hash: worker id -> how many affinity keys it holds (new keys go to the live worker with fewest)."""
        return f"{self.tag}:affinity:loads"

    @property
    def affinity(self) -> list[str]:
        """Every key of cache affinity, in the order `read.lua` takes them."""
        return [
            self.affinity_assigned,
            self.affinity_workers,
            self.affinity_wake,
            self.affinity_holders,
            self.affinity_used,
            self.affinity_loads,
        ]

    def held(self, lane: str) -> str:
        """Stream of one lane's requests held for fair share between tenants (`docs/tenants.md`): workers move
        them to the lane's stream (`lane`) in fair order as slots free; emptied, as the lanes' streams are."""
        return f"{self.tag}:held:{lane}"

    def held_order(self, lane: str) -> str:
        """Sorted set (all scores 0, read by lex range): "<tenant>\\0<entry id, padded>" per held entry, so each
        tenant's oldest held entry is one range read away."""
        return f"{self.tag}:held:{lane}:order"

    def fair(self, lane: str) -> str:
        """Sorted set: tenant with held entries -> its virtual time (tokens served over its weight)."""
        return f"{self.tag}:fair:{lane}"

    def fair_idle(self, lane: str) -> str:
        """Hash: the lane's virtual clock (field "") and each tenant's virtual time when it last had nothing held."""
        return f"{self.tag}:fair:{lane}:idle"

    @property
    def tenant_weights(self) -> str:
        """Hash: tenant -> its weight in fair share (1 when absent); `llmq tenants` writes every partition's."""
        return f"{self.tag}:tenants:weights"

    @property
    def fair_readers(self) -> str:
        """Set (with a TTL) while a worker that moves held requests reads this partition: clients hold requests
        for fair share only then, so a fleet of workers that predate it still gets every request."""
        return f"{self.tag}:held:readers"

    @property
    def tenant_limits(self) -> str:
        """Hash: tenant -> its quotas (`client.tenants.TenantLimits.pack`); `llmq tenants` writes every
        partition's."""
        return f"{self.tag}:tenants:limits"

    @property
    def tenant_counts(self) -> str:
        """Hash of the tenants' quota state, kept by the scripts that admit and finish work: "<tenant>|queued",
        "|queued_tokens" (held now), "|running" (moved to run and not finished), "|bucket" and "|bucket_ms" (tokens
        left of its rate, and when), "|refund" (tokens estimated above what finished requests used)."""
        return f"{self.tag}:tenants:counts"

    @property
    def tenants_max(self) -> str:
        """String (with a TTL): how many tenants may submit to this partition within `TENANT_SEEN_MS`, set by the
        workers' heartbeats from `LLMQ_MAX_TENANTS` (absent: no bound)."""
        return f"{self.tag}:tenants:max"

    @property
    def tenants_seen(self) -> str:
        """Sorted set: tenant -> when it last submitted here (epoch ms); `submit.lua` bounds its size."""
        return f"{self.tag}:tenants:seen"

    @property
    def tenant_running(self) -> str:
        """Sorted set: "<tenant>\0<entry id>" of every request moved to run -> when its count lapses (a request
        lost without its final event frees its tenant's running count then)."""
        return f"{self.tag}:tenants:running"

    def fairness(self, lanes: Sequence[str]) -> list[str]:
        """Every key of fair share for `lanes`, in the order `read.lua` takes them: per lane its held stream,
        order, virtual times and idle hash; then the weights, the readers' mark and the quotas: limits, counts and
        running requests."""
        per_lane = [
            key
            for lane in lanes
            for key in (self.held(lane), self.held_order(lane), self.fair(lane), self.fair_idle(lane))
        ]
        quotas = [self.tenant_limits, self.tenant_counts, self.tenant_running]
        return [*per_lane, self.tenant_weights, self.fair_readers, *quotas]

    def usage(self, hour: int) -> str:
        """Hash of the tenants' usage in one hour (hours since the epoch, UTC): "<tenant>|requests|<outcome>",
        "<tenant>|prompt_tokens", "|generated_tokens", "|queue_wait_ms", "|generation_ms" -> counts, with a TTL."""
        return f"{self.tag}:usage:{hour}"

    def result(self, request_id: str) -> str:
        """Stream of one request's events; every write refreshes its TTL."""
        return f"{self.tag}:result:{request_id}"

    def cancel(self, request_id: str) -> str:
        """Cancel mark (with a TTL), for a worker that missed the pub/sub message."""
        return f"{self.tag}:cancel:{request_id}"

    def submitted(self, request_id: str) -> str:
        """Idempotency marker set by the submit script; lives for the request's `result_ttl`."""
        return f"{self.tag}:id:{request_id}"

    def reply(self, name: str) -> str:
        """A shared stream of completions (`Completion`) of the requests submitted with `reply_to=name`."""
        return f"{self.tag}:reply:{name}"

    def wake(self, client_id: str) -> str:
        """A client's private stream: appending to it ends the client's blocking read of result streams."""
        return f"{self.tag}:wake:{client_id}"

    def fence(self, request_id: str) -> str:
        """Workers' hash of one request: the `Fence` fields."""
        return f"{self.tag}:fence:{request_id}"


def partition_of(request_id: str, partitions: int) -> int:
    """The partition of a request: CRC-32 of its id, so every client, gateway and worker agrees without asking."""
    return zlib.crc32(request_id.encode()) % partitions if partitions > 1 else 0


# --- status -------------------------------------------------------------------------------------


BACKLOG_SAMPLE = 100  # entries per lane whose size is averaged for `LaneStatus.backlog_tokens`


@dataclass(frozen=True)
class LaneStatus:
    """One lane of a queue: its depth (waiting + running), of which `held` wait in the held stream for fair share
    between tenants (`docs/tenants.md`), the consumer group's pending (delivered, unacknowledged) and lag
    (undelivered, held ones included; 0 while workers take all they can batch, so not a scaling signal on its
    own), and the backlog: requests, tokens (prompt + `max_new_tokens`, estimated from the oldest
    `BACKLOG_SAMPLE` entries; a prompt given as text counts 4 bytes a token) and seconds at the fleet's rate."""

    lane: str
    depth: int
    pending: int | None
    lag: int | None
    oldest_pending_age_s: float | None
    backlog_tokens: int
    backlog_seconds: float | None
    held: int = 0


@dataclass(frozen=True)
class PartitionStatus:
    """One partition of a queue (`LLMQ_QUEUE_PARTITIONS`): its own depth, pending, lag and dead letters."""

    partition: int
    depth: int
    pending: int | None
    lag: int | None
    dead: int


@dataclass(frozen=True)
class QueueStatus:
    """A queue at a glance, summed over its lanes (`lanes` has each); `pending`/`lag` are None until a worker has
    created the consumer group."""

    queue: str
    depth: int
    pending: int | None
    lag: int | None
    dead: int
    workers: list[WorkerInfo] = field(default_factory=list)
    oldest_pending_age_s: float | None = None  # how long the oldest unacknowledged request has been delivered
    # Workers gone: heartbeats older than `stale_after_s` or unreadable, and prefix caches of no live worker.
    stale_workers: list[str] = field(default_factory=list)
    lanes: list[LaneStatus] = field(default_factory=list)  # highest lane first
    tokens_per_s: float | None = None  # the fleet's recent generation rate, as the workers measure it
    partitions: list[PartitionStatus] = field(default_factory=list)  # each partition's share, when there are several
    prefix_caches: dict[str, PrefixCacheInfo] = field(default_factory=dict)  # by live worker id, where it caches

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "workers": [w.model_dump() for w in self.workers],
            "prefix_caches": {worker: cache.model_dump() for worker, cache in self.prefix_caches.items()},
        }


def _group_stats(groups: Any, group: bytes) -> tuple[int | None, int | None]:
    if isinstance(groups, Exception):  # no stream yet: XINFO answers an error
        return None, None
    for info in groups:
        name = info.get("name")
        if (name.encode() if isinstance(name, str) else name) == group:
            return info.get("pending"), info.get("lag")
    return None, None


_HEAD = 4  # replies before the lanes' in `queue_status_commands`
_PER_LANE = 6  # replies per lane in `queue_status_commands`


def queue_status_commands(pipe: Any, keys: Keys, partitions: int = 1) -> None:
    """Queue on a pipeline the reads `status_from_replies` expects, in its order: each partition's in turn."""
    for part in keys.partitioned(partitions):
        pipe.xlen(part.dead)
        pipe.hgetall(part.workers)
        pipe.get(part.fleet_rate)
        pipe.hgetall(part.prefix_caches)
        for lane, stream in part.lanes.items():
            pipe.xlen(stream)
            pipe.xlen(part.held(lane))
            pipe.xinfo_groups(stream)
            pipe.xpending(stream, CONSUMER_GROUP)
            pipe.xrange(stream, count=BACKLOG_SAMPLE)
            pipe.xrange(part.held(lane), count=BACKLOG_SAMPLE)


def queue_cancel_commands(pipe: Any, keys: Keys, request_id: str, ttl: int, *, sharded: bool) -> None:
    """Queue on a pipeline the cancel mark (for a worker that missed the message) and the message: `sharded` on a
    Redis Cluster (SPUBLISH reaches the channel's own shard; PUBLISH would be copied to every node)."""
    pipe.set(keys.cancel(request_id), 1, ex=ttl)
    (pipe.spublish if sharded else pipe.publish)(keys.cancel_channel, request_id)


def status_from_replies(queue: str, replies: list[Any], stale_after_s: float) -> QueueStatus:
    """Build `QueueStatus` from the replies to `queue_status_commands`, of one partition or several."""
    per = _HEAD + _PER_LANE * len(LANES)
    parts = [replies[start : start + per] for start in range(0, len(replies), per)]
    return merge_partitions([_partition_status(queue, part, stale_after_s) for part in parts])


def _partition_status(queue: str, replies: list[Any], stale_after_s: float) -> QueueStatus:
    dead, workers_hash, rate, caches = replies[:_HEAD]
    for reply in (dead, workers_hash):
        if isinstance(reply, Exception):
            raise reply
    tokens_per_s = float(rate) if rate and not isinstance(rate, Exception) else None
    lanes = [
        _lane_status(lane, replies[_HEAD + _PER_LANE * i : _HEAD + _PER_LANE * (i + 1)], tokens_per_s)
        for i, lane in enumerate(LANES)
    ]
    oldest = ms_now() - int(stale_after_s * 1000)
    workers, stale = [], []
    for worker_id, raw in workers_hash.items():
        try:
            info = decode_worker(raw)
        except MalformedEntry:
            info = None
        if info is not None and info.heartbeat >= oldest:
            workers.append(info)
        else:
            stale.append(worker_id.decode() if isinstance(worker_id, bytes) else worker_id)
    workers.sort(key=lambda w: w.id)
    caches, gone = _prefix_caches(caches, {w.id for w in workers})
    known = [lane for lane in lanes if lane.pending is not None]
    ages = [lane.oldest_pending_age_s for lane in lanes if lane.oldest_pending_age_s is not None]
    return QueueStatus(
        queue=queue,
        depth=sum(lane.depth for lane in lanes),
        pending=sum(lane.pending or 0 for lane in known) if known else None,
        lag=sum(lane.lag or 0 for lane in known) if known else None,
        dead=dead,
        workers=workers,
        oldest_pending_age_s=max(ages, default=None),
        stale_workers=sorted({*stale, *gone}),
        lanes=lanes,
        tokens_per_s=tokens_per_s,
        prefix_caches=caches,
    )


def _prefix_caches(reply: Any, live: set[str]) -> tuple[dict[str, PrefixCacheInfo], list[str]]:
    """The live workers' prefix caches, and the ids of entries left by workers gone (or unreadable). A Redis that
    refused the read (it cannot hold the workers' hash then either) shows none."""
    caches: dict[str, PrefixCacheInfo] = {}
    gone = []
    for raw_id, raw in ({} if isinstance(reply, Exception) else reply).items():
        worker_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
        try:
            cache = decode_prefix_cache(raw)
        except MalformedEntry:
            cache = None
        if cache is not None and worker_id in live:
            caches[worker_id] = cache
        else:
            gone.append(worker_id)
    return caches, gone


def merge_partitions(statuses: list[QueueStatus]) -> QueueStatus:
    """One queue's status from its partitions' (`status_from_replies` of each, partition 0 first): counts summed,
    lane by lane, the workers and the rate (which all partitions share) from the first, each partition listed."""
    if len(statuses) == 1:
        return statuses[0]
    first = statuses[0]

    def total(values: list[int | None]) -> int | None:
        known = [value for value in values if value is not None]
        return sum(known) if known else None

    lanes = []
    for i, lane in enumerate(first.lanes):
        each = [status.lanes[i] for status in statuses]
        tokens = sum(one.backlog_tokens for one in each)
        lanes.append(
            LaneStatus(
                lane=lane.lane,
                depth=sum(one.depth for one in each),
                pending=total([one.pending for one in each]),
                lag=total([one.lag for one in each]),
                oldest_pending_age_s=_oldest([one.oldest_pending_age_s for one in each]),
                backlog_tokens=tokens,
                backlog_seconds=tokens / first.tokens_per_s if first.tokens_per_s else None,
                held=sum(one.held for one in each),
            )
        )
    return replace(
        first,
        depth=sum(status.depth for status in statuses),
        pending=total([status.pending for status in statuses]),
        lag=total([status.lag for status in statuses]),
        dead=sum(status.dead for status in statuses),
        oldest_pending_age_s=_oldest([status.oldest_pending_age_s for status in statuses]),
        lanes=lanes,
        partitions=[
            PartitionStatus(p, status.depth, status.pending, status.lag, status.dead)
            for p, status in enumerate(statuses)
        ],
    )


def _oldest(ages: list[float | None]) -> float | None:
    return max((age for age in ages if age is not None), default=None)


def _lane_status(lane: str, replies: list[Any], tokens_per_s: float | None) -> LaneStatus:
    depth, held, groups, pending_summary, sample, held_sample = replies
    if isinstance(depth, Exception):
        raise depth
    held = 0 if isinstance(held, Exception) else held
    depth += held
    pending, lag = _group_stats(groups, CONSUMER_GROUP.encode())
    samples = [reply for reply in (sample, held_sample) if not isinstance(reply, Exception)]
    sizes = [_entry_tokens(fields) for reply in samples for _, fields in reply]
    known = [size for size in sizes if size is not None]
    tokens = round(depth * sum(known) / len(known)) if known else 0
    return LaneStatus(
        lane=lane,
        depth=depth,
        held=held,
        pending=pending,
        lag=None if lag is None else lag + held,
        oldest_pending_age_s=_oldest_pending_age_s(pending_summary),
        backlog_tokens=tokens,
        backlog_seconds=tokens / tokens_per_s if tokens_per_s else None,
    )


def _entry_tokens(fields: dict[bytes, bytes]) -> int | None:
    try:
        return decode_request(fields.get(b"m", b"")).estimated_tokens()
    except (MalformedEntry, ValueError):
        return None


def _oldest_pending_age_s(summary: Any) -> float | None:
    """Age of the oldest delivered, unacknowledged entry, from its id's millisecond part."""
    if isinstance(summary, Exception) or not summary or not summary.get("min"):
        return None
    oldest = summary["min"].decode() if isinstance(summary["min"], bytes) else summary["min"]
    return max(0.0, (ms_now() - int(oldest.split("-")[0])) / 1000)
