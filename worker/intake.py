"""Reading requests: the consumer group, COUNT = free engine slots, and the decision for each entry.

Two pure decisions, each with a unit test per branch:
- `decide` (the entry as read): `Accepted`, `Rejected` (its reader gets an `error` event, then it is
  acknowledged) or `DeadLetter` (unreadable: no request id to answer to);
- `decide_ready` (an accepted request, once `Intake.prepare` read what Redis knows of it): `Run`, `Complete`
  (earlier attempts produced everything) or `Refuse` (quarantined, or over the delivery limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.typing import KeyT, StreamIdT

from client.errors import InvalidRequest, MalformedEntry, UnsupportedVersion
from client.protocol import (
    ENTRY_FIELD,
    NOTIFY_FIELD,
    PROTOCOL_VERSION,
    ErrorCode,
    GenerateRequest,
    Lane,
    RequestLimits,
    TokensEvent,
    decode_event,
    decode_request,
    is_valid_name,
    ms_now,
)
from client.store import CONSUMER_GROUP, Fence, Keys, Scripts
from worker.leases import Claimed


@dataclass(frozen=True, slots=True)
class Accepted:
    entry_id: bytes
    request: GenerateRequest
    notify: str | None = None  # the submitting client, told of every write (`NOTIFY_FIELD`)
    lane: Lane = "default"  # whose stream the entry is in


@dataclass(frozen=True, slots=True)
class Rejected:
    entry_id: bytes
    request_id: str
    code: ErrorCode
    message: str
    result_ttl: int = 3600
    reply_to: str | None = None  # known when the request itself could be read
    notify: str | None = None
    lane: Lane = "default"

    @classmethod
    def answering(cls, accepted: Accepted, code: ErrorCode, message: str) -> Rejected:
        """A readable request's refusal, which goes where its events would have gone."""
        request = accepted.request
        return cls(
            accepted.entry_id,
            request.id,
            code,
            message,
            request.result_ttl,
            request.reply_to,
            accepted.notify,
            accepted.lane,
        )


@dataclass(frozen=True, slots=True)
class DeadLetter:
    entry_id: bytes
    raw: bytes
    reason: str
    lane: Lane = "default"


Decision = Accepted | Rejected | DeadLetter


def decide(
    entry_id: bytes,
    fields: dict[bytes, bytes],
    limits: RequestLimits,
    now_ms: int | None = None,
    check_deadline: bool = True,
    lane: Lane = "default",
) -> Decision:
    """What to do with one stream entry (pure: no I/O, so every branch is unit-tested). A claimed entry skips
    the deadline: it was started in time, and an earlier attempt may have published part of its answer."""
    raw = fields.get(ENTRY_FIELD)
    if raw is None:
        return DeadLetter(entry_id, b"", f"entry has no field {ENTRY_FIELD.decode()!r}", lane)
    notify = _client_id(fields.get(NOTIFY_FIELD))
    try:
        request = decode_request(raw)
    except (UnsupportedVersion, InvalidRequest) as error:
        if error.request_id is None:
            return DeadLetter(entry_id, raw, str(error), lane)
        code = ErrorCode.UNSUPPORTED_VERSION if isinstance(error, UnsupportedVersion) else ErrorCode.INVALID_REQUEST
        return Rejected(entry_id, error.request_id, code, str(error), notify=notify, lane=lane)
    except MalformedEntry as error:
        return DeadLetter(entry_id, raw, str(error), lane)
    accepted = Accepted(entry_id, request, notify, lane)
    try:
        request.check_limits(limits)
    except InvalidRequest as error:
        return Rejected.answering(accepted, ErrorCode.INVALID_REQUEST, str(error))
    expired = request.deadline is not None and request.deadline <= (now_ms if now_ms is not None else ms_now())
    if check_deadline and expired:
        return Rejected.answering(accepted, ErrorCode.EXPIRED, "the deadline passed before generation started")
    return accepted


def _client_id(raw: bytes | None) -> str | None:
    """The `NOTIFY_FIELD` of an entry when it is a usable name (it is only a hint: anything else is ignored)."""
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
class Run:
    """Generate it (`suspect`: it was implicated in an engine failure; `replaces_own`: this worker still runs an
    older attempt of it, its lease having lapsed, which stops for this one)."""

    suspect: bool = False
    replaces_own: bool = False


@dataclass(frozen=True, slots=True)
class Complete:
    """Nothing is left to generate: publish `done` with `finish_reason`, or only acknowledge (None: an earlier
    attempt published its end and died before acknowledging)."""

    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Never run it again: an `error` event with `code`, and a dead letter with `reason`."""

    code: ErrorCode
    reason: str


ReadyDecision = Run | Complete | Refuse


def decide_ready(
    ready: Ready,
    *,
    eos_token_ids: tuple[int, ...],
    max_deliveries: int,
    max_engine_failures: int,
    running_here: bool = False,
) -> ReadyDecision:
    """What to do with a request once Redis said what it knows of it (pure, so every branch is unit-tested)."""
    request, delivered = ready.accepted.request, ready.delivered_ids
    if ready.finished:
        return Complete(None)
    if ready.engine_failures >= max_engine_failures:
        return Refuse(
            ErrorCode.POISON_REQUEST,
            f"quarantined: implicated in {ready.engine_failures} engine failures "
            f"(max_engine_failures {max_engine_failures})",
        )
    if ready.deliveries > max_deliveries:
        return Refuse(ErrorCode.DELIVERY_LIMIT, f"claimed {ready.deliveries} times (max_deliveries {max_deliveries})")
    if ready.cancelled:
        return Complete("cancelled")
    if delivered and not request.params.ignore_eos and delivered[-1] in eos_token_ids:
        return Complete("eos")
    if len(delivered) >= request.params.max_new_tokens:
        return Complete("length")
    return Run(suspect=ready.engine_failures > 0, replaces_own=running_here)


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
    ) -> None:
        self._redis = redis
        self._keys = keys
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

    async def read(self, free: int, steps: list[tuple[Lane, int]], block_ms: int | None) -> list[Decision]:
        """New entries, at most `free` (the engine's free slots), taken lane by lane as `steps` (lane, wanted)
        say; when there are none, waits at most `block_ms` (None: not at all) for the next entry of any lane
        and returns none."""
        lanes = list(self._keys.lanes)
        args: list[Any] = [CONSUMER_GROUP, self._consumer, free]
        for lane, wanted in steps:
            args += [lanes.index(lane) + 1, wanted]
        read, last = await self._scripts.read(keys=list(self._keys.lanes.values()), args=args)
        if read:
            return [
                decide(entry_id, _fields(flat), self._limits, lane=lanes[int(index) - 1])
                for index, entry_id, flat in read
            ]
        if block_ms is not None:
            streams: dict[KeyT, StreamIdT] = dict(zip(self._keys.lanes.values(), last, strict=True))
            await self._redis.xread(streams, count=1, block=block_ms)  # only a wake-up: the next call reads
        return []

    def decide_claimed(self, lane: Lane, claimed: list[Claimed]) -> tuple[list[Decision], dict[bytes, int]]:
        """Claimed entries of one lane go through the same decisions but the deadline (they started in time, and
        may have published part of their answer: a preempted or handed-back request resumes); also returns each
        entry's delivery count."""
        decisions = [decide(c.entry_id, c.fields, self._limits, check_deadline=False, lane=lane) for c in claimed]
        return decisions, {c.entry_id: c.deliveries for c in claimed}

    async def prepare(
        self, accepted: list[Accepted], deliveries: dict[bytes, int] | None = None, forgiven_hand_backs: int = 10
    ) -> tuple[list[Ready], list[Rejected]]:
        """One round trip for a batch: raise each request's attempt (fencing out earlier owners), note the first
        start, read its cancel mark and whatever earlier attempts published (raised first, so nothing slips in
        between). A request whose keys Redis refuses (say, someone wrote a string where its fence hash goes) comes
        back rejected, alone: the others of the batch start. Up to `forgiven_hand_backs` hand-backs (shutdowns,
        engine failures) do not count as deliveries; beyond that they do, so no hand-back path can loop."""
        if not accepted:
            return [], []
        now = ms_now()
        async with self._redis.pipeline(transaction=False) as pipe:
            for item in accepted:
                fence = self._keys.fence(item.request.id)
                pipe.hincrby(fence, Fence.ATTEMPT, 1)
                pipe.hsetnx(fence, Fence.STARTED, now)
                pipe.expire(fence, item.request.result_ttl)
                pipe.exists(self._keys.cancel(item.request.id))
                pipe.xrange(self._keys.result(item.request.id))
                pipe.hmget(fence, Fence.HANDED_BACK, Fence.ENGINE_FAILURES, Fence.STARTED, Fence.PREEMPTED)
            replies = await pipe.execute(raise_on_error=False)
        ready, refused = [], []
        for index, item in enumerate(accepted):
            answers = replies[6 * index : 6 * index + 6]
            failure = next((a for a in answers if isinstance(a, Exception)), None)
            if failure is not None:
                message = f"Redis refused this request's keys: {failure}"
                refused.append(Rejected.answering(item, ErrorCode.INTERNAL, message))
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

    async def dead_letter(self, letter: DeadLetter, *, acknowledge: bool = True) -> None:
        """Copies an entry to `{<queue>}:dead` (trimmed) and, unless told otherwise, takes it off the request
        stream (a request with a reader is acknowledged with its `error` event instead)."""
        body = {"v": PROTOCOL_VERSION, "entry_id": letter.entry_id.decode(), "reason": letter.reason, "raw": letter.raw}
        entry: dict[Any, Any] = {ENTRY_FIELD: msgpack.packb(body)}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self._keys.dead, entry, maxlen=self._dead_maxlen, approximate=True)
            if acknowledge:
                pipe.xack(self._keys.lane(letter.lane), CONSUMER_GROUP, letter.entry_id)
                pipe.xdel(self._keys.lane(letter.lane), letter.entry_id)
            await pipe.execute()


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    """An entry's fields as a script returns them: a flat [name, value, ...] list."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


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
        if isinstance(event, TokensEvent):
            if event.seq == len(ids):
                if first_token_ms is None:
                    first_token_ms = int(entry_id.split(b"-")[0])
                ids.extend(event.ids)
                text += event.text
        else:
            return ids, text, True, first_token_ms
    return ids, text, False, first_token_ms
