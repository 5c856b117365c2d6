"""Result streams: every event a request produces, written in order, batched into one pipeline per flush.

Events are queued without blocking; the flusher sends everything queued so far for a partition in one script
call, so all requests that advanced in an engine step share one round trip per partition. The partitions' calls
run side by side and independently: a partition whose shard is down holds back its own events only. For each
event the script is:

- **fenced**: written only while the request's attempt number is ours. A worker that was paused past its
  lease and woke up after another claimed the request writes nothing (and is told, through `on_fenced`);
- **idempotent**: the fence hash counts the tokens written, so an event retried after a lost reply is
  not written twice;
- **acknowledging**: a request's final event is followed, in the same script, by XACK + XDEL, so the
  request stream holds only unfinished work;
- **isolated**: an event whose keys Redis refuses fails alone; the request's other queued events are dropped
  and the worker is told (`on_failed`), while every other request's events are written.

When Redis (or a partition's shard) is unreachable its events stay queued, in order, and are retried with
backoff; the worker reads no new requests while `backlog` is over its bound.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis

from client.backoff import Backoff
from client.failover import REDIS_FAILURES
from client.protocol import Completion, DoneEvent, ErrorEvent, Lane, PromptEvent, TokensEvent, encode
from client.scripts import PublishItem, PublishOutcome, Scripts, pack_usage
from client.store import Keys

# Anything Redis says goes back in the queue: an outage, a restart still loading, and also an answer like
# OOM under `noeviction` or READONLY after a failover, which clear once an operator acts.
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
    partition: int = 0  # the queue partition it was read from, whose keys its events go to
    tenant: str | None = None  # who owns it: its final event adds its usage to that tenant's counts
    cost: int = 0  # its estimated tokens (`COST_FIELD`; 0: none), of which its final event refunds what it did not use


@dataclass(slots=True)
class _Pending:
    target: Target
    event: bytes
    seq: int
    size: int
    final: bool = False  # acknowledges `target.entry_id` after the event
    completion: bytes = b""  # for `target.reply_to`, appended with the event
    on_written: Callable[[PublishOutcome | str], None] | None = None  # told the script's answer for this event
    usage: bytes = b""  # a final event's usage for `target.tenant` (`pack_usage`)


MAX_TENANT_LABELS = 100  # distinct `tenant` label values per worker: a bound on the metrics' series
OTHER_TENANTS = "(other)"  # the label of every tenant past that bound: no tenant's name (no parentheses in names)


@dataclass
class PublisherStats:
    flushes: int = 0
    events: int = 0
    failures: int = 0
    fenced: int = 0
    behind: int = 0  # requests whose stream lost its last events (a failover): handed back to resume from it
    refused: int = 0  # requests whose events Redis refused (`on_failed`)
    tokens: int = 0  # token ids queued for publishing: what this worker generated
    # Per tenant (at most `MAX_TENANT_LABELS`, the rest as `OTHER_TENANTS`): final events sent, by outcome, and
    # their prompt and generated tokens, for the `tenant`-labelled metrics. `llmq usage` is the exact record.
    tenant_requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    tenant_tokens: Counter[tuple[str, str]] = field(default_factory=Counter)  # (tenant, "prompt" or "generated")

    def count_usage(self, tenant: str, outcome: str, prompt: int, generated: int) -> None:
        known = {name for name, _ in self.tenant_requests}
        if tenant not in known and len(known) >= MAX_TENANT_LABELS:
            tenant = OTHER_TENANTS
        self.tenant_requests[tenant, outcome] += 1
        self.tenant_tokens[tenant, "prompt"] += prompt
        self.tenant_tokens[tenant, "generated"] += generated


class Publisher:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        partitions: int = 1,
        on_error: Callable[[Exception], None] | None = None,
        on_fenced: Callable[[str, int], None] | None = None,
        on_failed: Callable[[Target, str], None] | None = None,
        on_behind: Callable[[Target], None] | None = None,
        scripts: Scripts | None = None,
        reply_maxlen: int = 100_000,
        wait_replicas: int = 0,
        usage_ttl_s: int = 35 * 86400,
    ) -> None:
        self._redis = redis
        self._usage_ttl_s = usage_ttl_s
        self._wait_replicas = wait_replicas
        self._partitions = keys.partitioned(partitions)  # each request's events go to its partition's keys
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
        self._on_behind = on_behind
        self._backoff: dict[int, Backoff] = {}  # partition -> its retries' delays, while its calls fail
        self._retry_at: dict[int, float] = {}  # partition -> loop time before which its events wait
        self._flights: dict[int, asyncio.Task[None]] = {}  # partition -> its script call in flight
        self._crashed: Exception | None = None  # a flight's failure that is not Redis's: `run` raises it
        self.stats = PublisherStats()

    @property
    def backlog(self) -> int:
        """Events queued and not yet written (grows while Redis is down)."""
        return len(self._queue)

    def tokens(self, target: Target, event: TokensEvent) -> None:
        self.stats.tokens += len(event.ids)
        self._put(_Pending(target, encode(event), event.seq, len(event.ids)))

    def prompt(self, target: Target, event: PromptEvent, seq: int = 0) -> None:
        """The prompt's scores, before the request's first token (`seq` tokens were written before: 0 unless a
        caller resumes one, which the engine does not score again). It counts no token, so a write retried after
        a lost reply may write it twice, as may an attempt restarted before its first token: readers keep the
        first."""
        self._put(_Pending(target, encode(event), seq, 0))

    def finish(
        self,
        target: Target,
        event: DoneEvent | ErrorEvent | None,
        seq: int = 0,
        output: tuple[str, list[int]] = ("", []),
        on_written: Callable[[PublishOutcome | str], None] | None = None,
    ) -> None:
        """The request's terminal event (after `seq` tokens), then its acknowledgement; no event: only the ack.
        With `target.reply_to`, the whole `output` (text, token ids) goes to that stream in the same write.
        `on_written` hears the script's answer for it once a flush has carried it (not if it is dropped unsent:
        its request refused or behind, or the worker stopping first)."""
        completion = b""
        if target.reply_to is not None and event is not None:
            text, ids = output
            done, error = (event, None) if isinstance(event, DoneEvent) else (None, event)
            completion = encode(Completion(id=target.request_id, text=text, ids=ids, done=done, error=error))
        raw = b"" if event is None else encode(event)
        usage = b""
        if target.tenant is not None and event is not None:
            outcome, prompt, generated, waited, generating = usage_of(event, seq)
            usage = pack_usage(
                self._usage_ttl_s, target.tenant, outcome, target.cost, prompt, generated, waited, generating
            )
            self.stats.count_usage(target.tenant, outcome, prompt, generated)
        self._put(_Pending(target, raw, seq, 1, final=True, completion=completion, on_written=on_written, usage=usage))

    def _put(self, pending: _Pending) -> None:
        self._queue.append(pending)
        self._idle.clear()
        self._wakeup.set()

    def stop(self) -> None:
        """Ends `run` once the calls in flight finish (the worker has already waited for what it could write)."""
        self._stopping = True
        self._wakeup.set()

    async def wait_idle(self) -> None:
        """Until everything queued so far is written."""
        await self._idle.wait()

    async def run(self) -> None:
        """The flusher, until `stop`: per partition, one script call at a time carrying that partition's queued
        events in order. Calls of different partitions do not wait for each other: a partition whose call hangs
        (its shard down, the connect timing out) or fails (retried with its own backoff) holds back its own
        events only, while the others' are written as they come. After `stop`, the calls in flight finish."""
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                await self._wakeup.wait()
                self._wakeup.clear()
                if self._crashed is not None:
                    raise self._crashed
                if self._stopping:
                    break
                await asyncio.sleep(0)  # let the rest of this engine step's deltas land in the batch
                for partition, batch in self._batches(loop.time()).items():
                    self._flights[partition] = asyncio.create_task(self._flush(partition, batch))
                if not self._queue and not self._flights:
                    self._idle.set()
        except BaseException:
            for flight in self._flights.values():
                flight.cancel()
            raise
        if self._flights:
            await asyncio.wait(list(self._flights.values()))

    def _batches(self, now: float) -> dict[int, list[_Pending]]:
        """The queued events, in order, of each partition with no call in flight and no retry pending (events
        queued while a partition's call is in flight go in its next one)."""
        batches: dict[int, list[_Pending]] = {}
        for item in self._queue:
            partition = item.target.partition
            if partition not in self._flights and self._retry_at.get(partition, 0.0) <= now:
                batches.setdefault(partition, []).append(item)
        return batches

    async def _flush(self, partition: int, batch: list[_Pending]) -> None:
        """One partition's call: its events leave the queue once written; on a Redis failure they stay, and the
        partition waits out its backoff."""
        loop = asyncio.get_running_loop()
        try:
            try:
                written = await self._send_to(self._partitions[partition], batch)
            except REDIS_FAILURES as error:
                self.stats.failures += 1
                if self._on_error is not None:
                    self._on_error(error)
                delay = self._backoff.setdefault(partition, Backoff(*_BACKOFF_S)).next()
                self._retry_at[partition] = loop.time() + delay
                loop.call_later(delay, self._wakeup.set)  # its events are still queued, in order: retried then
                return
            gone = {id(item) for item in batch}
            self._queue = [item for item in self._queue if id(item) not in gone]
            self._backoff.pop(partition, None)
            self._retry_at.pop(partition, None)
            self._report(batch, written)
        except Exception as error:  # not Redis's answer (the call, or a callback told of it): a bug `run` raises
            self._crashed = error
        finally:
            del self._flights[partition]
            self._wakeup.set()

    async def _send_to(self, where: Keys, batch: list[_Pending]) -> list[PublishOutcome | str]:
        items = [_item(pending) for pending in batch]
        # A terminal event is the write a failover must not lose: that batch waits for the replicas (and is written
        # again, which skips what is there, until they acknowledge it).
        replicas = self._wait_replicas if any(item.final for item in batch) else 0
        return await self._scripts.publish.run(self._redis, where, items, self._reply_maxlen, replicas)

    def _report(self, batch: list[_Pending], written: list[PublishOutcome | str]) -> None:
        self.stats.flushes += 1
        self.stats.events += len(batch)
        fenced, failed, behind = _outcomes(batch, written)
        self.stats.fenced += len(fenced)
        if self._on_fenced is not None:
            for request_id, attempt in fenced:
                self._on_fenced(request_id, attempt or 0)
        if failed or behind:  # their queued events would meet the same answer
            self._queue = [item for item in self._queue if item.target not in failed and item.target not in behind]
        self.stats.refused += len(failed)
        self.stats.behind += len(behind)
        for target, message in failed.items():
            if self._on_failed is not None:
                self._on_failed(target, message)
        for target in behind:
            if self._on_behind is not None:
                self._on_behind(target)
        for item, outcome in zip(batch, written, strict=True):
            if item.on_written is not None:
                item.on_written(outcome)


def _outcomes(
    batch: list[_Pending], written: list[PublishOutcome | str]
) -> tuple[set[tuple[str, int | None]], dict[Target, str], set[Target]]:
    """PUBLISH's answers sorted: the (request, attempt) pairs fenced out, the targets whose keys Redis refused (with
    its message), and those whose stream is behind."""
    fenced: set[tuple[str, int | None]] = set()
    failed: dict[Target, str] = {}
    behind: set[Target] = set()
    for item, outcome in zip(batch, written, strict=True):
        if isinstance(outcome, str):
            failed.setdefault(item.target, outcome)
        elif outcome == PublishOutcome.BEHIND:
            behind.add(item.target)
        elif outcome == PublishOutcome.FENCED:
            fenced.add((item.target.request_id, item.target.attempt))
    return fenced, failed, behind


def _item(pending: _Pending) -> PublishItem:
    ack = pending.target.entry_id if pending.final else b""
    return PublishItem(pending.target, pending.event, pending.seq, pending.size, ack, pending.completion, pending.usage)


def usage_of(event: DoneEvent | ErrorEvent, seq: int) -> tuple[str, int, int, int, int]:
    """A final event's outcome, prompt and generated tokens, queue wait and generation ms, for its tenant's usage:
    a `done` event's own counts and timings; an `error` counts the `seq` tokens published before it."""
    if isinstance(event, DoneEvent):
        queued, total = event.timings.queue_ms or 0.0, event.timings.total_ms or 0.0
        usage = event.usage
        return event.finish_reason, usage.prompt_tokens, usage.completion_tokens, round(queued), round(total - queued)
    return f"error:{event.code}", 0, seq, 0, 0
