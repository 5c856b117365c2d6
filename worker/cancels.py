"""Cancels reach a worker by pub/sub on `{<queue>}:cancel` (sharded pub/sub on a Redis Cluster), also while it
drains; a lost connection resubscribes, and the cancel marks (`{<queue>}:cancel:<id>`) cover whatever was published
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from structlog.typing import FilteringBoundLogger

from client.connection import is_cluster
from client.store import Keys
from worker.engine import GenerationEngine
from worker.logging import redact
from worker.pausing import pause


class CancelListener:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        engine: GenerationEngine,
        running: Callable[[], list[str]],
        log: FilteringBoundLogger,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._engine = engine
        self._running = running  # ids of the requests this worker runs
        self._log = log

    async def run(self, finished: asyncio.Event) -> None:
        while not finished.is_set():
            pubsub: Any = self._redis.pubsub(ignore_subscribe_messages=True)
            sharded = is_cluster(self._redis)  # a Cluster's cancels go by SPUBLISH to the queue's own shard
            try:
                await (pubsub.ssubscribe if sharded else pubsub.subscribe)(self._keys.cancel_channel)
                await self._apply_marks()  # anything published while we were not subscribed
                while not finished.is_set():
                    if sharded:
                        message = await pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=1.0)
                    else:
                        message = await pubsub.get_message(timeout=1.0)
                    if message is not None and self._engine.cancel(_text(message["data"])):
                        self._log.info("cancelled", request_id=_text(message["data"]))
            except RedisError as error:
                self._log.warning("cancel channel lost; resubscribing", error=redact(str(error)))
                await pause(finished, 1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _apply_marks(self) -> None:
        request_ids = self._running()
        if not request_ids:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.exists(self._keys.cancel(request_id))
            marks = await pipe.execute()
        for request_id, marked in zip(request_ids, marks, strict=True):
            if marked:
                self._engine.cancel(request_id)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
