"""Pre-packed float32 linear layers: the same outputs, tied weights kept, and a safe fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.engine.conftest import reference_greedy
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import PackedLinear, StackedLinears, available, prepack


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
    assert prepack(nn.Sequential(nn.Linear(8, 4).to(torch.bfloat16), nn.Linear(8, 4).double())) == 0


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
