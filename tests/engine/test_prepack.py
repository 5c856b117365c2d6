"""Pre-packed float32 linear layers: the same outputs, tied weights kept, and a safe fallback."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests.engine.conftest import reference_greedy
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import PackedLinear, available, prepack


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
    assert x.grad is not None and packed._packed is None
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed._packed is not None, "inference packs"
    assert prepack(nn.Sequential(nn.Linear(8, 4).to(torch.bfloat16), nn.Linear(8, 4).double())) == 0
