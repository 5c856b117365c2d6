"""Leases on in-flight requests: renewal, claiming a dead worker's requests, handing requests back.

A worker owns the entries it read until their idle time passes `lease_timeout_s`. It renews the idle time of
the entries it still owns (checked inside the script, never blindly), so a live worker's requests never move
however long they generate, and a dead worker's move to whoever runs XAUTOCLAIM next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.typing import StreamIdT

from client.protocol import Lane
from client.scripts import CONSUMER_GROUP, HandBackReason, Scripts
from client.store import Keys


@dataclass(frozen=True, slots=True)
class Claimed:
    entry_id: bytes
    fields: dict[bytes, bytes]
    deliveries: int


class Leases:
    """The leases of one lane's request stream (`Keys.lane`)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        consumer: str,
        lease_timeout_s: float,
        scripts: Scripts | None = None,
        lane: Lane = "default",
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._lane: Lane = lane
        self._stream = keys.lane(lane)
        self._consumer = consumer
        self._lease_ms = int(lease_timeout_s * 1000)
        self._scripts = scripts or Scripts.register(redis)
        self._cursor: bytes | str = "0-0"

    async def renew(self, entry_ids: list[bytes]) -> set[bytes]:
        """Resets the idle time of the entries still ours; returns those we lost."""
        if not entry_ids:
            return set()
        return await self._scripts.renew.run(self._keys, self._lane, self._consumer, entry_ids)

    async def claim(self, count: int) -> list[Claimed]:
        """Takes up to `count` entries idle past the lease (their worker died), following XAUTOCLAIM's cursor."""
        if count < 1:
            return []
        reply = await self._redis.xautoclaim(
            self._stream, CONSUMER_GROUP, self._consumer, self._lease_ms, start_id=self._cursor, count=count
        )
        self._cursor, entries = reply[0], reply[1]
        return await self._with_deliveries(entries)

    async def reclaim(self, entry_ids: list[bytes]) -> list[Claimed]:
        """Takes back entries this worker handed back (say, to preempt them) and nobody has claimed since: a
        request preempted here resumes in the next slot that frees here, before any newer entry of its lane."""
        if not entry_ids:
            return []
        ids: list[StreamIdT] = list(entry_ids)
        entries = await self._redis.xclaim(self._stream, CONSUMER_GROUP, self._consumer, self._lease_ms, ids)
        return await self._with_deliveries(entries)

    async def _with_deliveries(self, entries: list[Any]) -> list[Claimed]:
        # Redis 7 drops entries deleted meanwhile and lists them apart; 6.2 returns them with no fields.
        entries = [(entry_id, fields) for entry_id, fields in entries if fields]
        if not entries:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for entry_id, _ in entries:
                pipe.xpending_range(self._stream, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
            pending = await pipe.execute()
        return [
            Claimed(_bytes(entry_id), fields, int(info[0]["times_delivered"]) if info else 1)
            for (entry_id, fields), info in zip(entries, pending, strict=True)
        ]

    async def hand_back(self, entries: list[tuple[bytes, str]], reason: HandBackReason = HandBackReason.DRAIN) -> int:
        """Makes the (entry id, request id) pairs we still own claimable at once: at shutdown, after an engine
        failure that implicated them, or to preempt them (`HandBackReason`). Returns how many were ours."""
        if not entries:
            return 0
        return await self._scripts.hand_back.run(self._keys, self._lane, self._consumer, entries, reason)


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
