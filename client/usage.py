"""Each tenant's usage of a queue, for an operator (`llmq usage`): requests by outcome, prompt and generated tokens,
queue-wait and generation seconds, summed over the hours asked for and every partition. Workers count them in
`Keys.usage`'s hourly hashes, in the same script call that writes a request's final event (`publish.lua`), so each
request counts once, however often it was resumed or its final event sent."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from client.admin import Admin
from client.scripts import USAGE_COUNTS, USAGE_REQUESTS

MAX_HOURS = 24 * 3650  # the longest `since` there is anything to read for (a usage TTL is at most ten years)


@dataclass
class TenantUsage:
    """One tenant's usage of one queue over a span of hours."""

    tenant: str
    requests: dict[str, int] = field(default_factory=dict)  # by outcome: a finish reason, or "error:<code>"
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_wait_s: float = 0.0
    generation_s: float = 0.0

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())


def read_usage(admin: Admin, queue: str, since_s: float, tenant: str | None = None) -> list[TenantUsage]:
    """The tenants' usage in the hours that overlap the last `since_s` seconds (whole hours: the current one and
    as many before it as the span reaches), every partition summed, sorted by tenant; only `tenant`'s if named."""
    now_hour = int(time.time()) // 3600
    hours = range(max(0, now_hour - min(MAX_HOURS, int(since_s // 3600))), now_hour + 1)
    parts = [admin.keys(queue, p) for p in range(admin.partitions)]

    def read() -> list[Any]:
        pipe = admin.redis.pipeline(transaction=False)
        for part in parts:
            for hour in hours:
                pipe.hgetall(part.usage(hour))
        result: list[Any] = pipe.execute()
        return result

    found: dict[str, TenantUsage] = {}
    for counts in admin.call("the usage", read):
        for raw_field, raw_value in counts.items():
            name, _, what = raw_field.decode().partition("|")
            if tenant is not None and name != tenant:
                continue
            usage = found.setdefault(name, TenantUsage(name))
            _add(usage, what, int(raw_value))
    return [found[name] for name in sorted(found)]


def _add(usage: TenantUsage, what: str, value: int) -> None:
    kind, _, outcome = what.partition("|")
    if kind == USAGE_REQUESTS and outcome:
        usage.requests[outcome] = usage.requests.get(outcome, 0) + value
        return
    prompt, generated, waited, generating = USAGE_COUNTS
    if what == prompt:
        usage.prompt_tokens += value
    elif what == generated:
        usage.generated_tokens += value
    elif what == waited:
        usage.queue_wait_s += value / 1000
    elif what == generating:
        usage.generation_s += value / 1000
