"""Int8 linear layers (`LLMQ_QUANTIZE=int8`): what is converted, how close it stays to float32, and where it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.nn import functional

from tests.engine.conftest import reference_greedy
from tests.engine.test_engine import collect, greedy, mixed_prompts, tokens_of
from worker.config import Settings
from worker.engine.loader import LoadOptions, load_model
from worker.engine.prepack import PackedLinear
from worker.engine.quantize import INT8_MAX_ROWS, Int8Linear, quantize_int8, quantize_weight
from worker.engine.types import EngineRequest


def load_int8(folder: Path) -> tuple[Any, Any]:
    return load_model(str(folder), LoadOptions(cache_dir=folder / "cache", quantize="int8"))


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm())


def weight_only(linear: nn.Linear) -> torch.Tensor:
    """The weight as its int8 values times their scales, in float32: the error int8 weights must cost."""
    int8, scales = quantize_weight(linear.weight.detach())
    return int8.float() * scales.float()[:, None]


def test_loaded_model_converts_the_body_but_not_the_head(tiny_model_dir: Path) -> None:
    model, _ = load_int8(tiny_model_dir)
    plain, _ = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache", prepack=False))
    linear_names = {name for name, module in plain.named_modules() if isinstance(module, nn.Linear)}
    int8_names = {name for name, module in model.named_modules() if isinstance(module, Int8Linear)}
    assert int8_names == linear_names - {"lm_head"}
    assert type(model.get_output_embeddings()) is PackedLinear  # the head stays float32, pre-packed
    assert isinstance(model.get_input_embeddings(), nn.Embedding)
    assert model.state_dict().keys() == plain.state_dict().keys()


def test_logits_stay_close_to_float32_and_to_int8_weights(tiny_model_dir: Path) -> None:
    model, _ = load_int8(tiny_model_dir)
    plain, _ = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache", prepack=False))
    rounded, _ = load_model(str(tiny_model_dir), LoadOptions(cache_dir=tiny_model_dir / "cache", prepack=False))
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, Int8Linear):
                rounded.get_submodule(name).weight.copy_(weight_only(module))
        ids = torch.tensor([list(range(3, 3 + INT8_MAX_ROWS - 8))])  # few enough rows for the int8 path
        logits = model(ids).logits
        # measured 0.043 (llama) and 0.050 (qwen2): these random models amplify the int8 weights' rounding ...
        assert relative_error(logits, plain(ids).logits) < 0.1
        # ... and 0.015 and 0.020 from float32 products with the same int8 weights (bfloat16 activations)
        assert relative_error(logits, rounded(ids).logits) < 0.04


def test_small_batches_multiply_in_int8_and_large_ones_in_float32() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    int8, packed = Int8Linear.wrap(linear), PackedLinear.wrap(linear)
    with torch.no_grad():
        small = torch.randn(4, INT8_MAX_ROWS // 4, 96)
        out = int8(small)
        assert out.shape == (4, INT8_MAX_ROWS // 4, 40) and out.dtype == torch.float32
        assert relative_error(out, functional.linear(small, weight_only(linear), linear.bias)) < 5e-3  # measured 2.3e-3
        assert relative_error(out, linear(small)) < 1e-2  # measured 5e-3
        large = torch.randn(INT8_MAX_ROWS + 1, 96)
        torch.testing.assert_close(int8(large), packed(large), rtol=0, atol=0)
        transposed = torch.randn(96, 5).t()  # not contiguous: the kernel needs its rows packed
        torch.testing.assert_close(int8(transposed), int8(transposed.contiguous()), rtol=0, atol=0)
        assert int8(torch.zeros(2, 96)).eq(linear.bias).all(), "an all-zero row gives the bias"


def test_a_changed_weight_is_quantized_again_and_autograd_falls_back() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 16, bias=False)
    int8 = Int8Linear.wrap(linear)
    x = torch.randn(4, 32)
    with torch.no_grad():
        before = int8(x)
        linear.weight.mul_(2.0)
        torch.testing.assert_close(int8(x), before * 2.0, rtol=1e-5, atol=1e-5)
    x.requires_grad_(True)
    int8(x).sum().backward()  # autograd: the plain float32 path
    assert x.grad is not None
    torch.testing.assert_close(x.grad, linear.weight.detach().sum(0).expand(4, 32))


class TiedHead(nn.Module):
    """A float32 layer, a bfloat16 one, one 24 wide (the int8 kernel reads 16 at a time), and an output head
    tied to an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16).to(torch.bfloat16), nn.Linear(24, 16))
        self.head = nn.Linear(16, 30, bias=False)
        self.head.weight = self.embed.weight

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_head_ties_and_other_dtypes_are_left_alone() -> None:
    model = TiedHead()
    assert quantize_int8(model) == 1
    assert isinstance(model.body[0], Int8Linear)
    assert type(model.body[1]) is nn.Linear and type(model.body[2]) is nn.Linear and type(model.head) is nn.Linear
    assert model.head.weight is model.embed.weight
    assert quantize_int8(model) == 0, "converting twice changes nothing"


async def test_greedy_generation_through_the_engine(llama_dir: Path, make_engine: Any) -> None:
    """One request at a time, so each step has as many rows as `generate`'s and takes the same int8/float32 path."""
    model, tokenizer = load_int8(llama_dir)
    workload = mixed_prompts(model.config.vocab_size, count=6)
    expected = [reference_greedy(model, ids, n) for ids, n in workload]  # before the engine takes the model over
    engine = await make_engine(llama_dir, model, tokenizer)
    for index, (ids, n) in enumerate(workload):
        deltas = await collect(engine.submit(EngineRequest(f"r{index}", input_ids=ids, params=greedy(n))))
        assert tokens_of(deltas) == expected[index], f"request {index}"
    assert sum(len(tokens) for tokens in expected) > 6


@pytest.mark.parametrize(
    "options",
    [{"device": "cuda"}, {"device": "cuda:1"}, {"dtype": "bfloat16"}, {"dtype": "float16"}],
    ids=["cuda", "cuda:1", "bfloat16", "float16"],
)
def test_refuses_anything_but_float32_on_cpu(options: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="quantize=int8 is for float32 on CPU"):
        LoadOptions(quantize="int8", **options)  # type: ignore[arg-type]
    LoadOptions(**options)  # type: ignore[arg-type]  # without int8: accepted


def test_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="'none' or 'int8'"):
        LoadOptions(quantize="int4")  # type: ignore[arg-type]


def test_settings_read_llmq_quantize(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(_env_file=None).quantize == "none"  # type: ignore[call-arg]
    monkeypatch.setenv("LLMQ_QUANTIZE", "int8")
    assert Settings(_env_file=None).quantize == "int8"  # type: ignore[call-arg]
    monkeypatch.setenv("LLMQ_QUANTIZE", "int4")
    with pytest.raises(ValidationError):
        Settings(_env_file=None)  # type: ignore[call-arg]
