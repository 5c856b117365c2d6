"""Sans-I/O core of the result multiplexer: one reader per client and queue follows every awaited job's result
stream over one connection, instead of one blocking XREAD (and one connection) per job.

Each read is `XREAD COUNT c [BLOCK b] STREAMS k1 .. kn id1 .. idn` over at most `CHUNK_KEYS` keys; more keys
are read in several chunks in one pipeline. The client's private wake stream (`Keys.wake`) is read with the
first chunk: following a new job while the reader blocks appends to it, so the new job is read at once
instead of after the BLOCK. `AsyncResultMux` (client/aio.py) and `ResultMux` (client/sync.py) perform the
calls; this class decides what to read and routes what was read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.typing import KeyT, StreamIdT

from client.store import Keys

log = logging.getLogger("llmq.client")

CHUNK_KEYS = 256  # result streams per XREAD
ENTRIES_PER_STREAM = 512  # COUNT: a backlog is read in a few calls, never unbounded
BLOCK_S = 2.0  # per blocking XREAD; stays under redis-py's default 5 s socket timeout
IDLE_WAIT_S = 0.01  # with several chunks nothing can block on all of them: wait on the wake stream this long
RECONNECT_BUDGET_S = 30.0  # how long the reader keeps retrying a lost connection
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
WAKE_DELAY_S = 0.005  # a wake waits this long, so the jobs followed meanwhile share it (a burst of submits)
WAKE_MAXLEN = 16
WAKE_TTL_S = 600


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


@dataclass
class MuxCore:
    keys: Keys
    client_id: str
    _followers: dict[str, list[Follower]] = field(default_factory=dict)
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
        return follower

    def unfollow(self, follower: Follower) -> None:
        followers = self._followers.get(follower.key, [])
        if follower in followers:
            followers.remove(follower)
        if not followers:
            self._followers.pop(follower.key, None)

    def reads(self) -> list[dict[KeyT, StreamIdT]]:
        """The XREAD stream maps of the next round, chunked; the wake stream rides with the first chunk."""
        pending = [(key, min(f.last_id for f in followers)) for key, followers in self._followers.items()]
        chunks: list[dict[KeyT, StreamIdT]] = []
        for start in range(0, len(pending), CHUNK_KEYS):
            chunks.append({key: f"{ms}-{seq}" for key, (ms, seq) in pending[start : start + CHUNK_KEYS]})
        if not chunks:
            chunks.append({})
        ms, seq = self._wake_id
        chunks[0] = {self.wake_key: f"{ms}-{seq}", **chunks[0]}
        return chunks

    def wake_commands(self, pipe: Any) -> None:
        """Queue on a pipeline the append that ends the reader's blocking read (trimmed, and expiring)."""
        pipe.xadd(self.wake_key, {b"w": b"1"}, maxlen=WAKE_MAXLEN, approximate=False)
        pipe.expire(self.wake_key, WAKE_TTL_S)

    def wake_read(self) -> dict[KeyT, StreamIdT]:
        """The wake stream alone: what the reader blocks on briefly when several chunks found nothing."""
        ms, seq = self._wake_id
        return {self.wake_key: f"{ms}-{seq}"}

    def route(self, reply: Any) -> list[tuple[Follower, bytes, dict[bytes, bytes]]]:
        """Entries of one XREAD reply for each follower past its `last_id`; the wake stream is only noted."""
        self._failing_since = None
        routed = []
        for key, entries in _streams(reply):
            name = _text(key)
            if name == self.wake_key:
                self._wake_id = max(self._wake_id, *(parse_id(entry_id) for entry_id, _ in entries))
                continue
            for follower in self._followers.get(name, ()):
                for entry_id, fields in entries:
                    parsed = parse_id(entry_id)
                    if parsed > follower.last_id:
                        follower.last_id = parsed
                        routed.append((follower, entry_id, fields))
        return routed

    def followers(self) -> list[Follower]:
        return [f for followers in self._followers.values() for f in followers]

    def block_ms(self, socket_timeout: float | None) -> int:
        block = BLOCK_S if socket_timeout is None else min(BLOCK_S, socket_timeout / 2)
        return max(1, int(block * 1000))

    def retry_delay(self, exc: Exception) -> float | None:
        """Seconds to wait before reading again after a connection error; None once the budget is spent."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since, self._failures = now, 0
        if now - self._failing_since > RECONNECT_BUDGET_S:
            return None
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**self._failures)
        self._failures += 1
        log.warning("reading results of %d jobs failed (%s); retrying in %.2f s", self.following, exc, delay)
        return delay
