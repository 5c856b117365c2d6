"""A queue's tenants, for an operator (`llmq tenants`): each tenant's weight in fair share, its quotas, its requests
held lane by lane and running, and the writes that set a weight or quotas. Weights and quotas live in every
partition's `Keys.tenant_weights` and `Keys.tenant_limits`, which the submit script (`submit.lua`: queued quotas)
and the workers' read script (`read.lua`: running and rate quotas) consult each call; see `docs/tenants.md`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from client.admin import Admin
from client.protocol import LANES, is_valid_name

DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1_000_000.0


MAX_LIMIT = 2**53  # any quota above this is refused: Lua's numbers are doubles


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's quotas on one queue, each optional (None: unlimited). Queued counts what waits for fair share
    (`submit` past either raises `TenantQuotaExceeded`); running, what workers have taken and not finished;
    `tokens_per_minute` (prompt + max_new_tokens, corrected by what was generated) is reserved: within it the
    tenant's requests run before any other tenant's, past it they run only while no one else has work waiting.
    Every partition of the queue applies them on its own."""

    max_queued: int | None = None
    max_queued_tokens: int | None = None
    max_running: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            whole = isinstance(value, int) and not isinstance(value, bool)
            if value is not None and not (whole and 0 < value <= MAX_LIMIT):
                raise ValueError(f"{name} must be a whole number in [1, 2**53], or unset; not {value!r}")

    @property
    def unlimited(self) -> bool:
        return all(value is None for value in asdict(self).values())

    def pack(self) -> str:
        """The form the scripts read: the four numbers in field order, 0 for none."""
        return " ".join(str(value or 0) for value in asdict(self).values())

    @classmethod
    def unpack(cls, packed: bytes | str) -> TenantLimits:
        text = packed.decode() if isinstance(packed, bytes) else packed
        numbers = [int(part) for part in text.split()]
        if len(numbers) != len(fields(cls)):
            raise ValueError(f"not packed limits: {text!r}")
        return cls(*(number or None for number in numbers))


@dataclass(frozen=True)
class TenantInfo:
    """One tenant: its weight (`DEFAULT_WEIGHT` unless set), quotas, requests held for fair share by lane, and
    requests running (moved from held to run and not finished) over every partition."""

    tenant: str
    weight: float
    held: dict[str, int] = field(default_factory=dict)
    limits: TenantLimits = field(default_factory=TenantLimits)
    running: int = 0


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

    def set_limits(self, tenant: str, limits: TenantLimits) -> None:
        """Every partition's quotas for `tenant` (all unset: no quotas)."""
        tenant = _check_tenant(tenant)

        def write() -> None:
            for part in self._parts:
                if limits.unlimited:
                    self._admin.redis.hdel(part.tenant_limits, tenant)
                else:
                    self._admin.redis.hset(part.tenant_limits, tenant, limits.pack())

        self._admin.call("a tenant's quotas", write)

    def limits(self, tenant: str) -> TenantLimits:
        """`tenant`'s quotas (as the first partition holds them: `set_limits` writes every one alike)."""
        packed = self._admin.call(
            "a tenant's quotas", lambda: self._admin.redis.hget(self._parts[0].tenant_limits, tenant)
        )
        return TenantLimits() if packed is None else TenantLimits.unpack(packed)

    def unset_weight(self, tenant: str) -> bool:
        """Gives `tenant` the default weight again; False when it had none set."""
        tenant = _check_tenant(tenant)
        removed = self._admin.call(
            "a tenant's weight", lambda: [self._admin.redis.hdel(part.tenant_weights, tenant) for part in self._parts]
        )
        return any(removed)

    def listing(self) -> list[TenantInfo]:
        """Every tenant with a weight or quotas set or requests held now, or that had some since the lane's clock
        last expired, sorted by name."""

        def read() -> list[Any]:
            pipe = self._admin.redis.pipeline(transaction=False)
            for part in self._parts:
                pipe.hgetall(part.tenant_weights)
                pipe.hgetall(part.tenant_limits)
                pipe.hgetall(part.tenant_counts)
                for lane in LANES:
                    pipe.zrange(part.fair(lane), 0, -1)
                    pipe.hkeys(part.fair_idle(lane))
            result: list[Any] = pipe.execute()
            return result

        state = _State.merge(self._admin.call("the tenants", read), 3 + 2 * len(LANES))
        ordered = sorted(state.names)

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
            weight, quotas = state.weights.get(tenant, DEFAULT_WEIGHT), state.limits.get(tenant, TenantLimits())
            tenants.append(TenantInfo(tenant, weight, held, quotas, state.running.get(tenant, 0)))
        return tenants


@dataclass
class _State:
    """What `Tenants.listing` read of every partition, summed."""

    weights: dict[str, float] = field(default_factory=dict)
    limits: dict[str, TenantLimits] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)

    @classmethod
    def merge(cls, replies: list[Any], per_part: int) -> _State:
        """Per partition: weights, limits, counts, then each lane's fair queue and idle tenants."""
        state = cls()
        for start in range(0, len(replies), per_part):
            weights, limits, counts, *lanes = replies[start : start + per_part]
            state.weights |= {name.decode(): float(value) for name, value in weights.items()}
            state.limits |= {name.decode(): TenantLimits.unpack(value) for name, value in limits.items()}
            for name, value in counts.items():
                tenant, _, what = name.decode().partition("|")
                if what == "running":
                    state.running[tenant] = state.running.get(tenant, 0) + max(0, int(value))
            for reply in lanes:
                state.names |= {member.decode() for member in reply if member}
        state.names |= set(state.weights) | set(state.limits) | {name for name, n in state.running.items() if n}
        return state
