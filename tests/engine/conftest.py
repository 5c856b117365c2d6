from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from testing.tiny_models import save_tiny_model
from worker.engine.core import Engine, EngineConfig
from worker.engine.loader import LoadOptions, load_model


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama-only"), "llama")


def load(folder: Path) -> tuple[Any, Any]:
    return load_model(str(folder), LoadOptions(cache_dir=folder / "cache"))


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Any]]:
    """Starts engines on a model folder; each is closed after the test."""
    engines: list[Engine] = []

    async def start(folder: Path, model: Any = None, tokenizer: Any = None, **sizing: Any) -> Engine:
        if model is None:
            model, tokenizer = load(folder)
        config = EngineConfig(**{"kv_cache_tokens": 4096, "page_size": 16, "max_batch_tokens": 128, **sizing})
        engine = await Engine(model, tokenizer, config).start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.close()


def reference_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """`model.generate`, one prompt at a time (no padding), stopping at EOS like the engine."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens, attention_mask=None
        )
    return out[0, len(prompt_ids) :].tolist()


def record_rows(monkeypatch: pytest.MonkeyPatch, kernel: type, method: str) -> list[int]:
    """Patches `kernel.method` (a native kernel's call, whose first argument is its rows) to note each call's row
    count in the returned list, then call through."""
    rows_seen: list[int] = []
    call = getattr(kernel, method)

    def recorded(self: Any, rows: torch.Tensor, *args: Any) -> Any:
        rows_seen.append(rows.shape[0])
        return call(self, rows, *args)

    monkeypatch.setattr(kernel, method, recorded)
    return rows_seen
