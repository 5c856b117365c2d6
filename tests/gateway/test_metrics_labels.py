"""The gateway's metrics by model: a served model's name labels its requests (in flight, answered, timed); a
request naming no served model keeps an empty label, so callers cannot grow the series. Plus the process
collectors, and no `_created` series."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

HI = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, its labels but `le`) -> value."""
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "le")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "le" not in s.labels
    }


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


async def test_requests_are_labelled_by_their_served_model(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway()
    model = await served.model()
    sdk = served.sdk()
    await sdk.chat.completions.create(model=model, messages=HI, max_tokens=2)
    stream = await sdk.chat.completions.create(model=model, messages=HI, max_tokens=2, stream=True)
    assert len([chunk async for chunk in stream]) == 3
    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(model="no-such-model", messages=HI, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await sdk.chat.completions.create(model=model, messages=HI, n=17)  # refused before the model is looked up
    async with served.http() as http:
        text = (await http.get("/metrics")).text
    read = samples(text)
    assert read[key("llmq:gateway_requests_total", route=CHAT, status="200", model=model)] == 2
    assert read[key("llmq:gateway_requests_total", route=CHAT, status="404", model="")] == 1
    assert read[key("llmq:gateway_requests_total", route=CHAT, status="400", model="")] == 1
    assert not [k for k in read if ("model", "no-such-model") in k[1]]  # an unknown name never becomes a label
    assert read[key("llmq:gateway_time_to_first_token_seconds_count", route=CHAT, model=model)] == 1
    assert read[key("llmq:gateway_request_duration_seconds_count", route=CHAT, model=model)] == 2
    assert read[key("llmq:gateway_request_duration_seconds_count", route=CHAT, model="")] == 2
    # in flight: moved to the model once it was known, and back to 0 for both
    assert read[key("llmq:gateway_requests_in_flight", route=CHAT, model=model)] == 0
    assert read[key("llmq:gateway_requests_in_flight", route=CHAT, model="")] == 0
    assert read[key("llmq:gateway_requests_in_flight", route="/metrics", model="")] == 1  # this scrape
    assert read[key("process_resident_memory_bytes")] > 0 and key("python_gc_collections_total", generation="0") in read
    assert "_created" not in text
