"""Pre-packed float32 linear layers: the same outputs, tied weights kept, a bounded set of shapes, a safe fallback."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.engine.conftest import reference_greedy
from worker.engine import prepack as prepack_module
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import PackedLinear, StackedLinears, available, prepack, row_bucket
from worker.engine.types import EngineRequest, GenerationParams


def test_loaded_model_is_packed_and_greedy_outputs_are_unchanged(tiny_model_dir: Path) -> None:
    packed, _ = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache"))
    plain, _ = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache", prepack=False))
    assert available()
    assert any(isinstance(module, PackedLinear) for module in packed.modules())
    assert not any(isinstance(module, PackedLinear) for module in plain.modules())
    for prompt in ([5, 6, 7], list(range(3, 90))):
        assert reference_greedy(packed, prompt, 24) == reference_greedy(plain, prompt, 24)
    assert packed.state_dict().keys() == plain.state_dict().keys()


def test_close_to_linear_for_any_batch_shape() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    packed = PackedLinear.wrap(linear)
    with torch.no_grad():
        for shape in [(48,), (1, 48), (7, 48), (2, 5, 48), (1, 300, 48)]:
            x = torch.randn(shape)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


def test_tied_weights_stay_tied_and_a_changed_weight_is_repacked() -> None:
    embedding = nn.Embedding(30, 16)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 30, bias=False))
    model[1].weight = embedding.weight
    assert prepack(model) == 2
    assert model[1].weight is embedding.weight
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = model(x)
        embedding.weight.mul_(2.0)
        torch.testing.assert_close(model(x), before * 2.0, rtol=1e-5, atol=1e-5)


def test_falls_back_where_packing_does_not_apply() -> None:
    linear = nn.Linear(8, 4)
    packed = PackedLinear.wrap(linear)
    x = torch.randn(2, 8, requires_grad=True)
    packed(x).sum().backward()  # autograd: the plain path
    assert x.grad is not None and not packed.packed.made
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed.packed.made, "inference packs"
    assert prepack(nn.Sequential(nn.Linear(8, 4).half(), nn.Linear(8, 4).double())) == 0  # bfloat16 packs too


def _layers(*shapes: tuple[int, int], bias: bool = True) -> list[PackedLinear]:
    torch.manual_seed(1)
    return [PackedLinear.wrap(nn.Linear(fan_in, fan_out, bias=bias)) for fan_in, fan_out in shapes]


def test_stacked_layers_give_each_layers_bits_side_by_side() -> None:
    for bias in (True, False):
        layers = _layers((64, 96), (64, 32), (64, 32), bias=bias)
        stacked = StackedLinears(layers)
        with torch.no_grad():
            for rows in (1, 3, 16, 33, 300):
                x = torch.randn(rows, 64)
                assert torch.equal(stacked(x), torch.cat([layer(x) for layer in layers], dim=-1))


def test_stacked_layers_pack_again_when_a_weight_or_bias_changes() -> None:
    layers = _layers((16, 8), (16, 8))
    stacked = StackedLinears(layers)
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = stacked(x)
        layers[1].weight.mul_(2.0)
        layers[0].bias.add_(1.0)
        after = stacked(x)
        layers[1].weight = nn.Parameter(torch.zeros(8, 16))  # swapped, not changed in place
        swapped = stacked(x)
    torch.testing.assert_close(after[:, :8], before[:, :8] + 1.0)
    torch.testing.assert_close(after[:, 8:] - layers[1].bias, (before[:, 8:] - layers[1].bias) * 2.0)
    assert torch.equal(swapped[:, 8:], layers[1].bias.detach().expand(4, 8))


def test_only_float32_packed_layers_of_one_input_width_and_bias_kind_stack() -> None:
    assert StackedLinears.stackable(_layers((16, 8), (16, 4)))
    assert not StackedLinears.stackable([])
    assert not StackedLinears.stackable(_layers((16, 8), (12, 8)))
    assert not StackedLinears.stackable([*_layers((16, 8)), *_layers((16, 8), bias=False)])
    assert not StackedLinears.stackable([*_layers((16, 8)), nn.Linear(16, 8)])
    with pytest.raises(ValueError, match="StackedLinears"):
        StackedLinears(_layers((16, 8), (12, 8)))


def test_row_counts_are_padded_to_a_bounded_set_with_at_most_an_eighth_of_padding() -> None:
    assert [row_bucket(rows) for rows in range(18)] == [0, 1, 2, 4, 4, *[8] * 4, *[16] * 8, 18]
    assert [row_bucket(rows) for rows in (32, 33, 100, 300, 512, 513)] == [32, 36, 104, 320, 512, 576]
    for rows in range(17, 9000):
        assert rows <= row_bucket(rows) <= rows * 9 / 8
        assert row_bucket(row_bucket(rows)) == row_bucket(rows)
    assert len({row_bucket(rows) for rows in range(1, 513)}) == 45
    assert len({row_bucket(rows) for rows in range(1, 8193)}) == 77


def test_padded_rows_give_the_unpadded_products() -> None:
    layers = _layers((64, 96), (64, 32))
    stacked = StackedLinears(layers)
    linear = nn.Linear(64, 40)
    with torch.no_grad():
        for rows in (0, 1, 3, 5, 17, 33, 129, 300):
            x = torch.randn(rows, 64)
            out = stacked(x)
            assert out.shape == (rows, 128) and out.is_contiguous()
            torch.testing.assert_close(
                out, torch.cat([nn.functional.linear(x, layer.weight, layer.bias) for layer in layers], -1)
            )
            torch.testing.assert_close(PackedLinear.wrap(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


async def test_an_engine_hands_onednn_only_bucketed_row_counts(
    llama_dir: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each oneDNN shape keeps native memory for good: a worker that met every row count grew ~200 KB a request."""
    product = prepack_module._linear_pointwise
    row_counts: set[int] = set()

    def counting(rows: torch.Tensor, *args: Any) -> torch.Tensor:
        row_counts.add(rows.shape[0])
        return product(rows, *args)

    monkeypatch.setattr(prepack_module, "_linear_pointwise", counting)
    engine = await make_engine(llama_dir, max_batch_tokens=128)
    rng = random.Random(3)
    requests = [
        EngineRequest(
            f"r{i}",
            input_ids=[rng.randrange(3, 200) for _ in range(length)],
            params=GenerationParams(max_new_tokens=rng.randint(1, 12), temperature=0),
        )
        for i, length in enumerate(rng.sample(range(1, 200), 60))
    ]
    outputs = []
    for wave in range(0, len(requests), 4):  # a few at a time, so steps of every size run, not only full ones
        outputs += await asyncio.gather(*(_drain(engine.submit(request)) for request in requests[wave : wave + 4]))
    assert all(outputs), "every request produced tokens"
    assert len(row_counts) > 8, "steps of many sizes ran"
    assert row_counts <= {1, 2, 4, 8, 16, *range(18, 33, 2), *range(36, 65, 4), *range(72, 129, 8)}


async def _drain(stream: Any) -> list[int]:
    return [token async for delta in stream for token in delta.token_ids]
