"""Files and batches of the Batch API in Redis: a JSON record per object, a file's bytes, a batch's answers, an
index per owner for listing and one of the batches still to drive, all expiring (`batch_ttl_s`), so what the API
keeps is bounded and outlives any gateway.

Keys (prefix `p`): a file's `{p:file:<id>}:meta`, `:data` and `:batches` (the batches whose input it is); a
batch's `{p:batch:<id>}:meta`, `:out` and `:err` (hashes custom_id -> output line: `HSETNX` makes each line's
answer written once); an owner's `{p:owner:<hash>}:files` and `:batches` (sorted sets by creation) and `:files:until`,
`:batches:until` (the same ids by the epoch second their record expires or was deleted: an entry is pruned
`CURSOR_S` later, so a listing's cursor is a position even once its object is gone);
`{p:batches}:active`. Keys of one object share a hash tag and no command spans two objects, so every call is
single-slot on a Redis Cluster.

A record's fields starting with `_` are private (the owner, reserved file ids); the rest is the OpenAI object.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

from gateway.auth import bearer_token

Kind = Literal["files", "batches"]
ANONYMOUS = "anonymous"  # the owner of everything while authentication is off
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})  # a batch's statuses it never leaves
WINDOW_S = 24 * 3600  # the one completion window (`24h`, as OpenAI's): a batch's keys outlive it
CURSOR_S = 3600  # an index entry outlives its object this long: a listing's cursor stays a position meanwhile
# A lease's compare-and-extend and compare-and-delete (KEYS[1] the lease, ARGV[1] the holder's token, ARGV[2] ms):
# one call each, so no other gateway's lease taken in between is extended or deleted.
RENEW_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
RELEASE_LUA = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def new_id(kind: Kind) -> str:
    """An unguessable id in OpenAI's shape (`file-<hex>`, `batch_<hex>`), 128 random bits."""
    return f"file-{secrets.token_hex(16)}" if kind == "files" else f"batch_{secrets.token_hex(16)}"


def owner_of(authorization: str | None, auth_on: bool) -> str:
    """Who owns what a request creates: a digest of its API key (never the key), or `ANONYMOUS` without auth."""
    if not auth_on:
        return ANONYMOUS
    token = bearer_token(authorization) or ""  # a request that got here had a valid key (`gateway.auth`)
    return hashlib.sha256(token.encode()).hexdigest()[:32]


def public(record: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in record.items() if not key.startswith("_")}


class BatchStore:
    """Every read and write of the Batch API's state (`redis`: a `redis.asyncio` client or cluster client)."""

    def __init__(self, redis: Any, prefix: str, ttl_s: int) -> None:
        self.redis, self.prefix, self.ttl_s = redis, prefix, ttl_s
        self._renew, self._release = redis.register_script(RENEW_LUA), redis.register_script(RELEASE_LUA)

    @property
    def _batch_ttl_s(self) -> int:
        """A batch's keys last `ttl_s` after its last change, and never end while it may still run."""
        return self.ttl_s + WINDOW_S

    def _key(self, kind: str, object_id: str, part: str) -> str:
        return f"{{{self.prefix}:{kind}:{object_id}}}:{part}"

    def _index(self, owner: str, kind: Kind) -> str:
        return f"{{{self.prefix}:owner:{owner}}}:{kind}"

    def _until(self, owner: str, kind: Kind) -> str:
        return f"{self._index(owner, kind)}:until"

    @property
    def _active(self) -> str:
        return f"{{{self.prefix}:batches}}:active"

    async def shown(self, record: dict[str, Any]) -> dict[str, Any]:
        """A record as its OpenAI object: a batch's request counts as they stand now."""
        shown = public(record)
        if record.get("object") == "batch" and record["status"] != "validating":
            completed, failed = await self.counts(record["id"])
            shown["request_counts"] = {**record["request_counts"], "completed": completed, "failed": failed}
        return shown

    # ------------------------------------------------------------------------------------------------ files

    async def put_file(
        self, owner: str, filename: str, purpose: str, data: bytes, file_id: str | None = None
    ) -> dict[str, Any]:
        """Stores a file (under a new id, or `file_id` when it was reserved) and lists it as `owner`'s."""
        now, file_id = int(time.time()), file_id or new_id("files")
        record: dict[str, Any] = {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": now,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": now + self.ttl_s,
            "_owner": owner,
        }
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self._key("file", file_id, "data"), data, ex=self.ttl_s)
        pipe.set(self._key("file", file_id, "meta"), json.dumps(record), ex=self.ttl_s)
        await pipe.execute()
        await self._list_as(owner, "files", file_id, record["expires_at"])
        return record

    async def file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        """The file's record, or None when there is none or it is another owner's (they look the same)."""
        return await self._record("file", owner, file_id)

    async def file_data(self, file_id: str) -> bytes | None:
        data: bytes | None = await self.redis.get(self._key("file", file_id, "data"))
        return data

    async def keep_file(self, file_id: str, seconds: int) -> None:
        """Makes a file last at least `seconds` more, and its `expires_at` say so (a batch reads its input until it
        ends)."""
        key = self._key("file", file_id, "meta")
        raw = await self.redis.get(key)
        until = int(time.time()) + seconds
        record = json.loads(raw) if raw is not None else None
        if record is None or record["expires_at"] >= until:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(key, json.dumps(record | {"expires_at": until}), ex=seconds, xx=True)  # not if deleted
        pipe.expire(self._key("file", file_id, "data"), seconds)
        await pipe.execute()
        await self._list_as(record["_owner"], "files", file_id, until)

    async def batches_reading(self, file_id: str) -> list[str]:
        """The unfinished batches whose input the file is (a batch reads it until it ends)."""
        found = []
        for raw in await self.redis.smembers(self._key("file", file_id, "batches")):  # a batch per creation: few
            record = await self.batch(None, raw.decode())
            if record is not None and record["status"] not in ENDED:
                found.append(record["id"])
        return found

    async def delete_file(self, owner: str, file_id: str) -> bool:
        if await self.file(owner, file_id) is None:
            return False
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(*(self._key("file", file_id, part) for part in ("meta", "data", "batches")))
        pipe.zadd(self._until(owner, "files"), {file_id: int(time.time())}, xx=True)  # its entry: pruned later
        await pipe.execute()
        return True

    # ---------------------------------------------------------------------------------------------- batches

    async def put_batch(self, record: dict[str, Any]) -> None:
        """Stores a new batch, lists it as its owner's, as one to drive and as a reader of its input file."""
        readers = self._key("file", record["input_file_id"], "batches")
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(readers, record["id"])
        pipe.expire(readers, self._batch_ttl_s)  # as long as the file is kept for the batch
        await pipe.execute()
        await self.redis.set(self._key("batch", record["id"], "meta"), json.dumps(record), ex=self._batch_ttl_s)
        await self._list_as(record["_owner"], "batches", record["id"], int(time.time()) + self._batch_ttl_s)
        await self.redis.zadd(self._active, {record["id"]: time.time()})

    async def batch(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        """The batch's record (`owner` None: whoever owns it), or None."""
        return await self._record("batch", owner, batch_id)

    async def update(
        self, batch_id: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> dict[str, Any] | None:
        """Applies `change` (the record -> the fields to set, or None for no change) atomically against concurrent
        updates (WATCH); returns the record as it is afterwards, or None when the batch is gone."""
        key = self._key("batch", batch_id, "meta")
        changed = False

        async def attempt(pipe: Any) -> dict[str, Any] | None:
            nonlocal changed
            raw = await pipe.get(key)
            if raw is None:
                return None
            record: dict[str, Any] = json.loads(raw)
            fields = change(record)
            pipe.multi()
            changed = bool(fields)
            if fields:
                record |= fields
                pipe.set(key, json.dumps(record), ex=self._batch_ttl_s)
            return record

        result: dict[str, Any] | None = await self.redis.transaction(attempt, key, value_from_callable=True)
        if result is not None and changed:  # its record lasts longer now: so does its index entry
            await self._list_as(result["_owner"], "batches", batch_id, int(time.time()) + self._batch_ttl_s)
        return result

    async def counts(self, batch_id: str) -> tuple[int, int]:
        """Lines answered so far: (completed, failed)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hlen(self._key("batch", batch_id, "out"))
        pipe.hlen(self._key("batch", batch_id, "err"))
        completed, failed = await pipe.execute()
        return int(completed), int(failed)

    async def answered(self, batch_id: str) -> set[str]:
        """The custom_ids with an answer (in the output or the error file)."""
        found: set[str] = set()
        for part in ("out", "err"):  # a batch's lines are bounded (`batch_max_lines`)
            found.update(name.decode() for name in await self.redis.hkeys(self._key("batch", batch_id, part)))
        return found

    async def answer(self, batch_id: str, answers: list[tuple[str, str, bool]]) -> None:
        """Records (custom_id, output line, succeeded) answers; a line already answered keeps its first answer."""
        out, err = self._key("batch", batch_id, "out"), self._key("batch", batch_id, "err")
        pipe = self.redis.pipeline(transaction=False)
        for custom_id, line, succeeded in answers:
            pipe.hsetnx(out if succeeded else err, custom_id, line)
        pipe.expire(out, self._batch_ttl_s)
        pipe.expire(err, self._batch_ttl_s)
        await pipe.execute()

    async def answers(self, batch_id: str, succeeded: bool, most: int) -> bytes | None:
        """The output (or error) file's content: every answer, one JSON line each; None past `most` bytes (read no
        further: what is held stays bounded)."""
        key = self._key("batch", batch_id, "out" if succeeded else "err")
        lines, size = [], 0
        async for _, line in self.redis.hscan_iter(key):
            size += len(line) + 1
            if size > most:
                return None
            lines.append(line + b"\n")
        return b"".join(lines)

    async def to_drive(self) -> list[str]:
        """The batches not yet finished, oldest first."""
        return [raw.decode() for raw in await self.redis.zrange(self._active, 0, -1)]

    async def finished(self, batch_id: str) -> None:
        await self.redis.zrem(self._active, batch_id)

    # ---------------------------------------------------------------------------------------------- leases

    async def take_lease(self, batch_id: str, token: str, seconds: float) -> bool:
        """The lease of driving the batch, when no one holds it."""
        taken = await self.redis.set(self._key("batch", batch_id, "lease"), token, nx=True, px=int(seconds * 1000))
        return bool(taken)

    async def renew_lease(self, batch_id: str, token: str, seconds: float) -> bool:
        """Extends the lease while it is still `token`'s; False once another holds it (exactly once does not rest on
        the lease: answers are written once, request ids are derived; it only saves work)."""
        key = self._key("batch", batch_id, "lease")
        return bool(await self._renew(keys=[key], args=[token, int(seconds * 1000)]))

    async def release_lease(self, batch_id: str, token: str) -> None:
        """Lets go of the lease if it is still `token`'s (never of one another gateway took since)."""
        await self._release(keys=[self._key("batch", batch_id, "lease")], args=[token])

    # --------------------------------------------------------------------------------------------- listing

    async def listed(
        self, owner: str, kind: Kind, after: str | None, limit: int, keep: Callable[[dict[str, Any]], bool] = bool
    ) -> tuple[list[dict[str, Any]], bool]:
        """`owner`'s files or batches that `keep` keeps, newest first, from the position after `after` (one deleted or
        expired since, too, up to `CURSOR_S` after: its entry is kept); and whether more follow."""
        index = self._index(owner, kind)
        position: float | None = None
        if after is not None:
            position = await self.redis.zscore(index, after)
            if position is None:  # never listed here, or gone long ago
                return [], False
        found: list[dict[str, Any]] = []
        offset = 0
        while len(found) <= limit:
            top = "+inf" if position is None else position
            rows = await self.redis.zrevrangebyscore(index, top, "-inf", start=offset, num=limit + 1, withscores=True)
            if not rows:
                break
            offset += len(rows)
            ids = [raw.decode() for raw, score in rows if after is None or score < top or raw.decode() < after]
            for record in await self._records("file" if kind == "files" else "batch", owner, ids):
                if record is not None and keep(record):  # None: gone, its entry pruned later
                    found.append(record)
        return found[:limit], len(found) > limit

    async def _list_as(self, owner: str, kind: Kind, object_id: str, until: int) -> None:
        """Lists the object as `owner`'s (at its first listing's time) until its record expires at epoch second
        `until`; prunes the index of the entries `CURSOR_S` past their record, and makes it last as long as its
        longest-lived entry."""
        index, expiry = self._index(owner, kind), self._until(owner, kind)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(index, {object_id: time.time()}, nx=True)  # a longer life does not move it
        pipe.zadd(expiry, {object_id: until}, gt=True)  # a record's life only grows
        pipe.zrangebyscore(expiry, "-inf", f"({int(time.time()) - CURSOR_S}")
        pipe.zrange(expiry, -1, -1, withscores=True)
        _, _, gone, (last,) = await pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        if gone:
            pipe.zrem(index, *gone)
            pipe.zrem(expiry, *gone)
        pipe.expireat(index, int(last[1]) + CURSOR_S)
        pipe.expireat(expiry, int(last[1]) + CURSOR_S)
        await pipe.execute()

    async def _records(self, kind: str, owner: str, object_ids: list[str]) -> list[dict[str, Any] | None]:
        """The records of `object_ids` (None for one gone or another owner's), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for object_id in object_ids:
            pipe.get(self._key(kind, object_id, "meta"))
        found = [json.loads(raw) if raw is not None else None for raw in await pipe.execute()]
        return [record if record is not None and record.get("_owner") == owner else None for record in found]

    async def _record(self, kind: str, owner: str | None, object_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self._key(kind, object_id, "meta"))
        if raw is None:
            return None
        record: dict[str, Any] = json.loads(raw)
        return record if owner is None or record.get("_owner") == owner else None
