"""Sans-I/O core of the result multiplexer: one reader per client and queue follows every awaited job's result
stream over one connection, instead of one blocking XREAD (and one connection) per job.

The reader reads only the result streams that have news. Every request carries its client's id (`notify`),
and the worker's publish script appends, in the same atomic write as the events, the result keys it wrote to
to that client's wake stream (`Keys.wake`). So a round is: a blocking XREAD of the wake stream alone, then one
XREAD (chunked at `CHUNK_KEYS` keys, in one pipeline) of the streams it named, with the wake stream again.
Newly followed jobs are read at once (their events may predate the follow; following also appends to the
wake stream, which ends a blocking read). A sweep reads followed streams without a notice, one chunk per
`SWEEP_STEP_S`, for anything a notice did not cover: a worker of an older release, a job another client
submitted (its notices go to that client), a wake stream trimmed while the client lagged. Until a notice has
named a stream, the sweep reads it every `SWEEP_STEP_S` x chunks; once one has, every `QUIET_SWEEP_S`, unless a
sweep then finds entries no notice named, which puts it back on the fast sweep. So the sweep bounds the lag and
notices make it small: a client whose notices work reads when they say (a round per engine step) and once a
second besides, where it swept all its streams every 50 ms before (a client awaiting 32 busy jobs on a 2-core
machine: 3.0 % of a core before, 2.3-2.4 % after). The price: an entry whose notice was lost waits up to about
`QUIET_SWEEP_S` for the sweep, where it waited up to `SWEEP_STEP_S` x chunks.

`AsyncResultMux` (client/aio.py) and `ResultMux` (client/sync.py) perform the calls; this class decides what
to read and routes what was read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError
from redis.typing import KeyT, StreamIdT

from client.backoff import jittered
from client.errors import MalformedEntry
from client.store import WAKE_MAXLEN, WAKE_NOTICE, WAKE_TTL_S, Keys

log = logging.getLogger("llmq.client")

CHUNK_KEYS = 256  # result streams per XREAD
ENTRIES_PER_STREAM = 512  # COUNT: a backlog is read in a few calls, never unbounded
BLOCK_S = 2.0  # per blocking XREAD; stays under redis-py's default 5 s socket timeout
# One sweep chunk per step. A Redis at the default `hz 10` ends the blocking read between two steps on its 100 ms
# tick: about every 100 ms there.
SWEEP_STEP_S = 0.05
QUIET_SWEEP_S = 1.0  # how often streams that notices cover are swept too (a lost notice: trimmed, refused, failover)
RECONNECT_BUDGET_S = 30.0  # how long the reader keeps retrying a lost connection
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
WAKE_DELAY_S = 0.005  # a wake waits this long, so the jobs followed meanwhile share it (a burst of submits)


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as (ms, seq), which orders ids correctly (bytes do not: b"9-0" > b"10-0")."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _streams(reply: Any) -> Iterable[tuple[Any, list[tuple[Any, Any]]]]:
    """(key, entries) of an XREAD reply, in RESP2 or RESP3 shape."""
    return reply.items() if isinstance(reply, Mapping) else (reply or ())


def _text(key: bytes | str) -> str:
    return key.decode() if isinstance(key, bytes) else key


@dataclass(eq=False)
class Follower:
    """One reader of one result stream: the entries after `last_id` go to `inbox` (owned by the twin)."""

    key: str
    last_id: tuple[int, int]
    inbox: Any


@dataclass(frozen=True)
class Round:
    """One read: a blocking XREAD of the wake stream alone (`block_ms` set), or non-blocking XREADs of
    `chunks` in one pipeline."""

    chunks: list[dict[KeyT, StreamIdT]]
    block_ms: int | None = None


@dataclass
class MuxCore:
    keys: Keys
    client_id: str
    max_block_ms: int = int(BLOCK_S * 1000)
    _followers: dict[str, list[Follower]] = field(default_factory=dict)
    _due: dict[str, None] = field(default_factory=dict)  # keys to read in the next round (an ordered set)
    _sweep: list[str] = field(default_factory=list)  # keys of the current sweep not read yet
    _reading: dict[str, tuple[int, int]] = field(default_factory=dict)  # the planned round's start id per stream
    _noticed: set[str] = field(default_factory=set)  # followed keys a notice has named: swept every QUIET_SWEEP_S
    _swept: set[str] = field(default_factory=set)  # keys the planned round reads for the sweep alone
    _named: set[str] = field(default_factory=set)  # keys the planned round's notices named
    _last_sweep: float = -SWEEP_STEP_S  # so that the first plan sweeps at once,
    _next_quiet_sweep: float = 0.0  # and sweeps every stream
    _wake_id: tuple[int, int] = (0, 0)
    _failing_since: float | None = None
    _failures: int = 0

    @property
    def wake_key(self) -> str:
        return self.keys.wake(self.client_id)

    @property
    def idle(self) -> bool:
        return not self._followers

    @property
    def following(self) -> int:
        return len(self._followers)

    def follow(self, key: str, last_id: bytes | str, inbox: Any) -> Follower:
        follower = Follower(key, parse_id(last_id), inbox)
        self._followers.setdefault(key, []).append(follower)
        self._due[key] = None
        return follower

    def unfollow(self, follower: Follower) -> None:
        followers = self._followers.get(follower.key, [])
        if follower in followers:
            followers.remove(follower)
        if not followers:
            self._followers.pop(follower.key, None)
            self._noticed.discard(follower.key)

    def plan(self, now: float) -> Round:
        """The next round: the streams with news (or newly followed) and, when due, the next sweep chunk."""
        due = [key for key in self._due if key in self._followers]
        self._due.clear()
        self._swept, self._named = set(), set()
        if now >= self._next_sweep():
            if not self._sweep:
                everything = now >= self._next_quiet_sweep
                if everything:
                    self._next_quiet_sweep = now + QUIET_SWEEP_S
                self._sweep = [key for key in self._followers if everything or key not in self._noticed]
            self._swept = set(self._sweep[:CHUNK_KEYS]).difference(due)
            due += self._sweep[:CHUNK_KEYS]
            del self._sweep[:CHUNK_KEYS]
            self._last_sweep = now
        pending = {key: min(f.last_id for f in self._followers[key]) for key in due if key in self._followers}
        self._reading = pending
        if not pending:
            block_ms = min(self.max_block_ms, round((self._next_sweep() - now) * 1000))
            return Round([self._wake_read()], block_ms=max(1, block_ms))
        items = list(pending.items())
        chunks: list[dict[KeyT, StreamIdT]] = [
            {key: f"{ms}-{seq}" for key, (ms, seq) in items[start : start + CHUNK_KEYS]}
            for start in range(0, len(items), CHUNK_KEYS)
        ]
        chunks[0] = {**self._wake_read(), **chunks[0]}
        return Round(chunks)

    def _next_sweep(self) -> float:
        """When the sweep reads its next chunk: a step after the last one while a sweep is under way or a stream
        waits for its first notice, else at the quiet sweep."""
        if self._sweep or len(self._noticed) < len(self._followers):
            return self._last_sweep + SWEEP_STEP_S
        return self._next_quiet_sweep

    def wake_commands(self, pipe: Any) -> None:
        """Queue on a pipeline the append that ends the reader's blocking read (trimmed, and expiring)."""
        pipe.xadd(self.wake_key, {b"w": b"1"}, maxlen=WAKE_MAXLEN, approximate=True)
        pipe.expire(self.wake_key, WAKE_TTL_S)

    def _wake_read(self) -> dict[KeyT, StreamIdT]:
        ms, seq = self._wake_id
        return {self.wake_key: f"{ms}-{seq}"}

    def route(self, reply: Any) -> list[tuple[Follower, bytes, dict[bytes, bytes]]]:
        """Entries of one XREAD reply for each follower past its `last_id`; the wake stream's notices make
        the streams they name due. A stream that filled its COUNT is due again: it may hold more. A stream the sweep
        alone read, with entries no notice named, goes back on the fast sweep."""
        self._failing_since = None
        routed: list[tuple[Follower, bytes, dict[bytes, bytes]]] = []
        streams = [(_text(key), entries) for key, entries in _streams(reply)]
        for name, entries in streams:  # notices first (Redis answers in key order, the wake key first; not relied on)
            if name == self.wake_key:
                self._note(entries)
        for name, entries in streams:
            if name == self.wake_key:
                continue
            if len(entries) >= ENTRIES_PER_STREAM:
                self._due[name] = None
            start = self._reading.get(name, (0, 0))
            before = len(routed)
            for follower in self._followers.get(name, ()):
                if follower.last_id < start:  # followed while this read was in flight, from an earlier entry
                    self._due[name] = None  # the next round reads from its own last id: no gap
                    continue
                for entry_id, fields in entries:
                    parsed = parse_id(entry_id)
                    if parsed > follower.last_id:
                        follower.last_id = parsed
                        routed.append((follower, entry_id, fields))
            if len(routed) > before and name in self._swept and name not in self._named:
                self._noticed.discard(name)  # the sweep found what no notice named: back on the fast sweep
        return routed

    def _note(self, entries: list[tuple[Any, dict[bytes, bytes]]]) -> None:
        for entry_id, fields in entries:
            self._wake_id = max(self._wake_id, parse_id(entry_id))
            for key in fields.get(WAKE_NOTICE, b"").split():
                name = key.decode()
                if name in self._followers:
                    self._due[name] = None
                    self._named.add(name)
                    self._noticed.add(name)

    def followers(self) -> list[Follower]:
        return [f for followers in self._followers.values() for f in followers]

    def followed_keys(self) -> list[str]:
        return list(self._followers)

    def drop_wrong_types(self, types: Mapping[str, Any]) -> list[tuple[Follower, MalformedEntry]]:
        """After a `WRONGTYPE` reply: the followers of the keys that `TYPE` says hold something other than a stream
        (something other than llmq wrote them), no longer followed, each with the error its reader raises. The
        failed round's other streams are read again."""
        failed = []
        for key, kind in types.items():
            name = _text(kind)
            if name in ("stream", "none"):
                continue
            error = MalformedEntry(f"result key {key} holds a {name}, not a stream: something other than llmq wrote it")
            failed += [(follower, error) for follower in self._followers.pop(key, [])]
            self._noticed.discard(key)
        self._due.update(dict.fromkeys(key for key in self._reading if key in self._followers))
        return failed

    def retry_delay(self, exc: Exception) -> float | None:
        """Seconds to wait before reading again after a connection error; None once the budget is spent. The
        failed round's streams are lost with it: every stream is read again."""
        self._due.update(dict.fromkeys(self._followers))
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since, self._failures = now, 0
        if now - self._failing_since > RECONNECT_BUDGET_S:
            return None
        delay = jittered(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**self._failures))
        self._failures += 1
        log.warning("reading results of %d jobs failed (%s); retrying in %.2f s", self.following, exc, delay)
        return delay


def is_wrong_type(error: BaseException) -> bool:
    """A key read as a stream holds another type: no retry heals it, the key's followers fail instead."""
    return isinstance(error, ResponseError) and "WRONGTYPE" in str(error)  # a pipeline's names its command first


def max_block_ms(socket_timeout: float | None) -> int:
    """The longest blocking read: `BLOCK_S`, or half the socket timeout, which would cut it off."""
    block = BLOCK_S if socket_timeout is None else min(BLOCK_S, socket_timeout / 2)
    return max(1, int(block * 1000))
