"""`bench/step_profile.py`: the native calls a step makes show in its figures, counted once each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bench import step_profile
from testing.tiny_models import save_tiny_model
from worker.engine import prepack
from worker.engine.kernels import cpu_kernels
from worker.engine.loader import LoadOptions, load_model

pytestmark = pytest.mark.model  # builds a model and runs an engine in its body


def calls_per_step(printed: str, family: str) -> int:
    match = re.search(rf"^  {family}\s+[\d.]+ ms\s+[\d.]+ %\s+(\d+) calls/step$", printed, flags=re.MULTILINE)
    assert match is not None, f"no {family!r} line in:\n{printed}"
    return int(match.group(1))


async def test_a_lone_few_row_step_shows_one_native_layer_call_per_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step of one decode row in the few-row mode runs each layer in one native call (`decode_step`) and the
    output head in one few-row product: the profile counts both, where it once counted neither."""
    if cpu_kernels.few_rows(torch.float32) is None:
        pytest.skip("no float32 few-row kernel on this machine (AVX2 and FMA, or AVX-512, and a C compiler)")
    for owner, method, _ in step_profile.RECORDED:  # the profile wraps these on their classes: restored after
        monkeypatch.setattr(owner, method, getattr(owner, method))
    step_profile._record_kernel_calls()
    folder = save_tiny_model(tmp_path / "model", "llama")
    model, tokenizer = load_model(str(folder), LoadOptions(cache_dir=folder / "cache", float32_few_rows=True))
    if not prepack.available() or cpu_kernels.decoder_layer(model.config.hidden_size, torch.float32) is None:
        pytest.skip("no native float32 decoder layer here (oneDNN packing, the layer's build or its RMSNorm's bits)")

    figures = await step_profile.profile(model, tokenizer, rows=1, steps=5, prompt=16)

    printed = capsys.readouterr().out
    assert calls_per_step(printed, "native layer") == model.config.num_hidden_layers
    assert calls_per_step(printed, "matmul") == 1  # the output head's few-row product
    assert "native layer_ms" in figures and figures["rows"] == 1
