"""A call's `n` choices through the whole service: they enter the queue together, so of two idle workers one takes
them all, and it computes their shared prompt once (prefix caching, on by default)."""

from __future__ import annotations

from typing import Any

import pytest

from client import AsyncChoices, AsyncClient
from tests.polling import wait_until

pytestmark = pytest.mark.redis

PAGE = 16  # `worker_settings`' page size
PROMPT = [3 + i % 90 for i in range(70)]  # four full pages and 6 tokens


async def test_one_worker_takes_every_choice_and_prefills_their_prompt_once(
    start_worker: Any, client: AsyncClient
) -> None:
    workers = [await start_worker(real_model=True) for _ in range(2)]
    job = await client.submit(input_ids=PROMPT, n=4, seed=3, temperature=0.8, max_new_tokens=5)
    assert isinstance(job, AsyncChoices)
    result = await job.result(timeout=60)
    assert result.choices is not None and len(result.choices) == 4
    stats = [running.worker.engine.stats() for running in workers]
    served = [sum(s.requests_finished.values()) for s in stats]
    assert sorted(served) == [0, 4], served  # one worker read all four
    busy = stats[served.index(4)]
    assert busy.prefill_tokens == len(PROMPT) + 3 * (len(PROMPT) - 4 * PAGE)  # the full pages computed once
    assert busy.prefix_cache_hits == 3 * 4 * PAGE
    assert result.usage.prompt_tokens == len(PROMPT) and result.usage.completion_tokens == 4 * 5

    async def status_shows_the_hits() -> bool:  # `llmq status`'s per-worker hit rate reads these
        caches = (await client.status()).prefix_caches
        hits = sorted(
            caches[w.worker.settings.worker_id].hits for w in workers if w.worker.settings.worker_id in caches
        )
        return hits == [0, 3 * 4 * PAGE]

    await wait_until(status_shows_the_hits)
