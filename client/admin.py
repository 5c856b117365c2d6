"""Operator reads of a Redis for `llmq`: which queues it holds, which workers of a queue are alive, and whether a
request id is known at all, so a command can answer "no such request" at once instead of waiting on a stream that
will never be written.

Blocking redis-py calls over a connection of its own, each retried across a failover as the client's calls are
(`client.failover.retry_sync`, so a failure is one `RedisUnavailable`); every key name comes from
`client.store.Keys`. `client.dead_letters` builds on it for the dead-letter stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.retry import Retry

from client._core import DEFAULT_URL, pool_kwargs
from client.connection import open_sync
from client.errors import MalformedEntry, UnsupportedVersion
from client.failover import FAILOVER_TIMEOUT_S, retry_sync
from client.protocol import (
    DEFAULT_PREFIX,
    ENTRY_FIELD,
    DoneEvent,
    ErrorEvent,
    WorkerInfo,
    decode_event,
    decode_worker,
    is_valid_name,
    ms_now,
)
from client.store import Keys, partition_of

T = TypeVar("T")

SCAN_COUNT = 1000  # keys Redis walks per SCAN call: each call stays short on a busy server
MAX_SCANNED_KEYS = 100_000  # matching keys `queues` reads before it stops and says the list may be incomplete


@dataclass(frozen=True)
class RequestState:
    """What Redis holds of one request id. `known` is False when none of its keys exists (never submitted to this
    queue, or its results expired); `ended` is how its result stream ended ("stop", "error: expired"...), if it
    has."""

    request_id: str
    known: bool
    ended: str | None = None


@dataclass(frozen=True)
class QueueSummary:
    """One queue found on the Redis: its partitions (as its keys show them), backlog, dead letters and live
    workers."""

    queue: str
    partitions: int
    depth: int
    dead: int
    live_workers: int


class Admin:
    """Operator reads and writes on one Redis, over their own small connection pool.

    :param url: a Redis URL of `client.connection`'s grammar (credentials never appear in messages).
    :param prefix: the deployment's key prefix.
    :param partitions: the queues' `LLMQ_QUEUE_PARTITIONS`, to find the partition of a request id.
    :param failover_timeout: seconds a call keeps retrying while Redis is away, as `Client`'s.
    :param redis: an existing blocking redis-py client to use instead of `url` (not closed by `close`).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        partitions: int = 1,
        failover_timeout: float = FAILOVER_TIMEOUT_S,
        redis: Any = None,
    ) -> None:
        Keys("default", prefix).partitioned(partitions)  # validates both before anything connects
        self._owns = redis is None
        self.redis: Any = open_sync(url, **pool_kwargs({}, Retry)) if redis is None else redis
        self.url = url if self._owns else None
        self.prefix = prefix
        self.partitions = partitions
        self.failover_timeout = failover_timeout

    def close(self) -> None:
        """Closes the connections it opened (use `contextlib.closing` for a `with`)."""
        if self._owns:
            self.redis.close()

    def call(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, retried across a failover; a failure that outlasts it is `RedisUnavailable` naming `what`."""
        return retry_sync(what, self.url, self.failover_timeout, call)

    def keys(self, queue: str, partition: int = 0) -> Keys:
        return Keys(queue, self.prefix, partition)

    def request_keys(self, queue: str, request_id: str) -> Keys:
        """The keys of the partition that holds `request_id`, as every client computes it."""
        return self.keys(queue, partition_of(request_id, self.partitions))

    def live_workers(self, queue: str, stale_after_s: float) -> list[WorkerInfo]:
        """The queue's workers whose last heartbeat is under `stale_after_s` old (one HGETALL: cheap enough to ask
        before every submit, unlike the full status, which samples the backlog)."""
        raw = self.call("a worker query", lambda: self.redis.hgetall(self.keys(queue).workers))
        return _live(raw.values(), stale_after_s)

    def request_state(self, queue: str, request_id: str) -> RequestState:
        """Whether `request_id` is known on `queue`: its idempotency marker (set by every submit, for the
        request's `result_ttl`), its fence (a worker started it) or its result stream exists; and, from the last
        event of that stream, whether it has ended."""
        if not is_valid_name(request_id):
            raise ValueError(f"request id {request_id!r} must be 1-128 characters of [A-Za-z0-9._:-]")
        keys = self.request_keys(queue, request_id)

        def read() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.exists(keys.submitted(request_id), keys.fence(request_id))
            pipe.xrevrange(keys.result(request_id), count=1)
            result: list[Any] = pipe.execute()
            return result

        marks, last = self.call("a request lookup", read)
        if not marks and not last:
            return RequestState(request_id, known=False)
        return RequestState(request_id, known=True, ended=_ending(last[0][1]) if last else None)

    def queues(
        self, *, stale_after_s: float, max_keys: int = MAX_SCANNED_KEYS
    ) -> tuple[list[QueueSummary], bool, list[str]]:
        """Every queue under this prefix, found by SCAN (never KEYS: a bounded walk that does not block Redis; on a
        Cluster, of every master), sorted by name; True as well when it stopped after `max_keys` matching keys, so
        the list may miss some; and why each queue left out was: one of its keys Redis would not read (a string
        where its lane stream belongs...), which hides that queue only, not every other."""
        found, truncated = self.call("a key scan", lambda: self._scan(max_keys))
        names = sorted(found)
        reads = [  # (queue, what, key) in the pipeline's order
            (name, what, key)
            for name in names
            for part in self.keys(name).partitioned(max(found[name]) + 1)
            for what, key in [
                *(("lane", stream) for stream in part.lanes.values()),
                *(("lane", part.held(lane)) for lane in part.lanes),  # held for fair share: waiting all the same
                ("dead", part.dead),
            ]
        ]
        reads += [(name, "workers", self.keys(name).workers) for name in names]

        def read() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for _, what, key in reads:
                if what == "workers":
                    pipe.hgetall(key)
                else:
                    pipe.xlen(key)
            result: list[Any] = pipe.execute(raise_on_error=False)  # a refused key's error comes back in its place
            return result

        replies: dict[str, list[tuple[str, str, Any]]] = {name: [] for name in names}
        answered = self.call("a queue summary", read) if names else []
        for (name, what, key), reply in zip(reads, answered, strict=True):
            replies[name].append((what, key, reply))
        summaries, skipped = [], []
        for name in names:
            refused = [(key, reply) for what, key, reply in replies[name] if isinstance(reply, Exception)]
            if refused:
                skipped.append(f"queue {name!r} left out: Redis would not read {refused[0][0]}: {refused[0][1]}")
                continue
            depth = sum(reply for what, _, reply in replies[name] if what == "lane")
            dead = sum(reply for what, _, reply in replies[name] if what == "dead")
            (heartbeats,) = (reply for what, _, reply in replies[name] if what == "workers")
            workers = _live(heartbeats.values(), stale_after_s)
            summaries.append(QueueSummary(name, max(found[name]) + 1, depth, dead, len(workers)))
        return summaries, truncated, skipped

    def _scan(self, max_keys: int) -> tuple[dict[str, set[int]], bool]:
        """Queue name -> the partitions whose keys were seen, from keys that only a queue's own traffic creates (its
        lanes, its workers' heartbeats, its dead letters), not the per-request ones, which outnumber them."""
        suffixes = _queue_suffixes(self.prefix)
        found: dict[str, set[int]] = {}
        keys = self.redis.scan_iter(match=_scan_pattern(self.prefix, suffixes), count=SCAN_COUNT)
        for seen, key in enumerate(keys, 1):
            if seen > max_keys:
                return found, True
            named = _queue_of(key, self.prefix, suffixes)
            if named is not None:
                found.setdefault(named[0], set()).add(named[1])
        return found, False


def _live(raw_infos: Any, stale_after_s: float) -> list[WorkerInfo]:
    oldest = ms_now() - int(stale_after_s * 1000)
    live = []
    for raw in raw_infos:
        try:
            info = decode_worker(raw)
        except MalformedEntry:
            continue
        if info.heartbeat >= oldest:
            live.append(info)
    return sorted(live, key=lambda info: info.id)


def _ending(fields: dict[bytes, bytes]) -> str | None:
    """How a result stream's last entry ended the request, or None if it is not terminal (or unreadable)."""
    try:
        event = decode_event(fields.get(ENTRY_FIELD, b""))
    except (MalformedEntry, UnsupportedVersion):
        return None
    if isinstance(event, DoneEvent):
        return str(event.finish_reason)
    if isinstance(event, ErrorEvent):
        return f"error: {event.code}"
    return None


def _queue_suffixes(prefix: str) -> frozenset[str]:
    """What follows `{<prefix>:<queue>}:` in the keys that say a queue exists, read off `Keys` itself."""
    keys = Keys("q", prefix)
    return frozenset(key.removeprefix(f"{keys.tag}:") for key in [*keys.lanes.values(), keys.workers, keys.dead])


def _scan_pattern(prefix: str, suffixes: frozenset[str]) -> str:
    """A SCAN MATCH pattern for those keys: the first three characters of the suffixes as character classes, so
    Redis leaves out the result streams (`result:`, `reply:`) instead of sending every request's key back. Names
    are `[A-Za-z0-9._:-]` only, so neither the prefix nor a class holds a glob character; `_queue_of` has the last
    word."""
    classes = "".join("[" + "".join(sorted({suffix[i] for suffix in suffixes})) + "]" for i in range(3))
    return f"{{{prefix}:*}}:{classes}*"


def _queue_of(key: bytes | str, prefix: str, suffixes: frozenset[str]) -> tuple[str, int] | None:
    """(queue, partition) of a key `{<prefix>:<queue>[#p]}:<suffix>`, or None for any other key."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    head = f"{{{prefix}:"
    tag, closed, suffix = text.removeprefix(head).partition("}:")
    if not text.startswith(head) or not closed or suffix not in suffixes:
        return None
    queue, _, partition = tag.partition("#")
    if not is_valid_name(queue) or (partition and not (partition.isascii() and partition.isdigit())):
        return None
    return queue, int(partition or 0)
