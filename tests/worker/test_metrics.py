"""Scrape a running worker's /metrics after it served requests: each metric moved as it should."""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from client import AsyncClient
from tests.polling import wait_until
from worker.embedded_redis import free_port


def scrape(port: int) -> dict[str, float]:
    """Samples by name and labels, e.g. `llmq:request_success_total{finished_reason=length}`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = {k: v for k, v in sample.labels.items() if k not in ("queue", "model_name")}
            label = ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
            samples[f"{sample.name}{{{label}}}" if label else sample.name] = sample.value
            if sample.name.startswith("llmq:"):  # ours; process_* and python_* are the process's
                assert sample.labels.get("queue") == "default" and "model_name" in sample.labels
    return samples


async def test_metrics_follow_what_was_served(start_worker: Any, client: AsyncClient) -> None:
    port = free_port()
    running = await start_worker(metrics_port=port, metrics_address="127.0.0.1")
    prompts = [[3 + i, 4, 5] for i in range(5)]
    jobs = [await client.submit(input_ids=p, max_new_tokens=8, temperature=0, ignore_eos=True) for p in prompts]
    await asyncio.gather(*(job.result(timeout=30) for job in jobs))
    cancelled = await client.submit(input_ids=[9, 9], max_new_tokens=400, temperature=0, ignore_eos=True)
    async for _ in cancelled.stream(timeout=30):
        await cancelled.cancel()

    async def settled() -> bool:  # every request has ended, and a heartbeat has refreshed the queue gauges since
        metrics = await asyncio.to_thread(scrape, port)
        ended = metrics.get("llmq:e2e_request_latency_seconds_count") == 6 and metrics["llmq:num_requests_running"] == 0
        return ended and metrics["llmq:queue_depth{lane=default}"] == metrics["llmq:queue_pending{lane=default}"] == 0

    await wait_until(settled)
    metrics = await asyncio.to_thread(scrape, port)
    stats = running.worker.engine.stats()
    assert metrics["llmq:request_success_total{finished_reason=length}"] == 5
    assert metrics["llmq:request_success_total{finished_reason=cancelled}"] == 1
    assert metrics["llmq:prompt_tokens_total"] == stats.prefill_tokens >= 5 * 3 + 2
    assert metrics["llmq:generation_tokens_total"] == stats.generation_tokens >= 5 * 8
    assert metrics["llmq:engine_steps_total"] == stats.steps > 0
    assert metrics["llmq:batch_fill_ratio_count"] == stats.steps
    assert metrics["llmq:time_to_first_token_seconds_count"] == 6
    assert metrics["llmq:e2e_request_latency_seconds_count"] == 6  # the cancelled one ended too
    assert metrics["llmq:request_queue_time_seconds_count"] == 6
    assert metrics["llmq:inter_token_latency_seconds_count"] >= 5 * 7
    assert metrics["llmq:engine_restarts_total"] == 0 and metrics["llmq:claims_total"] == 0
    published = running.worker.publisher.stats
    assert metrics["llmq:result_events_total"] == published.events >= 6 * 2  # tokens and an end per request
    assert 0 < metrics["llmq:result_flushes_total"] == published.flushes <= published.events
    assert metrics["llmq:fenced_writes_total"] == metrics["llmq:refused_requests_total"] == 0
    # idle again: gauges back to zero
    assert metrics["llmq:num_requests_running"] == metrics["llmq:num_requests_waiting"] == 0
    assert metrics["llmq:kv_cache_usage_perc"] == 0 and metrics["llmq:kv_cache_blocks_total"] == 2048 // 16
    assert metrics["llmq:kv_cache_blocks_reserved"] == 0
    for lane in ("interactive", "default", "batch"):
        gauges = ("queue_depth", "queue_pending", "queue_lag", "backlog_requests", "backlog_tokens")
        assert [metrics[f"llmq:{name}{{lane={lane}}}"] for name in gauges] == [0] * len(gauges)
