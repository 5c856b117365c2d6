"""Result streams: every event a request produces, written in order, batched into one pipeline per flush.

Events are queued without blocking (`tokens`, `finish`, `fail`); one flusher task sends everything queued
so far in a single pipeline, so all requests that advanced in an engine step share one round trip. A
request's final event is followed, in the same pipeline, by the acknowledgement: XACK + XDEL run as one
script, so the request stream holds only unfinished work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis

from client.protocol import CONSUMER_GROUP, ENTRY_FIELD, DoneEvent, ErrorEvent, Keys, TokensEvent, encode

# XACK and XDEL together, so no reader ever sees an acknowledged entry still counted as backlog.
_ACK_AND_DELETE = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return redis.call('XDEL', KEYS[1], ARGV[2])
"""


@dataclass(slots=True)
class _Pending:
    result_key: str
    ttl_s: int
    event: bytes
    ack_entry: bytes | None = None  # set on a request's last event


@dataclass
class PublisherStats:
    flushes: int = 0
    events: int = 0
    failures: int = 0
    last_error: str | None = field(default=None)


class Publisher:
    def __init__(self, redis: Redis, keys: Keys, on_error: Callable[[Exception], None] | None = None) -> None:
        self._redis = redis
        self._keys = keys
        self._ack_and_delete = redis.register_script(_ACK_AND_DELETE)
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_error = on_error
        self.stats = PublisherStats()

    def tokens(self, request_id: str, ttl_s: int, event: TokensEvent) -> None:
        self._put(_Pending(self._keys.result(request_id), ttl_s, encode(event)))

    def finish(self, request_id: str, ttl_s: int, event: DoneEvent | ErrorEvent, entry_id: bytes) -> None:
        """The request's terminal event, then its acknowledgement."""
        self._put(_Pending(self._keys.result(request_id), ttl_s, encode(event), ack_entry=entry_id))

    def _put(self, pending: _Pending) -> None:
        self._queue.append(pending)
        self._idle.clear()
        self._wakeup.set()

    async def wait_idle(self) -> None:
        """Until everything queued so far is written."""
        await self._idle.wait()

    async def run(self) -> None:
        """The flusher: one pipeline per batch of queued events, in order, until cancelled."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(0)  # let the rest of this engine step's deltas land in the batch
            batch, self._queue = self._queue, []
            if batch:
                await self._send(batch)
            if not self._queue:
                self._idle.set()

    async def _send(self, batch: list[_Pending]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for pending in batch:
                pipe.xadd(pending.result_key, {ENTRY_FIELD: pending.event})
                pipe.expire(pending.result_key, pending.ttl_s)
                if pending.ack_entry is not None:
                    await self._ack_and_delete(
                        keys=[self._keys.requests], args=[CONSUMER_GROUP, pending.ack_entry], client=pipe
                    )
            try:
                await pipe.execute()
            except Exception as error:  # the next issue adds buffering across outages; count and report for now
                self.stats.failures += 1
                self.stats.last_error = str(error)
                if self._on_error is not None:
                    self._on_error(error)
                return
        self.stats.flushes += 1
        self.stats.events += len(batch)
