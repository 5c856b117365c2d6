"""A queue's dead letters for operators (`llmq dead`): list, find, replay and drop them, page by page.

Workers copy an entry they will never run to `Keys.dead` of its partition (`worker.intake.Intake.dead_letter`): a
`DeadLetterBody` with the reason and `raw`, the request entry's `m` field as it was, and beside it the entry's
tenant and estimated cost. A replay puts that entry back, with its tenant (whose usage it counts in) and cost,
on a lane's request stream under the same request id, so whoever follows the id (`llmq attach`, `Job.attach`, a
`reply_to` pipeline) gets the new answer. In one transaction it removes the letter and clears what the first run
left under the id: the result stream (which may end with the error its reader got), the fence (whose counters
quarantined it), a cancel mark, and the idempotency marker, which it sets again, as `submit` does. Watching the
dead-letter stream makes two operators replaying the same letter run it once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from client.admin import Admin
from client.errors import LLMQError, MalformedEntry, UnsupportedVersion
from client.protocol import (
    COST_FIELD,
    ENTRY_FIELD,
    TENANT_FIELD,
    GenerateRequest,
    Lane,
    decode_dead_letter,
    decode_request,
    is_valid_name,
    ms_now,
)
from client.store import Keys

PAGE = 100  # entries read per XRANGE: memory and each call stay bounded however long the stream is


@dataclass(frozen=True)
class DeadLetter:
    """One entry of a dead-letter stream. `id` is its entry id there; `request` is None when `raw` is not a
    readable request (nothing to replay: only dropping it helps)."""

    id: str
    partition: int
    entry_id: str | None  # where it was in the request stream
    reason: str
    raw: bytes
    request: GenerateRequest | None
    tenant: str | None = None  # the request's owner (None: a letter of a worker that predates tenants)
    cost: int = 0

    @property
    def request_id(self) -> str | None:
        return None if self.request is None else self.request.id

    @property
    def age_ms(self) -> int:
        """Milliseconds since the worker wrote it, from its entry id."""
        return max(0, ms_now() - int(self.id.split("-")[0]))


def read_letter(entry_id: bytes | str, fields: dict[bytes, bytes], partition: int) -> DeadLetter:
    """A dead-letter entry as read; an unreadable one is still listed, with why."""
    letter_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    try:
        body = decode_dead_letter(fields.get(ENTRY_FIELD, b""))
    except (MalformedEntry, UnsupportedVersion) as error:
        return DeadLetter(letter_id, partition, None, f"(unreadable dead letter: {error})", b"", None)
    try:
        request: GenerateRequest | None = decode_request(body.raw)
    except (MalformedEntry, UnsupportedVersion, ValueError):
        request = None
    tenant = fields.get(TENANT_FIELD, b"").decode(errors="replace")
    cost = fields.get(COST_FIELD, b"0")
    return DeadLetter(
        letter_id,
        partition,
        body.entry_id,
        body.reason,
        body.raw,
        request,
        tenant if is_valid_name(tenant) else None,
        int(cost) if cost.isdigit() else 0,
    )


def _order(letter: DeadLetter) -> tuple[int, int]:
    ms, _, seq = letter.id.partition("-")
    return int(ms), int(seq or 0)


_MAX_ID_PART = 2**64 - 1  # each half of a stream entry id is an unsigned 64-bit number


def is_entry_id(text: str) -> bool:
    """`<ms>-<seq>`: a stream entry id, as `llmq dead list` shows it (each part within Redis's 64 bits)."""
    ms, dash, seq = text.partition("-")
    parts = (ms, seq)
    return bool(dash) and all(p.isascii() and p.isdigit() and int(p) <= _MAX_ID_PART for p in parts)


class DeadLetters:
    """The dead letters of one queue, over all its partitions, through `admin`'s connection."""

    def __init__(self, admin: Admin, queue: str) -> None:
        self._admin = admin
        self.queue = queue
        self._parts = admin.keys(queue).partitioned(admin.partitions)

    def _range(self, part: Keys, start: str, end: str = "+", count: int | None = None) -> list[DeadLetter]:
        redis = self._admin.redis
        entries = self._admin.call("a dead-letter read", lambda: redis.xrange(part.dead, start, end, count))
        return [read_letter(entry_id, fields, part.partition) for entry_id, fields in entries]

    def _pages(self, part: Keys, end: str = "+") -> Iterator[DeadLetter]:
        """The letters up to entry id `end`, oldest first, `PAGE` per read."""
        start = "-"
        while True:
            page = self._range(part, start, end, PAGE)
            yield from page
            if len(page) < PAGE:
                return
            start = f"({page[-1].id}"

    def oldest(self, limit: int) -> list[DeadLetter]:
        """The `limit` oldest letters of the queue, oldest first (each partition read up to `limit`)."""
        letters = [letter for part in self._parts for letter in self._range(part, "-", count=limit)]
        return sorted(letters, key=_order)[:limit]

    def every(self) -> Iterator[DeadLetter]:
        """Every letter there is now, partition by partition, oldest first in each, a page at a time. Letters
        written meanwhile (a replayed request dead-lettered again, say) are left for the next run, so it ends."""
        for part in self._parts:
            newest = self._newest(part)
            if newest is not None:
                yield from self._pages(part, newest)

    def _newest(self, part: Keys) -> str | None:
        redis = self._admin.redis
        entries = self._admin.call("a dead-letter read", lambda: redis.xrevrange(part.dead, count=1))
        return entries[0][0].decode() if entries else None

    def count(self) -> int:
        def read() -> list[int]:
            pipe = self._admin.redis.pipeline(transaction=False)
            for part in self._parts:
                pipe.xlen(part.dead)
            result: list[int] = pipe.execute()
            return result

        return sum(self._admin.call("a dead-letter count", read))

    def find(self, ident: str) -> DeadLetter | None:
        """The letter with entry id `ident` (in any partition), else the oldest whose request id is `ident`."""
        if is_entry_id(ident):
            for part in self._parts:
                for letter in self._range(part, ident, ident):
                    return letter
        if not is_valid_name(ident):
            return None
        part = self._admin.request_keys(self.queue, ident)
        return next((letter for letter in self._pages(part) if letter.request_id == ident), None)

    def replay(self, letter: DeadLetter, lane: Lane) -> bool:
        """Re-queues the letter's request on `lane` and removes the letter (see the module's docstring); False
        when the letter was gone already (someone replayed or dropped it first). Raises `NotReplayable` for a
        letter whose entry is no readable request."""
        request = letter.request
        if request is None:
            raise NotReplayable(f"dead letter {letter.id} holds no readable request ({letter.reason})")
        keys = self._admin.keys(self.queue, letter.partition)
        rid = request.id

        def move(pipe: Any) -> bool:
            if not pipe.xrange(keys.dead, letter.id, letter.id):
                return False
            pipe.multi()
            pipe.xdel(keys.dead, letter.id)
            pipe.delete(keys.result(rid), keys.fence(rid), keys.cancel(rid))
            pipe.set(keys.submitted(rid), 1, ex=request.result_ttl)
            entry: dict[Any, Any] = {ENTRY_FIELD: letter.raw}
            if letter.tenant is not None:
                entry |= {TENANT_FIELD: letter.tenant, COST_FIELD: letter.cost}
            pipe.xadd(keys.lane(lane), entry)
            return True

        moved: bool = self._admin.call(
            "a replay", lambda: self._admin.redis.transaction(move, keys.dead, value_from_callable=True)
        )
        return moved

    def drop(self, letter: DeadLetter) -> bool:
        """Deletes one letter; False when it was gone already."""
        dead = self._admin.keys(self.queue, letter.partition).dead
        return bool(self._admin.call("a drop", lambda: self._admin.redis.xdel(dead, letter.id)))

    def drop_all(self) -> int:
        """Deletes every letter of the queue (XTRIM to 0: one call per partition, however many); how many."""

        def trim() -> list[int]:
            pipe = self._admin.redis.pipeline(transaction=False)
            for part in self._parts:
                pipe.xtrim(part.dead, maxlen=0, approximate=False)
            result: list[int] = pipe.execute()
            return result

        return sum(self._admin.call("a drop", trim))


class NotReplayable(LLMQError):
    """A dead letter whose entry is not a readable request: there is nothing to put back on the queue."""
