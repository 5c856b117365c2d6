"""Usage per tenant (`llmq usage`, `client.usage`): counted in the script call that writes a request's final event,
so once per request, with the clients' own figures, across preemptions, resumes and a worker that dies mid-run."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from contextlib import closing, suppress
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from client import AsyncClient, Cancelled
from client.admin import Admin
from client.usage import TenantUsage, read_usage
from tests.polling import wait_until

TIMEOUT_S = 60


def usage_by_tenant(redis_url: str) -> dict[str, TenantUsage]:
    with closing(Admin(redis_url)) as admin:
        return {one.tenant: one for one in read_usage(admin, "default", 3600)}


def expected(results: list[tuple[str, Any]]) -> dict[str, tuple[Counter[str], int, int]]:
    """Per tenant, from what the clients saw: requests by finish reason, prompt tokens, generated tokens."""
    seen: dict[str, tuple[Counter[str], int, int]] = {}
    for tenant, result in results:
        outcomes, prompt, generated = seen.get(tenant, (Counter(), 0, 0))
        outcomes[result.finish_reason] += 1
        seen[tenant] = (outcomes, prompt + result.usage.prompt_tokens, generated + result.usage.completion_tokens)
    return seen


def assert_usage_is(redis_url: str, results: list[tuple[str, Any]]) -> None:
    counted = usage_by_tenant(redis_url)
    want = expected(results)
    assert set(counted) == set(want)
    for tenant, (outcomes, prompt, generated) in want.items():
        one = counted[tenant]
        assert (Counter(one.requests), one.prompt_tokens, one.generated_tokens) == (outcomes, prompt, generated), tenant
        assert one.queue_wait_s >= 0 and one.generation_s > 0


async def test_each_request_counts_once_for_its_tenant(
    start_worker: Callable[..., Any], client: AsyncClient, redis_url: str
) -> None:
    workers = [await start_worker(worker_id="u1"), await start_worker(worker_id="u2")]
    rng = random.Random(31)
    jobs = []
    for i in range(30):
        tenant = "alpha" if i % 3 else "beta"
        prompt = "x" * rng.randint(1, 60)
        jobs.append((tenant, await client.submit(prompt, max_new_tokens=rng.randint(1, 12), tenant=tenant)))
    results = [(tenant, await job.result(timeout=TIMEOUT_S)) for tenant, job in jobs]
    assert_usage_is(redis_url, results)
    assert usage_by_tenant(redis_url)["alpha"].total_requests == 20
    # each worker's metrics count what it ended, by tenant: together, the clients' figures
    requests, tokens = Counter[str](), Counter[str]()
    for running in workers:
        for family in text_string_to_metric_families(generate_latest(running.worker.metrics.registry).decode()):
            for sample in family.samples:
                if sample.name == "llmq:tenant_requests_total":
                    requests[sample.labels["tenant"]] += int(sample.value)
                elif sample.name == "llmq:tenant_tokens_total" and sample.labels["kind"] == "generated":
                    tokens[sample.labels["tenant"]] += int(sample.value)
    assert requests == {"alpha": 20, "beta": 10}
    assert tokens["beta"] == sum(r.usage.completion_tokens for t, r in results if t == "beta")


async def test_cancelled_and_failed_requests_count_by_outcome(
    start_worker: Callable[..., Any], client: AsyncClient, redis_url: str
) -> None:
    running = await start_worker(step_s=0.05)
    slow = await client.submit("long", max_new_tokens=200, tenant="gamma")
    await wait_until(lambda: running.worker.publisher.stats.tokens > 0, 10)
    await slow.cancel()
    with suppress(Cancelled):
        await slow.result(timeout=TIMEOUT_S)
    done = await (await client.submit("short", max_new_tokens=2, tenant="gamma")).result(timeout=TIMEOUT_S)
    counted = usage_by_tenant(redis_url)["gamma"]
    assert counted.requests == {"cancelled": 1, done.finish_reason: 1}
    assert counted.generated_tokens >= done.usage.completion_tokens + 1  # what the cancelled one generated too


async def test_a_preempted_request_counts_once_when_it_resumes(
    start_worker: Callable[..., Any], client: AsyncClient, redis_url: str
) -> None:
    """One slot: an `interactive` request preempts a `batch` one, which resumes (on the same worker) and ends."""
    await start_worker(step_s=0.02, max_running=1, lane_share=0, max_preemptions=1)
    long = await client.submit("batch work", max_new_tokens=60, tenant="batchy", priority="batch")
    await asyncio.sleep(0.3)
    urgent = await client.submit("now", max_new_tokens=3, tenant="chatty", priority="interactive")
    results = [("chatty", await urgent.result(timeout=TIMEOUT_S)), ("batchy", await long.result(timeout=TIMEOUT_S))]
    assert results[1][1].usage.completion_tokens == 60
    assert_usage_is(redis_url, results)


async def test_a_worker_that_dies_mid_run_leaves_usage_exact(
    start_worker: Callable[..., Any], client: AsyncClient, redis_url: str
) -> None:
    quick = {"lease_timeout_s": 1.0, "lease_renew_s": 0.2, "claim_interval_s": 0.2, "step_s": 0.01}
    victim = await start_worker(worker_id="dies", **quick)
    await start_worker(worker_id="lives", **quick)
    jobs = [("delta", await client.submit(f"q{i}", max_new_tokens=40, tenant="delta")) for i in range(12)]
    await wait_until(lambda: victim.worker.engine.stats().running > 0, 10)
    while not victim.task.done():  # gone without a word: its leases run out and the other worker resumes its work
        victim.task.cancel()
        await asyncio.sleep(0.05)
    results = [(tenant, await job.result(timeout=TIMEOUT_S)) for tenant, job in jobs]
    assert_usage_is(redis_url, results)
    assert usage_by_tenant(redis_url)["delta"].total_requests == 12
