"""Bad input never reaches the library's thread: each gets a clear `RequestRejected`, and requests in flight
finish untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import load
from tests.engine.test_engine import collect, greedy, tokens_of
from worker.engine.errors import RequestRejected
from worker.engine.types import EngineRequest, GenerationParams


def with_params(**params: Any) -> EngineRequest:
    return EngineRequest("x", input_ids=[3], params=GenerationParams(**params))


BAD_REQUESTS = {
    "empty prompt": (EngineRequest("x", prompt="", params=greedy(4)), "empty"),
    "empty ids": (EngineRequest("x", input_ids=[], params=greedy(4)), "empty"),
    "id outside vocab": (EngineRequest("x", input_ids=[3, 10**6], params=greedy(4)), "outside the vocabulary"),
    "negative id": (EngineRequest("x", input_ids=[-1], params=greedy(4)), "outside the vocabulary"),
    "ids not ints": (EngineRequest("x", input_ids=[1.5], params=greedy(4)), "list of integers"),  # type: ignore[list-item]
    "two sources": (EngineRequest("x", prompt="a", input_ids=[3], params=greedy(4)), "exactly one"),
    "no source": (EngineRequest("x", params=greedy(4)), "exactly one"),
    "over context": (EngineRequest("x", input_ids=[3] * 1000, params=greedy(100)), "context"),
    "over kv cache": (EngineRequest("x", input_ids=[3] * 200, params=greedy(500)), "KV cache"),
    "zero max tokens": (with_params(max_new_tokens=0), "max_new_tokens"),
    "bool max tokens": (
        with_params(max_new_tokens=True),
        "max_new_tokens",
    ),
    "negative temperature": (with_params(temperature=-0.5), "temperature"),
    "string temperature": (with_params(temperature="hot"), "temperature"),  # type: ignore[arg-type]
    "nan temperature": (
        with_params(temperature=float("nan")),
        "temperature",
    ),
    "top_p zero": (with_params(top_p=0.0), "top_p"),
    "top_k negative": (with_params(top_k=-1), "top_k"),
    "top_k over int32": (with_params(top_k=2**31), "top_k"),
    "temperature too high": (with_params(temperature=1e3), "temperature"),
    "max tokens absurd": (
        with_params(max_new_tokens=2**40),
        "max_new_tokens",
    ),
    "empty stop": (with_params(stop=("",)), "stop"),
    "bad messages": (EngineRequest("x", messages=[{"role": "user"}], params=greedy(4)), "content"),
}


async def test_each_bad_input_is_rejected_and_in_flight_requests_survive(llama_dir: Path, make_engine: Any) -> None:
    # A KV cache of 512 tokens with a context of 1024: both length limits are reachable.
    engine = await make_engine(llama_dir, kv_cache_tokens=512)
    good = [
        engine.submit(EngineRequest(f"good{i}", input_ids=[3 + i, 4, 5], params=greedy(40, ignore_eos=True)))
        for i in range(3)
    ]
    await asyncio.sleep(0.05)  # the good requests are decoding now
    for name, (request, message) in BAD_REQUESTS.items():
        with pytest.raises(RequestRejected, match=message):
            engine.submit(request)
        assert engine.stats().restarts == 0, name
    outputs = await asyncio.gather(*(collect(s) for s in good))
    assert [len(tokens_of(o)) for o in outputs] == [40, 40, 40]


async def test_duplicate_request_id_is_rejected(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    stream = engine.submit(EngineRequest("same", input_ids=[3, 4], params=greedy(20)))
    with pytest.raises(RequestRejected, match="already"):
        engine.submit(EngineRequest("same", input_ids=[3, 4], params=greedy(20)))
    assert (await collect(stream))[-1].finished


async def test_model_without_chat_template(llama_dir: Path, make_engine: Any) -> None:
    model, tokenizer = load(llama_dir)
    tokenizer.chat_template = None
    engine = await make_engine(llama_dir, model, tokenizer)
    with pytest.raises(RequestRejected, match="chat template"):
        engine.submit(EngineRequest("x", messages=[{"role": "user", "content": "hi"}], params=greedy(4)))


# Values at the protocol's bounds: each once killed the library's thread, or would have.
AT_THE_BOUNDS = {
    "denormal temperature": GenerationParams(max_new_tokens=8, temperature=5e-324),
    "tiny temperature": GenerationParams(max_new_tokens=8, temperature=1e-300),
    "just under greedy": GenerationParams(max_new_tokens=8, temperature=0.0099),
    "smallest sampled": GenerationParams(max_new_tokens=8, temperature=0.01),
    "largest temperature": GenerationParams(max_new_tokens=8, temperature=100.0),
    "largest top_k": GenerationParams(max_new_tokens=8, temperature=1.0, top_k=2**31 - 1),
    "denormal top_p": GenerationParams(max_new_tokens=8, temperature=1.0, top_p=5e-324),
    "tiny top_p, tiny temperature": GenerationParams(max_new_tokens=8, temperature=0.01, top_p=1e-300, top_k=1),
    "all at their edges": GenerationParams(max_new_tokens=8, temperature=100.0, top_p=5e-324, top_k=2**31 - 1),
}


async def test_values_at_the_bounds_run_in_one_batch_without_killing_the_engine(
    llama_dir: Path, make_engine: Any
) -> None:
    engine = await make_engine(llama_dir)
    reference = tokens_of(await collect(engine.submit(EngineRequest("ref", input_ids=[3, 4, 5], params=greedy(8)))))
    streams = {
        name: engine.submit(EngineRequest(f"edge{i}", input_ids=[3, 4, 5], params=params))
        for i, (name, params) in enumerate(AT_THE_BOUNDS.items())
    }
    outputs = dict(zip(streams, await asyncio.gather(*(collect(s) for s in streams.values())), strict=True))
    for name, output in outputs.items():
        assert 1 <= len(tokens_of(output)) <= 8, name
    for name in ("denormal temperature", "tiny temperature", "just under greedy"):
        assert tokens_of(outputs[name]) == reference, f"{name} must decode greedily"
    assert engine.stats().restarts == 0
