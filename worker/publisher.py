"""Result streams: every event a request produces, written in order, batched into one pipeline per flush.

Events are queued without blocking; one flusher task sends everything queued so far in one script call,
so all requests that advanced in an engine step share one round trip. For each event the script is:

- **fenced**: written only while the request's attempt number is ours. A worker that was paused past its
  lease and woke up after another claimed the request writes nothing (and is told, through `on_fenced`);
- **idempotent**: the fence hash counts the tokens written, so an event retried after a lost reply is
  not written twice;
- **acknowledging**: a request's final event is followed, in the same script, by XACK + XDEL, so the
  request stream holds only unfinished work;
- **isolated**: an event whose keys Redis refuses fails alone; the request's other queued events are dropped
  and the worker is told (`on_failed`), while every other request's events are written.

When Redis is unreachable the batch stays queued, in order, and is retried with backoff; the worker reads
no new requests while `backlog` is over its bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from client.protocol import Completion, DoneEvent, ErrorEvent, Lane, TokensEvent, encode
from client.store import CONSUMER_GROUP, WAKE_MAXLEN, WAKE_TTL_S, Keys, Scripts

# Anything Redis says goes back in the queue: an outage, a restart still loading, and also an answer like
# OOM under `noeviction` or READONLY after a failover, which clear once an operator acts.
_RETRYABLE = (RedisError, OSError)
_BACKOFF_S = (0.05, 2.0)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request's events go, the attempt that may write them (None: unfenced, for rejections), and the
    request stream entry that its final event acknowledges."""

    request_id: str
    ttl_s: int
    attempt: int | None = None
    entry_id: bytes = b""
    reply_to: str | None = None  # also append the final result to this `reply_to` stream
    notify: str | None = None  # the client id whose wake stream is told of every write
    lane: Lane = "default"  # whose request stream `entry_id` is in


@dataclass(slots=True)
class _Pending:
    target: Target
    event: bytes
    seq: int
    size: int
    final: bool = False  # acknowledges `target.entry_id` after the event
    completion: bytes = b""  # for `target.reply_to`, appended with the event


@dataclass
class PublisherStats:
    flushes: int = 0
    events: int = 0
    failures: int = 0
    fenced: int = 0
    refused: int = 0  # requests whose events Redis refused (`on_failed`)
    tokens: int = 0  # token ids queued for publishing: what this worker generated


class Publisher:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        on_error: Callable[[Exception], None] | None = None,
        on_fenced: Callable[[str, int], None] | None = None,
        on_failed: Callable[[Target, str], None] | None = None,
        scripts: Scripts | None = None,
        reply_maxlen: int = 100_000,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._reply_maxlen = reply_maxlen
        self._scripts = scripts or Scripts.register(redis)
        self._queue: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self._on_error = on_error
        self._on_fenced = on_fenced
        self._on_failed = on_failed
        self.stats = PublisherStats()

    @property
    def backlog(self) -> int:
        """Events queued and not yet written (grows while Redis is down)."""
        return len(self._queue)

    def tokens(self, target: Target, event: TokensEvent) -> None:
        self.stats.tokens += len(event.ids)
        self._put(_Pending(target, encode(event), event.seq, len(event.ids)))

    def finish(
        self,
        target: Target,
        event: DoneEvent | ErrorEvent | None,
        seq: int = 0,
        output: tuple[str, list[int]] = ("", []),
    ) -> None:
        """The request's terminal event (after `seq` tokens), then its acknowledgement; no event: only the ack.
        With `target.reply_to`, the whole `output` (text, token ids) goes to that stream in the same write."""
        completion = b""
        if target.reply_to is not None and event is not None:
            text, ids = output
            done, error = (event, None) if isinstance(event, DoneEvent) else (None, event)
            completion = encode(Completion(id=target.request_id, text=text, ids=ids, done=done, error=error))
        self._put(_Pending(target, b"" if event is None else encode(event), seq, 1, final=True, completion=completion))

    def _put(self, pending: _Pending) -> None:
        self._queue.append(pending)
        self._idle.clear()
        self._wakeup.set()

    def stop(self) -> None:
        """Ends `run` after the batch in flight (the worker has already waited for what it could write)."""
        self._stopping = True
        self._wakeup.set()

    async def wait_idle(self) -> None:
        """Until everything queued so far is written."""
        await self._idle.wait()

    async def run(self) -> None:
        """The flusher: one script call per batch of queued events, in order, until `stop`."""
        backoff = _BACKOFF_S[0]
        while not self._stopping:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self._stopping:
                return
            await asyncio.sleep(0)  # let the rest of this engine step's deltas land in the batch
            batch = list(self._queue)  # events queued while this batch is in flight go in the next one
            if not batch:
                self._idle.set()
                continue
            try:
                written = await self._send(batch)
            except _RETRYABLE as error:
                self.stats.failures += 1
                if self._on_error is not None:
                    self._on_error(error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_S[1])
                self._wakeup.set()  # the batch is still at the head of the queue: retry it
                continue
            backoff = _BACKOFF_S[0]
            del self._queue[: len(batch)]
            self._report(batch, written)
            if self._queue:
                self._wakeup.set()
            else:
                self._idle.set()

    async def _send(self, batch: list[_Pending]) -> list[int | bytes]:
        keys: list[str] = []
        args: list[Any] = [CONSUMER_GROUP, self._reply_maxlen, WAKE_MAXLEN, WAKE_TTL_S]
        for item in batch:
            target = item.target
            result = self._keys.result(target.request_id)
            reply = self._keys.reply(target.reply_to) if target.reply_to is not None else result
            wake = self._keys.wake(target.notify) if target.notify is not None else result
            keys += [self._keys.lane(target.lane), result, self._keys.fence(target.request_id), reply, wake]
            attempt = "" if target.attempt is None else target.attempt
            ack = target.entry_id if item.final else b""
            args += [attempt, target.ttl_s, item.event, item.seq, item.size, ack, item.completion]
        return await self._scripts.publish(keys=keys, args=args)

    def _report(self, batch: list[_Pending], written: list[int | bytes]) -> None:
        self.stats.flushes += 1
        self.stats.events += len(batch)
        fenced: set[tuple[str, int | None]] = set()
        failed: dict[Target, str] = {}
        for item, outcome in zip(batch, written, strict=True):
            if isinstance(outcome, bytes):
                failed.setdefault(item.target, outcome.decode(errors="replace"))
            elif not outcome:
                fenced.add((item.target.request_id, item.target.attempt))
        self.stats.fenced += len(fenced)
        if self._on_fenced is not None:
            for request_id, attempt in fenced:
                self._on_fenced(request_id, attempt or 0)
        if failed:
            self.stats.refused += len(failed)
            self._queue = [item for item in self._queue if item.target not in failed]  # they would fail alike
            for target, message in failed.items():
                if self._on_failed is not None:
                    self._on_failed(target, message)
