"""Prefix-cache counters (vLLM's prefix_cache_queries / prefix_cache_hits, in prompt tokens): served only where
prefix sharing is on, counted once per request that runs, read back from a worker's registry."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.test_engine import collect, greedy
from worker.engine import Engine, EngineConfig, LoadOptions, load_model
from worker.engine.library import _count_prefix_lookups
from worker.engine.stats import StepCounters
from worker.engine.types import EngineRequest
from worker.metrics import Metrics


def prefix_samples(engine: Any) -> dict[str, float]:
    text = generate_latest(Metrics(engine, "default", "tiny").registry).decode()
    families = text_string_to_metric_families(text)
    return {s.name: s.value for f in families for s in f.samples if s.name.startswith("llmq:prefix_cache")}


async def test_a_repeated_prompt_hits_its_full_pages(model_dir: Path) -> None:
    model, tokenizer = load_model(str(model_dir), LoadOptions(cache_dir=model_dir / "cache"))
    config = EngineConfig(kv_cache_tokens=2048, page_size=16, max_batch_tokens=128, prefix_sharing=True)
    async with Engine(model, tokenizer, config) as engine:
        assert prefix_samples(engine) == {"llmq:prefix_cache_queries_total": 0, "llmq:prefix_cache_hits_total": 0}
        shared = [3 + i % 50 for i in range(40)]  # two full pages of 16, and 8 tokens more
        for index, prompt in enumerate([shared, [7] * 40, shared]):
            await collect(engine.submit(EngineRequest(f"r{index}", input_ids=prompt, params=greedy(4))))
        stats = engine.stats()
        # three prompts of 40 looked up; the repeat found its two full pages (a match never covers a whole prompt)
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (120, 32)
        assert stats.prefill_tokens == 120 - 32  # the hit is not run again
        assert prefix_samples(engine) == {"llmq:prefix_cache_queries_total": 120, "llmq:prefix_cache_hits_total": 32}


async def test_without_prefix_sharing_nothing_is_served(model_dir: Path) -> None:
    model, tokenizer = load_model(str(model_dir), LoadOptions(cache_dir=model_dir / "cache"))
    async with Engine(
        model, tokenizer, EngineConfig(kv_cache_tokens=2048, page_size=16, prefix_sharing=False)
    ) as engine:
        await collect(engine.submit(EngineRequest("r", input_ids=[5] * 40, params=greedy(2))))
        assert engine.stats().prefix_cache_queries is None
        assert prefix_samples(engine) == {}


def test_a_prompt_looked_up_again_while_it_waits_counts_once() -> None:
    """The library's scheduler looks a waiting prompt without a match up again every step it is not scheduled."""
    batch: list[Any] = []
    cache = SimpleNamespace(search_prefix_match=lambda request_id, prompt_ids: 16 if request_id == "b" else 0)
    manager = SimpleNamespace(
        _generation_step=lambda: None,
        batch_processor=SimpleNamespace(inputs_and_outputs=SimpleNamespace(requests_in_batch=batch)),
    )
    counters = StepCounters()
    _count_prefix_lookups(manager, cache, counters)

    def future(request_id: str) -> Any:
        return SimpleNamespace(state=SimpleNamespace(request_id=request_id))

    assert cache.search_prefix_match("a", [1] * 40) == 0
    assert cache.search_prefix_match("b", [1] * 20) == 16
    batch[:] = [future("b")]  # a waits
    manager._generation_step()
    assert cache.search_prefix_match("a", [1] * 40) == 0  # looked up again
    batch[:] = [future("a"), future("b")]
    manager._generation_step()
    manager._generation_step()
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (60, 16)
