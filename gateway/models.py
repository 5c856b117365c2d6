"""Which model is served on which queue, from the live workers' heartbeats (`client.store` status): the gateway
holds no list of its own, so a model appears when its first worker starts and goes when its last one stops."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from client import AsyncClient
from client.protocol import WorkerInfo


@dataclass(frozen=True)
class ServedModel:
    """One model id as `/v1/models` lists it: the queue its workers read and how many are alive."""

    id: str
    queue: str
    workers: int
    created: int  # epoch s: the oldest live worker's start


class ModelDirectory:
    """The model -> queue map of the configured queues, refreshed at most every `refresh_s` (a request pays
    one status round trip per refresh, not one per request). A map with no live worker is not kept: the next
    request reads again, so a model is listed as soon as its first worker's heartbeat is. A queue's name is also
    accepted as a model id, so callers can address a queue whose workers have not started yet (the queue holds
    the work)."""

    def __init__(self, client: AsyncClient, queues: list[str], *, stale_s: float, refresh_s: float) -> None:
        self._client = client
        self._queues = queues
        self._stale_s = stale_s
        self._refresh_s = refresh_s
        self._served: dict[str, ServedModel] = {}
        self._read_at = -float("inf")
        # One refresh at a time, shared: requests that arrive while it runs await the same one, and all get its
        # answer (or its error: during an outage, each a 503 after one failover window, not one after another).
        self._refreshing: asyncio.Task[dict[str, ServedModel]] | None = None

    async def served(self) -> dict[str, ServedModel]:
        """Models of live workers, by id; for one model on several queues, the first configured queue wins."""
        if time.monotonic() - self._read_at < self._refresh_s:
            return self._served
        if self._refreshing is None:
            self._refreshing = asyncio.create_task(self._refresh(), name="llmq-gateway-models")
            self._refreshing.add_done_callback(self._refreshed)
        return await asyncio.shield(self._refreshing)  # a caller that goes away leaves it to the others

    async def _refresh(self) -> dict[str, ServedModel]:
        served: dict[str, ServedModel] = {}
        for queue in self._queues:
            status = await self._client.status(queue=queue, stale_after_s=self._stale_s)
            for model, workers in _by_model(status.workers).items():
                if model not in served:
                    created = min(w.started for w in workers) // 1000
                    served[model] = ServedModel(model, queue, len(workers), created)
        self._served = served
        self._read_at = time.monotonic() if served else -float("inf")
        return served

    def _refreshed(self, task: asyncio.Task[dict[str, ServedModel]]) -> None:
        self._refreshing = None
        if not task.cancelled():
            task.exception()  # retrieved: its awaiters raise it; with none left, nothing logs it as lost

    async def queue_of(self, model: str) -> str | None:
        """The queue serving `model` (or named `model`), None when no configured queue does."""
        served = await self.served()
        if model in served:
            return served[model].queue
        return model if model in self._queues else None


def _by_model(workers: list[WorkerInfo]) -> dict[str, list[WorkerInfo]]:
    grouped: dict[str, list[WorkerInfo]] = {}
    for worker in workers:
        grouped.setdefault(worker.model, []).append(worker)
    return grouped
