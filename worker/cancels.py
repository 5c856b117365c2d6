"""Cancels reach a worker by pub/sub on `{<queue>}:cancel` (sharded pub/sub on a Redis Cluster), also while it
drains; a lost connection resubscribes, and the cancel marks (`{<queue>}:cancel:<id>`) cover whatever was published
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from structlog.typing import FilteringBoundLogger

from client.backoff import jittered
from client.connection import is_cluster
from client.failover import REDIS_FAILURES
from client.store import Keys
from worker.engine import GenerationEngine
from worker.logging import redact
from worker.pausing import pause

RESUBSCRIBE_S = 1.0  # a lost cancel channel is subscribed again after about this long (jittered)
HEARD_FOR_S = 60.0  # how long a cancel for a request not running here is remembered


class CancelListener:
    """A queue partition's cancel channel, applied to the engine. A cancel for a request this worker is about to
    start (its cancel mark was read before the message came) is remembered for `HEARD_FOR_S`, so the start can
    apply it (`heard`): else it would be lost between the mark's read and the engine's submit."""

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
        self._heard: dict[str, float] = {}  # request id -> loop time, for cancels of requests not running here

    def heard(self, request_id: str) -> bool:
        """Whether a cancel for `request_id` came in the last `HEARD_FOR_S` while it did not run here."""
        return request_id in self._heard

    def _apply(self, request_id: str) -> None:
        if self._engine.cancel(request_id):
            self._log.info("cancelled", request_id=request_id)
            return
        now = asyncio.get_running_loop().time()
        self._heard = {rid: at for rid, at in self._heard.items() if now - at < HEARD_FOR_S}
        self._heard[request_id] = now

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
                    if message is not None:
                        self._apply(_text(message["data"]))
            except REDIS_FAILURES as error:
                self._log.warning("cancel channel lost; resubscribing", error=redact(str(error)))
                await pause(finished, jittered(RESUBSCRIBE_S))
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
