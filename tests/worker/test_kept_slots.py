"""Kept slots (`LLMQ_IDLE_TENANT_SLOTS`) in a worker, against a real redis-server: its last free slots go only to
tenants with nothing running, so a quiet tenant's request starts at once while another floods the fleet, without
preempting anyone. The read script's side is in `test_fair_share.py`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from client import AsyncClient
from tests.polling import wait_until
from tests.worker.tenant_support import READERS, check, submit
from worker.config import Settings


def test_kept_slots_must_leave_one_open() -> None:
    with pytest.raises(ValidationError, match="idle_tenant_slots"):
        Settings(_env_file=None, max_running=4, idle_tenant_slots=4)  # type: ignore[call-arg]
    assert Settings(_env_file=None, max_running=4, idle_tenant_slots=3).idle_tenant_slots == 3  # type: ignore[call-arg]


async def test_a_quiet_tenant_starts_at_once_beside_a_flood(
    start_worker: Callable[..., Any], client: AsyncClient, redis: Redis
) -> None:
    """A worker of 4 slots, one kept: a flood runs 3 at a time however much waits, and a request of a tenant with
    nothing running takes the fourth at once, before the flood's fourth starts (no request of the flood ended or
    was preempted for it); then everything finishes, each request once."""
    running = await start_worker(worker_id="kept", max_running=4, idle_tenant_slots=1, step_s=0.01)
    await wait_until(lambda: redis.exists(READERS), 10)
    engine = running.worker.engine
    flood = [await submit(client, "flood", i, tokens=200) for i in range(9)]
    await wait_until(lambda: len(engine.submitted) >= 3, 20)
    await asyncio.sleep(0.2)  # a fourth of the flood's would start now if the kept slot were open to it
    assert len(engine.submitted) == 3 and engine.free_slots() == 1
    quiet = await submit(client, "quiet", 0, tokens=4)
    await check(*quiet)
    assert len(engine.submitted) >= 4 and engine.submitted[3] == quiet[0].id, engine.submitted
    for job in flood:
        await check(*job)
    assert sorted(engine.submitted) == sorted([job.id for job, _, _ in flood] + [quiet[0].id])
