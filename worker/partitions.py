"""The partitions of a worker's queue (`LLMQ_QUEUE_PARTITIONS`): one hash slot each, so a hot queue spreads over
the shards of a Redis Cluster. A partition bundles its keys with this worker's intake and leases there; requests
live in the partition of their id (`client.store.partition_of`), and the worker reads every partition and answers
each request in the partition it read it from (so a client whose partition count differs is served, not looped)."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from client.protocol import LANES, Lane
from client.store import Keys, Scripts
from worker.config import Settings
from worker.intake import Intake
from worker.leases import Leases


@dataclass(frozen=True, eq=False)
class Partition:
    """One partition of the queue: its keys, and this worker's intake and per-lane leases there (compared, and
    hashed, by identity: a worker has one of each)."""

    index: int
    keys: Keys
    intake: Intake
    leases: dict[Lane, Leases]


def open_partitions(redis: Redis, settings: Settings, scripts: Scripts) -> list[Partition]:
    """Every partition of the settings' queue, partition 0 (the queue's keys when it has one) first."""
    partitions = []
    for keys in Keys(settings.queue, settings.prefix).partitioned(settings.queue_partitions):
        intake = Intake(
            redis,
            keys,
            settings.worker_id,
            settings.limits,
            settings.dead_letter_maxlen,
            scripts,
            wait_replicas=settings.redis_wait_replicas,
            routing=settings.routing,
            keep=settings.idle_tenant_slots,
        )
        leases = {
            lane: Leases(redis, keys, settings.worker_id, settings.lease_timeout_s, scripts, lane) for lane in LANES
        }
        partitions.append(Partition(keys.partition, keys, intake, leases))
    return partitions


class Partitions:
    """A worker's partitions, and the order it visits them: each read round starts one partition further, so with
    several idle workers every partition has one blocked on it most of the time."""

    def __init__(self, partitions: list[Partition]) -> None:
        self.all = partitions
        self._turn = 0

    def __len__(self) -> int:
        return len(self.all)

    def rotation(self) -> list[Partition]:
        """Every partition, starting one further than the last call did."""
        self._turn = (self._turn + 1) % len(self.all)
        return self.all[self._turn :] + self.all[: self._turn]
