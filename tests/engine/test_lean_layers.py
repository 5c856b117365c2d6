"""Lean decoder layers: the same bits as the library's layers, installed only where they apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from testing.tiny_models import save_tiny_model
from tests.engine.conftest import load, reference_greedy
from tests.engine.test_engine import collect, greedy, mixed_prompts, tokens_of
from worker.engine import lean_layers
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import StackedLinears
from worker.engine.types import EngineRequest


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp(f"lean-{request.param}"), request.param)


async def _one_at_a_time(engine: Any, workload: list[tuple[list[int], int]]) -> list[tuple[list[int], list[float]]]:
    """Tokens and chosen-token logprobs of each request run alone (so every run batches the same way); prompts
    longer than the token budget are prefilled in chunks after cached context."""
    results = []
    for index, (ids, n) in enumerate(workload):
        deltas = await collect(engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n, logprobs=0))))
        logprobs = [entry.logprob for delta in deltas for entry in delta.logprobs or []]
        results.append((tokens_of(deltas), logprobs))
    return results


async def test_lean_layers_give_the_library_layers_bits(
    arch_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = load(arch_dir)
    lean_engine = await make_engine(arch_dir, model, tokenizer, max_batch_tokens=32)
    workload = [*mixed_prompts(lean_engine.vocab_size, count=5, seed=8), (list(range(3, 120)), 12)]
    assert all("forward" in vars(layer) for layer in model.model.layers)
    lean = await _one_at_a_time(lean_engine, workload)
    await lean_engine.close()
    assert not any("forward" in vars(layer) for layer in model.model.layers), "closing gives the layers back"

    monkeypatch.setattr(lean_layers, "install", lambda model: False)
    library = await _one_at_a_time(await make_engine(arch_dir, model, tokenizer, max_batch_tokens=32), workload)
    assert lean == library  # tokens and float logprobs, exactly
    reference_model, _ = load(arch_dir)
    for (ids, n), (tokens, _) in zip(workload, lean, strict=True):
        assert tokens == reference_greedy(reference_model, ids, n)


def test_other_callers_run_the_library_layer(llama_dir: Path) -> None:
    """Installed lean layers serve only the engine's steps: a plain forward (as in `generate`) is unchanged."""
    model, _ = load(llama_dir)
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        before = model(ids).logits
        assert lean_layers.install(model)
        after = model(ids).logits
    lean_layers.uninstall(model)
    assert torch.equal(before, after)


def test_lean_layers_need_pre_packed_projections(llama_dir: Path) -> None:
    unpacked, _ = load_model(str(llama_dir), LoadOptions(cache_dir=llama_dir / "cache", prepack=False))
    assert not lean_layers.install(unpacked)
    assert not any("forward" in vars(layer) for layer in unpacked.model.layers)


async def test_int8_lean_layers_keep_their_int8_projections(
    llama_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = load_model(str(llama_dir), LoadOptions(cache_dir=llama_dir / "cache", quantize="int8"))
    workload = [(list(range(3, 60)), 10), (list(range(7, 20)), 6)]
    lean_engine = await make_engine(llama_dir, model, tokenizer)
    assert all("forward" in vars(layer) for layer in model.model.layers)
    lean = await _one_at_a_time(lean_engine, workload)
    await lean_engine.close()
    monkeypatch.setattr(lean_layers, "install", lambda model: False)
    library = await _one_at_a_time(await make_engine(llama_dir, model, tokenizer), workload)
    float32 = await _one_at_a_time(await make_engine(llama_dir, *load(llama_dir)), workload)
    assert lean == library
    assert lean != float32, "the int8 weights were used"


def test_lean_layers_stack_float32_projections_and_keep_int8_ones_apart(llama_dir: Path) -> None:
    """q/k/v and gate/up run as one product each where the weights are float32; int8 layers keep their own kernel."""
    model, _ = load(llama_dir)
    int8_model, _ = load_model(str(llama_dir), LoadOptions(cache_dir=llama_dir / "cache", quantize="int8"))
    products = lean_layers.layer_products(model.model.layers[0])
    assert [type(product) for product, _ in products][::2] == [StackedLinears, StackedLinears]
    assert not any(isinstance(p, StackedLinears) for p, _ in lean_layers.layer_products(int8_model.model.layers[0]))
    x = torch.randn(5, model.config.hidden_size)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        separate = torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], dim=-1)
        assert torch.equal(products[0][0](x), separate)
