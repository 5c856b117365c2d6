"""Per-request features of the sampler on a tiny model: seeds, log-probabilities, response formats, penalties.
Each is checked against a reference computed directly from the model, beside other requests in one batch."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tests.engine.conftest import load
from worker.engine import EngineRequest, Finish, GenerationParams, OutputDelta, RequestRejected, RequestStream, Resume
from worker.engine.constraints import json_schema_format
from worker.engine.inputs import PreparedRequest
from worker.engine.rows import token_seed
from worker.engine.types import OutputFormat, TokenLogprob

PROMPT = [5, 6, 7]


async def run(engine: Any, request_id: str, params: GenerationParams, **fields: Any) -> tuple[list[int], list[Any]]:
    stream = engine.submit(EngineRequest(request_id, input_ids=fields.pop("ids", PROMPT), params=params, **fields))
    tokens, logprobs = [], []
    async for delta in stream:
        tokens += delta.token_ids
        logprobs += delta.logprobs or []
    return tokens, logprobs


def crowd(engine: Any, count: int) -> list[Any]:
    """Unseeded sampled requests of other lengths, to share the batch with."""
    return [
        run(
            engine,
            f"other-{i}",
            GenerationParams(max_new_tokens=10 + i % 7, temperature=1.0, ignore_eos=True),
            ids=[9 + i, 3, 4 + i % 5],
        )
        for i in range(count)
    ]


async def test_a_seed_gives_the_same_tokens_alone_in_a_crowd_and_after_a_resume(
    llama_dir: Path, make_engine: Any
) -> None:
    engine = await make_engine(llama_dir, max_running=32, kv_cache_tokens=8192)
    seeded = GenerationParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone, _ = await run(engine, "alone", seeded)
    in_crowd, *_ = await asyncio.gather(run(engine, "crowd", seeded), *crowd(engine, 31))
    text = engine.tokenizer.decode(alone[:10], skip_special_tokens=True)
    resumed, _ = await run(engine, "resumed", seeded, resume=Resume(alone[:10], text))
    other, _ = await run(engine, "other-seed", GenerationParams(**{**_fields(seeded), "seed": 43}))
    assert in_crowd[0] == alone and alone[10:] == resumed
    assert other != alone


def _fields(params: GenerationParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__slots__}  # type: ignore[attr-defined]


def test_seeds_of_nearby_positions_and_values_are_unrelated() -> None:
    seeds = {token_seed(seed, position) for seed in range(50) for position in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**63 for s in seeds)
    assert token_seed(-1, 0) != token_seed(2**64 - 1, 1)


def direct_logprobs(model: Any, prefix: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prefix])).logits[0, -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


async def test_logprobs_equal_the_models_own_for_greedy_and_sampled_rows_in_one_batch(
    llama_dir: Path, make_engine: Any
) -> None:
    model, _ = load(llama_dir)  # the reference's own copy: the engine switches its model's attention
    engine = await make_engine(llama_dir, max_running=8)
    greedy = GenerationParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    sampled = GenerationParams(max_new_tokens=8, temperature=0.7, seed=7, ignore_eos=True, logprobs=3)
    (greedy_ids, greedy_lps), (sampled_ids, sampled_lps), *_ = await asyncio.gather(
        run(engine, "greedy", greedy), run(engine, "sampled", sampled, ids=[8, 9, 10]), *crowd(engine, 4)
    )
    for ids, lps, prompt, temperature, alternatives in (
        (greedy_ids, greedy_lps, PROMPT, 1.0, 5),
        (sampled_ids, sampled_lps, [8, 9, 10], 0.7, 3),
    ):
        assert len(lps) == len(ids) == 8
        for position, (token, reported) in enumerate(zip(ids, lps, strict=True)):
            expected = direct_logprobs(model, prompt + ids[:position], temperature)
            assert reported.logprob == pytest.approx(float(expected[token]), abs=1e-4)
            top = torch.topk(expected, alternatives)
            assert [alt for alt, _ in reported.top] == top.indices.tolist()
            assert [lp for _, lp in reported.top] == pytest.approx(top.values.tolist(), abs=1e-4)


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["ok", "n", "kind"],
    "additionalProperties": False,
}


async def test_response_formats_hold_in_a_mixed_batch_and_a_bad_schema_is_refused_alone(
    llama_dir: Path, make_engine: Any
) -> None:
    engine = await make_engine(llama_dir, max_running=16)
    constrained = [
        run(
            engine,
            f"schema-{i}",
            GenerationParams(max_new_tokens=64, temperature=t, seed=i, output_format=json_schema_format(SCHEMA)),
            ids=[5 + i, 6],
        )
        for i, t in enumerate([0, 0.8, 0, 1.2])
    ]
    regex = run(engine, "regex", GenerationParams(max_new_tokens=16, output_format=OutputFormat("regex", "[0-9]{3}")))
    json_object = run(
        engine, "object", GenerationParams(max_new_tokens=200, temperature=0, output_format=OutputFormat("json_object"))
    )
    with pytest.raises(RequestRejected, match="does not compile"):
        engine.submit(
            EngineRequest(
                "bad", input_ids=PROMPT, params=GenerationParams(output_format=json_schema_format({"type": "nonsense"}))
            )
        )
    results = await asyncio.gather(*constrained, regex, json_object, *crowd(engine, 6))
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for tokens, _ in results[:4]:
        jsonschema.validate(json.loads(decode(tokens)), SCHEMA)
    assert decode(results[4][0]).isdigit() and len(decode(results[4][0])) == 3
    assert results[4][0][-1] in engine.eos_token_ids  # the grammar ended, so the request did, with EOS


def reference_penalized(
    model: Any, prompt: list[int], count: int, repetition: float, presence: float, frequency: float
) -> list[int]:
    """Greedy decoding with the penalties applied by hand, one full forward per token."""
    output: list[int] = []
    for _ in range(count):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        for token in set(prompt) | set(output):
            value = logits[token]
            logits[token] = value * repetition if value < 0 else value / repetition
        for token, times in Counter(output).items():
            logits[token] -= frequency * times + presence
        output.append(int(logits.argmax()))
    return output


@pytest.mark.parametrize(("repetition", "presence", "frequency"), [(1.3, 0.0, 0.0), (1.0, 0.5, 1.0), (2.0, 1.0, 0.5)])
async def test_penalties_match_a_reference_implementation(
    llama_dir: Path, make_engine: Any, repetition: float, presence: float, frequency: float
) -> None:
    model, _ = load(llama_dir)  # the reference's own copy: the engine switches its model's attention
    engine = await make_engine(llama_dir)
    params = GenerationParams(
        max_new_tokens=24,
        temperature=0,
        ignore_eos=True,
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    (penalized, _), (plain, _), *_ = await asyncio.gather(
        run(engine, "penalized", params),
        run(engine, "plain", GenerationParams(max_new_tokens=24, temperature=0, ignore_eos=True)),
        *crowd(engine, 3),
    )
    assert penalized == reference_penalized(model, PROMPT, 24, repetition, presence, frequency)
    assert len(set(penalized)) >= len(set(plain))  # fewer repeats, never more


async def test_a_slow_reader_gets_one_merged_delta_with_every_tokens_logprob() -> None:
    prepared = PreparedRequest("r", [1], GenerationParams(logprobs=0), prompt_tokens=1)
    stream = RequestStream(prepared, detokenizer=None, kv_blocks=1)  # type: ignore[arg-type]
    stream.put(OutputDelta("r", [5], "a", logprobs=[TokenLogprob(-0.1, [])]))
    stream.put(OutputDelta("r", [6, 7], "bc", Finish.LENGTH, logprobs=[TokenLogprob(-0.2, []), TokenLogprob(-0.3, [])]))
    (delta,) = [delta async for delta in stream]
    assert delta.token_ids == [5, 6, 7] and delta.text == "abc" and delta.finish_reason == Finish.LENGTH
    assert [lp.logprob for lp in delta.logprobs or []] == [-0.1, -0.2, -0.3]
