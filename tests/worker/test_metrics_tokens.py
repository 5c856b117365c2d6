"""Token counts as a scrape of a worker on the real engine (tiny model) reads them: every generated token counted
(vLLM's generation_tokens_total), tokens per step (iteration_tokens_total), the engine paths that ran."""

from __future__ import annotations

import asyncio
from typing import Any

from client import AsyncClient
from tests.polling import wait_until
from tests.worker.test_metrics import scrape
from worker.embedded_redis import free_port


async def test_generation_tokens_count_every_token_the_first_included(start_worker: Any, client: AsyncClient) -> None:
    port = free_port()
    running = await start_worker(real_model=True, metrics_port=port, metrics_address="127.0.0.1")
    jobs = [
        await client.submit(input_ids=[5, 6, 7, 8], max_new_tokens=6, temperature=0, ignore_eos=True),
        await client.submit(input_ids=[9, 10], max_new_tokens=3, temperature=0, ignore_eos=True),
    ]
    results = await asyncio.gather(*(job.result(timeout=60) for job in jobs))
    assert [len(result.token_ids) for result in results] == [6, 3]

    async def ended() -> bool:
        metrics = await asyncio.to_thread(scrape, port)
        return metrics.get("llmq:request_success_total{finished_reason=length}") == 2

    await wait_until(ended)
    metrics = await asyncio.to_thread(scrape, port)
    stats = running.worker.engine.stats()
    # 6 + 3: each request's first token came out of its prefill step, the other 5 + 2 out of decode steps
    assert metrics["llmq:generation_tokens_total"] == stats.generation_tokens == 9
    assert stats.decode_tokens == 7
    assert metrics["llmq:prompt_tokens_total"] == 4 + 2
    # vLLM's iteration tokens: every step's prompt tokens plus the tokens it generated, 6 + 9 here
    assert metrics["llmq:iteration_tokens_total_sum"] == 6 + 9
    assert metrics["llmq:iteration_tokens_total_count"] == metrics["llmq:engine_steps_total"] == stats.steps
    assert metrics["llmq:iteration_tokens_total_bucket{le=1.0}"] <= stats.steps
    # a C compiler is on this machine (and CI's): the native kernels run
    assert metrics["llmq:engine_path{component=paged_decode,kernel=compiled}"] == 1
    assert metrics["llmq:engine_path{component=attention,kernel=varlen}"] == 1
    # prefix caching is on by default: both prompts looked up, nothing found (neither fills a page)
    assert metrics["llmq:prefix_cache_queries_total"] == 4 + 2
    assert metrics["llmq:prefix_cache_hits_total"] == 0
