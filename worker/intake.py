"""Reading requests: the consumer group, COUNT = free engine slots, and what becomes of each entry.

Admission is two pure decisions around one round trip, each with a unit test per branch:
- `decide` (the entry as read): `Accepted`, an `Answer` (an `error` event to its reader, which acknowledges it)
  or a `Letter` (unreadable: no request id to answer to);
- `admit` (an accepted request, once `Intake.prepare` read what Redis knows of it: its `Ready`): `Start`, an
  `Answer` (earlier attempts produced everything) or a `Letter` that answers too (quarantined, or over the
  delivery limit).
`Intake.admissions` runs the three steps for a batch; the worker only executes what comes out: start, answer or
dead-letter.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.typing import KeyT, StreamIdT

from client.errors import InvalidRequest, MalformedEntry, UnsupportedVersion
from client.protocol import (
    COST_FIELD,
    ENTRY_FIELD,
    NOTIFY_FIELD,
    TENANT_FIELD,
    TRACE_FIELD,
    DeadLetterBody,
    DoneEvent,
    ErrorCode,
    ErrorEvent,
    GenerateRequest,
    Lane,
    PromptEvent,
    RequestLimits,
    Timings,
    TokensEvent,
    Usage,
    decode_event,
    decode_request,
    decode_trace,
    encode,
    is_valid_name,
    ms_now,
)
from client.replication import add_wait, check_acknowledged, pinned_pipeline
from client.scripts import Routing
from client.store import CONSUMER_GROUP, Fence, Keys, Scripts
from worker.leases import Claimed
from worker.publisher import Target


@dataclass(frozen=True, slots=True)
class Accepted:
    entry_id: bytes
    request: GenerateRequest
    notify: str | None = None  # the submitting client, told of every write (`NOTIFY_FIELD`)
    lane: Lane = "default"  # whose stream the entry is in
    partition: int = 0  # the queue partition it was read from: its events and acknowledgement go there
    trace: tuple[tuple[str, str], ...] = ()  # the submitter's trace context (`TRACE_FIELD`), for `worker.tracing`
    tenant: str | None = None  # who owns it (`TENANT_FIELD`): its usage is counted for that tenant
    cost: int = 0  # its estimated tokens (`COST_FIELD`; 0: none): its final event refunds what it did not use


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the request's reader without running it: its terminal `event` after `seq` tokens (None: only
    acknowledge, an earlier attempt having published its end), which acknowledges the entry. `rejected` says why
    it never ran (logged); None: it is finished, nothing to say."""

    target: Target
    event: DoneEvent | ErrorEvent | None
    seq: int = 0
    output: tuple[str, list[int]] = ("", [])  # the whole output, for `reply_to`
    rejected: str | None = None

    @property
    def entry_id(self) -> bytes:
        return self.target.entry_id

    @classmethod
    def error(
        cls,
        entry_id: bytes,
        request_id: str,
        code: ErrorCode,
        message: str,
        result_ttl: int = 3600,
        reply_to: str | None = None,  # known when the request itself could be read
        notify: str | None = None,
        lane: Lane = "default",
        partition: int = 0,
        param: str | None = None,  # the request field refused, when one is
        tenant: str | None = None,
        cost: int = 0,
    ) -> Answer:
        """An `error` event for a request that is not run, unfenced (no attempt of it started)."""
        target = Target(
            request_id,
            result_ttl,
            entry_id=entry_id,
            reply_to=reply_to,
            notify=notify,
            lane=lane,
            partition=partition,
            tenant=tenant,
            cost=cost,
        )
        return cls(target, ErrorEvent(code=code, message=message, param=param), rejected=message)

    @classmethod
    def rejecting(cls, accepted: Accepted, code: ErrorCode, message: str, param: str | None = None) -> Answer:
        """A readable request's refusal, which goes where its events would have gone."""
        request = accepted.request
        return cls.error(
            accepted.entry_id,
            request.id,
            code,
            message,
            request.result_ttl,
            request.reply_to,
            accepted.notify,
            accepted.lane,
            accepted.partition,
            param,
            accepted.tenant,
            accepted.cost,
        )


@dataclass(frozen=True, slots=True)
class Letter:
    """Copy the entry to the dead letters. With an `answer` (a request refused for good), its reader is answered
    too, and that answer acknowledges the entry; without one, the dead letter does."""

    entry_id: bytes
    raw: bytes
    reason: str
    lane: Lane = "default"
    answer: Answer | None = None
    tenant: str | None = None  # the entry's owner and estimated cost, which a replay gives back to it
    cost: int = 0


Decision = Accepted | Answer | Letter  # `decide`: an entry as read


def decide(
    entry_id: bytes,
    fields: dict[bytes, bytes],
    limits: RequestLimits,
    now_ms: int | None = None,
    check_deadline: bool = True,
    lane: Lane = "default",
    partition: int = 0,
) -> Decision:
    """What to do with one stream entry (pure: no I/O, so every branch is unit-tested). A claimed entry skips
    the deadline: it was started in time, and an earlier attempt may have published part of its answer."""
    raw = fields.get(ENTRY_FIELD)
    if raw is None:
        return Letter(entry_id, b"", f"entry has no field {ENTRY_FIELD.decode()!r}", lane)
    notify, tenant = _name_field(fields.get(NOTIFY_FIELD)), _name_field(fields.get(TENANT_FIELD))
    cost = _cost_field(fields.get(COST_FIELD))
    try:
        request = decode_request(raw)
    except (UnsupportedVersion, InvalidRequest) as error:
        if error.request_id is None:
            return Letter(entry_id, raw, str(error), lane, tenant=tenant, cost=cost)
        if isinstance(error, UnsupportedVersion):
            code, param = ErrorCode.UNSUPPORTED_VERSION, None
        else:
            code, param = ErrorCode.INVALID_REQUEST, error.param
        return Answer.error(
            entry_id,
            error.request_id,
            code,
            str(error),
            notify=notify,
            lane=lane,
            partition=partition,
            param=param,
            tenant=tenant,
            cost=cost,
        )
    except MalformedEntry as error:
        return Letter(entry_id, raw, str(error), lane, tenant=tenant, cost=cost)
    trace = tuple(decode_trace(fields.get(TRACE_FIELD)).items())
    accepted = Accepted(entry_id, request, notify, lane, partition, trace, tenant, cost)
    try:
        request.check_limits(limits)
    except InvalidRequest as error:
        return Answer.rejecting(accepted, ErrorCode.INVALID_REQUEST, str(error), error.param)
    expired = request.deadline is not None and request.deadline <= (now_ms if now_ms is not None else ms_now())
    if check_deadline and expired:
        return Answer.rejecting(accepted, ErrorCode.EXPIRED, "the deadline passed before generation started")
    return accepted


def _cost_field(raw: bytes | None) -> int:
    """An entry's `COST_FIELD` (0 when absent or not a count: nothing is then refunded)."""
    try:
        return max(0, int(raw)) if raw is not None else 0
    except ValueError:
        return 0


def _name_field(raw: bytes | None) -> str | None:
    """An entry's `NOTIFY_FIELD` or `TENANT_FIELD` when it is a usable name (anything else is ignored: the notice
    is only a hint, and usage is then counted for no tenant)."""
    name = raw.decode(errors="replace") if raw is not None else None
    return name if is_valid_name(name) else None


@dataclass(frozen=True, slots=True)
class Ready:
    """An accepted request with what Redis knows of it: our attempt number, a cancel mark, earlier output, and
    how often it was delivered and implicated in engine failures."""

    accepted: Accepted
    attempt: int
    cancelled: bool
    delivered_ids: list[int]  # tokens an earlier attempt already published
    delivered_text: str
    finished: bool  # an earlier attempt already published `done` or `error`
    deliveries: int = 1  # claims that count against the delivery limit
    engine_failures: int = 0  # engine failures this request was implicated in, on any worker
    first_started_ms: int | None = None  # when the first attempt started (epoch ms), for whole-request timings
    first_token_ms: int | None = None  # when an earlier attempt published the first token
    preemptions: int = 0  # times it was handed back to make room for an interactive request


@dataclass(frozen=True, slots=True)
class Start:
    """Generate it (`suspect`: it was implicated in an engine failure; `replaces_own`: this worker still runs an
    older attempt of it, its lease having lapsed, which stops for this one)."""

    ready: Ready
    suspect: bool = False
    replaces_own: bool = False


Admission = Start | Answer | Letter  # `admit`: what the worker does with an entry


@dataclass(frozen=True, slots=True)
class Policy:
    """The limits admission applies (from the settings, and the engine's end-of-sequence tokens)."""

    eos_token_ids: tuple[int, ...]
    max_deliveries: int
    max_engine_failures: int
    max_hand_backs: int = 10  # hand-backs forgiven before they count as deliveries (`Intake.prepare`)


def target_of(ready: Ready) -> Target:
    """Where a ready request's events go, fenced by its attempt."""
    request = ready.accepted.request
    accepted = ready.accepted
    return Target(
        request.id,
        request.result_ttl,
        ready.attempt,
        accepted.entry_id,
        request.reply_to,
        accepted.notify,
        accepted.lane,
        accepted.partition,
        accepted.tenant,
        accepted.cost,
    )


def done_event(
    request: GenerateRequest,
    ready: Ready,
    reason: str,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    started_ms: int | None = None,
    first_ms: int | None = None,
    now_ms: int | None = None,
) -> DoneEvent:
    """The `done` event. Timings describe the whole request: after a resume, the start and the first token are
    the first attempt's."""
    submitted = request.submitted
    started_ms = ready.first_started_ms or started_ms
    first_ms = ready.first_token_ms or first_ms
    timings = Timings(
        queue_ms=None if started_ms is None else started_ms - submitted,
        ttft_ms=None if first_ms is None else first_ms - submitted,
        total_ms=(ms_now() if now_ms is None else now_ms) - submitted,
    )
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    return DoneEvent(finish_reason=reason, usage=usage, timings=timings)  # type: ignore[arg-type]


def admit(ready: Ready, policy: Policy, *, running_here: bool = False, now_ms: int | None = None) -> Admission:
    """What to do with a request once Redis said what it knows of it (pure, so every branch is unit-tested)."""
    request, delivered = ready.accepted.request, ready.delivered_ids
    output = (ready.delivered_text, delivered)
    if ready.finished:
        return Answer(target_of(ready), None, seq=len(delivered), output=output)
    if ready.engine_failures >= policy.max_engine_failures:
        return _refuse(
            ready,
            ErrorCode.POISON_REQUEST,
            f"quarantined: implicated in {ready.engine_failures} engine failures "
            f"(max_engine_failures {policy.max_engine_failures})",
        )
    if ready.deliveries > policy.max_deliveries:
        reason = f"claimed {ready.deliveries} times (max_deliveries {policy.max_deliveries})"
        return _refuse(ready, ErrorCode.DELIVERY_LIMIT, reason)
    finish_reason = None
    if ready.cancelled:
        finish_reason = "cancelled"
    elif delivered and not request.params.ignore_eos and delivered[-1] in policy.eos_token_ids:
        finish_reason = "eos"
    elif delivered and len(delivered) >= request.params.max_new_tokens:  # 0 tokens asked: it scores its prompt
        finish_reason = "length"
    if finish_reason is not None:
        done = done_event(
            request, ready, finish_reason, prompt_tokens=0, completion_tokens=len(delivered), now_ms=now_ms
        )
        return Answer(target_of(ready), done, seq=len(delivered), output=output)
    return Start(ready, suspect=ready.engine_failures > 0, replaces_own=running_here)


def _refuse(ready: Ready, code: ErrorCode, reason: str) -> Letter:
    """Never run it again: a dead letter with `reason`, and an `error` event with `code` to its reader."""
    error = ErrorEvent(code=code, message=f"the request was refused: {reason}")
    answer = Answer(
        target_of(ready), error, seq=len(ready.delivered_ids), output=(ready.delivered_text, ready.delivered_ids)
    )
    accepted = ready.accepted
    return Letter(
        accepted.entry_id,
        encode(accepted.request),
        reason,
        accepted.lane,
        answer=answer,
        tenant=accepted.tenant,
        cost=accepted.cost,
    )


class Intake:
    """The worker's side of the consumer group `workers` on each lane's request stream."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        consumer: str,
        limits: RequestLimits,
        dead_maxlen: int,
        scripts: Scripts | None = None,
        wait_replicas: int = 0,
        routing: Routing | None = None,
        keep: int = 0,
    ) -> None:
        self._redis = redis
        self._keep = keep  # free slots kept for tenants with nothing running (`read.lua`)
        self._wake: asyncio.Future[Any] | None = None  # a wait for the next entry that a freed slot cut short
        self._keys = keys
        self._routing = routing or Routing()
        self.routed: Counter[str] = Counter()  # cache affinity's moves, by outcome (`llmq:affinity_entries_total`)
        self._wait_replicas = wait_replicas
        self._consumer = consumer
        self._limits = limits
        self._dead_maxlen = dead_maxlen
        self._scripts = scripts or Scripts.register(redis)

    async def ensure_group(self) -> None:
        """Creates each lane's group at id 0 (so entries added before any worker started are read) if missing."""
        for stream in self._keys.lanes.values():
            try:
                await self._redis.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise

    async def read(
        self,
        free: int,
        steps: list[tuple[Lane, int]],
        block_ms: int | None,
        *,
        report: bool = True,
        freed: asyncio.Event | None = None,
    ) -> list[Decision]:
        """New entries, at most `free` (the engine's free slots), taken lane by lane as `steps` (lane, wanted)
        say; when there are none, waits at most `block_ms` (None: not at all) for the next entry of any lane, or
        until `freed` is set, and returns none. A read that will not wait names only the lanes of its steps, so the
        script looks at no other stream. `report`: `free` is this worker's room, which cache affinity hears and
        whose last `keep` slots only tenants with nothing running take (not so for a full worker's look for an
        interactive request)."""
        asked = {lane for lane, _ in steps}
        lanes = [lane for lane in self._keys.lanes if block_ms is not None or lane in asked]
        keep = self._keep if report else 0
        reply = await self._scripts.read.run(
            self._keys, self._consumer, free, steps, lanes, self._routing, report, keep
        )
        self.routed.update(assigned=reply.assigned, taken=reply.taken, stolen=reply.stolen, overflow=reply.overflow)
        if reply.entries:
            return [
                decide(entry.entry_id, entry.fields, self._limits, lane=entry.lane, partition=self._keys.partition)
                for entry in reply.entries
            ]
        if block_ms is not None:
            if reply.retry_ms is not None:  # an entry assigned to another worker is ours to take then
                block_ms = max(1, min(block_ms, reply.retry_ms))
            streams: dict[KeyT, StreamIdT] = {stream: newest for stream, newest in reply.last.items()}
            await self._wait(streams, block_ms, freed)
        return []

    async def _wait(self, streams: dict[KeyT, StreamIdT], block_ms: int, freed: asyncio.Event | None) -> None:
        """An XREAD BLOCK from `streams`' newest ids, only a wake-up (the next read takes what came), for at most
        `block_ms`, or until `freed` is set: a worker whose free slots are all kept for quiet tenants reads again as
        soon as one of its runs ends. A wait that `freed` cut short serves the next one: still blocked, it means
        nothing was added since, so its ids are as good as new ones."""
        if freed is None:
            await self._redis.xread(streams, count=1, block=block_ms)
            return
        if self._wake is None:
            self._wake = asyncio.ensure_future(self._redis.xread(streams, count=1, block=block_ms))
        slot = asyncio.ensure_future(freed.wait())
        try:
            await asyncio.wait({self._wake, slot}, timeout=block_ms / 1000, return_when=asyncio.FIRST_COMPLETED)
        finally:
            slot.cancel()
        if self._wake.done():
            wake, self._wake = self._wake, None
            wake.result()  # a Redis failure reaches the caller, as a plain wait's would

    async def report_full(self) -> None:
        """Tells cache affinity this worker has no free slot (`read.lua`'s report, for a worker that reads nothing
        while full), so no entry is assigned to it and it stays live."""
        if self._routing.wait_ms > 0:
            await self._scripts.read.run(self._keys, self._consumer, 0, [], list(self._keys.lanes), self._routing)

    async def leave(self) -> None:
        """Takes this worker out of cache affinity (it stops or drains): nothing more is assigned to it."""
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        await self._redis.hdel(self._keys.affinity_workers, self._consumer)

    def decide_claimed(self, lane: Lane, claimed: list[Claimed]) -> tuple[list[Decision], dict[bytes, int]]:
        """Claimed entries of one lane go through the same decisions but the deadline (they started in time, and
        may have published part of their answer: a preempted or handed-back request resumes); also returns each
        entry's delivery count."""
        partition = self._keys.partition
        decisions = [
            decide(c.entry_id, c.fields, self._limits, check_deadline=False, lane=lane, partition=partition)
            for c in claimed
        ]
        return decisions, {c.entry_id: c.deliveries for c in claimed}

    async def admissions(
        self,
        decisions: list[Decision],
        policy: Policy,
        deliveries: dict[bytes, int] | None = None,
        running_here: Callable[[str], bool] = lambda request_id: False,
    ) -> AsyncGenerator[Admission, None]:
        """What to do with each entry of a batch, in the order to do it: the answers and dead letters `decide` gave,
        then (after one round trip, `prepare`) the requests Redis refused, then `admit`'s decision for each other
        one, made only when the caller asks for it, so it sees the requests the caller started meanwhile
        (`running_here`: whether this worker runs a request already)."""
        for decision in decisions:
            if not isinstance(decision, Accepted):
                yield decision
        accepted = [d for d in decisions if isinstance(d, Accepted)]
        ready, refused = await self.prepare(accepted, deliveries, policy.max_hand_backs)
        for answer in refused:
            yield answer
        for item in ready:
            yield admit(item, policy, running_here=running_here(item.accepted.request.id))

    async def prepare(
        self, accepted: list[Accepted], deliveries: dict[bytes, int] | None = None, forgiven_hand_backs: int = 10
    ) -> tuple[list[Ready], list[Answer]]:
        """One round trip for a batch: raise each request's attempt (fencing out earlier owners), note the first
        start, read its cancel mark and whatever earlier attempts published (raised first, so nothing slips in
        between). A request whose keys Redis refuses (say, someone wrote a string where its fence hash goes) comes
        back rejected, alone: the others of the batch start. Up to `forgiven_hand_backs` hand-backs (shutdowns,
        engine failures) do not count as deliveries; beyond that they do, so no hand-back path can loop."""
        if not accepted:
            return [], []
        now = ms_now()
        # With a WAIT the batch goes to its slot's node on one connection (`pinned_pipeline`); else redis-py's own
        # pipeline, which follows a slot that moves.
        key = self._keys.fence(accepted[0].request.id)
        pipeline = pinned_pipeline(self._redis, key) if self._wait_replicas else self._redis.pipeline(transaction=False)
        async with pipeline as pipe:
            for item in accepted:
                fence = self._keys.fence(item.request.id)
                pipe.hincrby(fence, Fence.ATTEMPT, 1)
                pipe.hsetnx(fence, Fence.STARTED, now)
                pipe.expire(fence, item.request.result_ttl)
                pipe.exists(self._keys.cancel(item.request.id))
                pipe.xrange(self._keys.result(item.request.id))
                pipe.hmget(fence, Fence.HANDED_BACK, Fence.ENGINE_FAILURES, Fence.STARTED, Fence.PREEMPTED)
            if self._wait_replicas:  # the raised attempts fence out earlier owners only once a failover keeps them
                add_wait(pipe, self._wait_replicas)
            replies = await pipe.execute(raise_on_error=False)
        if self._wait_replicas:
            check_acknowledged(replies.pop(), self._wait_replicas)
        ready, refused = [], []
        for index, item in enumerate(accepted):
            answers = replies[6 * index : 6 * index + 6]
            failure = next((a for a in answers if isinstance(a, Exception)), None)
            if failure is not None:
                message = f"Redis refused this request's keys: {failure}"
                refused.append(Answer.rejecting(item, ErrorCode.INTERNAL, message))
                continue
            attempt, _, _, cancelled, events, (handed_back, failures, started, preempted) = answers
            ids, text, finished, first_token_ms = _earlier_output(events)
            forgiven = min(int(handed_back or 0), forgiven_hand_backs) + int(preempted or 0)
            count = (deliveries or {}).get(item.entry_id, 1) - forgiven
            ready.append(
                Ready(
                    item,
                    int(attempt),
                    bool(cancelled),
                    ids,
                    text,
                    finished,
                    count,
                    engine_failures=int(failures or 0),
                    first_started_ms=int(started) if started else None,
                    first_token_ms=first_token_ms,
                    preemptions=int(preempted or 0),
                )
            )
        return ready, refused

    async def entry(self, entry_id: bytes, lane: Lane) -> bytes:
        """The request stream entry as it was (its `m` field), while it is still there; empty once it is not."""
        found = await self._redis.xrange(self._keys.lane(lane), entry_id, entry_id)
        raw = found[0][1].get(ENTRY_FIELD) if found and found[0][1] else None
        return raw if isinstance(raw, bytes) else b""

    async def dead_letter(self, letter: Letter) -> None:
        """Copies an entry to `{<queue>}:dead` (trimmed) and, unless the letter answers its reader, takes it off
        the request stream (a request with a reader is acknowledged with its `error` event instead). The entry's
        tenant and cost go beside the body, as on a request entry, where readers that predate them look for none."""
        body = DeadLetterBody(entry_id=letter.entry_id.decode(), reason=letter.reason, raw=letter.raw)
        entry: dict[Any, Any] = {ENTRY_FIELD: encode(body)}
        if letter.tenant is not None:
            entry |= {TENANT_FIELD: letter.tenant, COST_FIELD: letter.cost}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self._keys.dead, entry, maxlen=self._dead_maxlen, approximate=True)
            if letter.answer is None:
                pipe.xack(self._keys.lane(letter.lane), CONSUMER_GROUP, letter.entry_id)
                pipe.xdel(self._keys.lane(letter.lane), letter.entry_id)
            await pipe.execute()


def _earlier_output(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> tuple[list[int], str, bool, int | None]:
    """Token ids and text already published on a result stream (deduplicated by `seq`), whether it ended, and
    when its first token was written (the entry id's milliseconds)."""
    ids: list[int] = []
    text = ""
    first_token_ms = None
    for entry_id, fields in entries:
        try:
            event = decode_event(fields[ENTRY_FIELD])
        except (MalformedEntry, UnsupportedVersion, KeyError):
            continue
        if isinstance(event, PromptEvent):  # the prompt's scores, before any token: no output, no end
            continue
        if isinstance(event, TokensEvent):
            if event.seq == len(ids):
                if first_token_ms is None:
                    first_token_ms = int(entry_id.split(b"-")[0])
                ids.extend(event.ids)
                text += event.text
        else:
            return ids, text, True, first_token_ms
    return ids, text, False, first_token_ms
