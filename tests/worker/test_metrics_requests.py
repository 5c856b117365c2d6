"""The per-request histograms (vLLM's request_* series) as the relay observes them, read back from the registry."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from testing.scripted_engine import ScriptedEngine
from worker.metrics import Metrics

REQUEST_HISTOGRAMS = {
    "request_prompt_tokens": "llmq:request_prompt_tokens",
    "request_generation_tokens": "llmq:request_generation_tokens",
    "request_prefill_time": "llmq:request_prefill_time_seconds",
    "request_decode_time": "llmq:request_decode_time_seconds",
    "request_inference_time": "llmq:request_inference_time_seconds",
}


def samples(metrics: Metrics) -> dict[tuple[str, str], float]:
    """(sample name, `le` or "") -> value, asserting every sample carries the worker's queue and model labels."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name.startswith("llmq:request_"):
                assert (sample.labels["queue"], sample.labels["model_name"]) == ("q1", "tiny")
                out[(sample.name, sample.labels.get("le", ""))] = sample.value
    return out


@pytest.mark.parametrize(("attribute", "name"), sorted(REQUEST_HISTOGRAMS.items()))
def test_request_histogram_counts_what_is_observed(attribute: str, name: str) -> None:
    metrics = Metrics(ScriptedEngine(), "q1", "tiny")
    for value in (3, 0.4, 2000):
        getattr(metrics, attribute).observe(value)
    read = samples(metrics)
    assert read[(f"{name}_count", "")] == 3
    assert read[(f"{name}_sum", "")] == pytest.approx(2003.4)
    assert read[(f"{name}_bucket", "+Inf")] == 3
    assert read[(f"{name}_bucket", "5.0")] == 2  # 0.4 and 3 fall in the 5 bucket, 2000 above it


def test_request_token_buckets_are_vllm_1_2_5() -> None:
    read = samples(Metrics(ScriptedEngine(), "q1", "tiny"))
    bounds = [le for (name, le) in read if name == "llmq:request_prompt_tokens_bucket"]
    assert bounds[:7] == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0"] and bounds[-1] == "+Inf"
