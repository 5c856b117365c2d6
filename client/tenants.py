"""A queue's tenants, for an operator (`llmq tenants`): each tenant's weight in fair share and its requests held
lane by lane, and the writes that set a weight. Weights live in every partition's `Keys.tenant_weights`, which the
workers' read script (`read.lua`) consults each time it moves a held request; see `docs/tenants.md`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from client.admin import Admin
from client.protocol import LANES, is_valid_name

DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1_000_000.0


@dataclass(frozen=True)
class TenantInfo:
    """One tenant: its weight (`DEFAULT_WEIGHT` unless set) and its requests held for fair share, by lane."""

    tenant: str
    weight: float
    held: dict[str, int] = field(default_factory=dict)


def check_weight(weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
        raise ValueError(f"a weight must be a number in (0, {MAX_WEIGHT:g}], not {weight!r}")
    if not math.isfinite(weight):
        raise ValueError(f"a weight must be finite, not {weight!r}")
    return float(weight)


def _check_tenant(tenant: str) -> str:
    if not is_valid_name(tenant):
        raise ValueError(f"tenant {tenant!r} must be 1-128 characters of [A-Za-z0-9._:-]")
    return tenant


class Tenants:
    """The tenants of one queue, over all its partitions."""

    def __init__(self, admin: Admin, queue: str) -> None:
        self._admin = admin
        self._parts = [admin.keys(queue, p) for p in range(admin.partitions)]

    def set_weight(self, tenant: str, weight: float) -> None:
        """Every partition's weight for `tenant`: its share of the fleet against the others' while both have work."""
        tenant, weight = _check_tenant(tenant), check_weight(weight)

        def write() -> None:
            for part in self._parts:  # one key per partition: each its own slot on a Cluster
                self._admin.redis.hset(part.tenant_weights, tenant, repr(weight))

        self._admin.call("a tenant's weight", write)

    def unset_weight(self, tenant: str) -> bool:
        """Gives `tenant` the default weight again; False when it had none set."""
        tenant = _check_tenant(tenant)
        removed = self._admin.call(
            "a tenant's weight", lambda: [self._admin.redis.hdel(part.tenant_weights, tenant) for part in self._parts]
        )
        return any(removed)

    def listing(self) -> list[TenantInfo]:
        """Every tenant with a weight set or requests held now, or that had some since the lane's clock last
        expired, sorted by name."""

        def read() -> list[Any]:
            pipe = self._admin.redis.pipeline(transaction=False)
            for part in self._parts:
                pipe.hgetall(part.tenant_weights)
                for lane in LANES:
                    pipe.zrange(part.fair(lane), 0, -1)
                    pipe.hkeys(part.fair_idle(lane))
            result: list[Any] = pipe.execute()
            return result

        replies = self._admin.call("the tenants", read)
        weights: dict[str, float] = {}
        names: set[str] = set()
        per_part = 1 + 2 * len(LANES)
        for start in range(0, len(replies), per_part):
            for name, value in replies[start].items():
                weights[name.decode()] = float(value)
            for reply in replies[start + 1 : start + per_part]:
                names |= {member.decode() for member in reply if member}
        names |= set(weights)
        ordered = sorted(names)

        def count() -> list[int]:
            pipe = self._admin.redis.pipeline(transaction=False)
            for tenant in ordered:
                for lane in LANES:
                    for part in self._parts:
                        pipe.zlexcount(part.held_order(lane), f"[{tenant}\0", f"({tenant}\1")
            result: list[int] = pipe.execute()
            return result

        counts = iter(self._admin.call("the held requests", count)) if ordered else iter(())
        tenants = []
        for tenant in ordered:
            held: dict[str, int] = {lane: sum(next(counts) for _ in self._parts) for lane in LANES}
            tenants.append(TenantInfo(tenant, weights.get(tenant, DEFAULT_WEIGHT), held))
        return tenants
