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
    one status round trip per refresh, not one per request). A queue's name is also accepted as a model id,
    so callers can address a queue whose workers have not started yet (the queue holds the work)."""

    def __init__(self, client: AsyncClient, queues: list[str], *, stale_s: float, refresh_s: float) -> None:
        self._client = client
        self._queues = queues
        self._stale_s = stale_s
        self._refresh_s = refresh_s
        self._served: dict[str, ServedModel] = {}
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()  # one refresh at a time; the requests that arrive meanwhile reuse it

    async def served(self) -> dict[str, ServedModel]:
        """Models of live workers, by id; for one model on several queues, the first configured queue wins."""
        async with self._lock:
            if time.monotonic() - self._read_at >= self._refresh_s:
                served: dict[str, ServedModel] = {}
                for queue in self._queues:
                    status = await self._client.status(queue=queue, stale_after_s=self._stale_s)
                    for model, workers in _by_model(status.workers).items():
                        if model not in served:
                            created = min(w.started for w in workers) // 1000
                            served[model] = ServedModel(model, queue, len(workers), created)
                self._served, self._read_at = served, time.monotonic()
        return self._served

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
