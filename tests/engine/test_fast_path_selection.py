"""Which paths the engine takes per device and model kind: our fast paths on CPU only, the library's on CUDA."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from worker.engine.fastpath import FastPaths, select

ALL = FastPaths(varlen_attention=True, paged_reads=True, lean_layers=True)
NOT_LEAN = FastPaths(varlen_attention=True, paged_reads=True, lean_layers=False)
LIBRARY = FastPaths(varlen_attention=False, paged_reads=False, lean_layers=False)


def _config(kind: str, attention: str = "sdpa") -> object:
    small: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    configs = {
        "llama": lambda: LlamaConfig(num_key_value_heads=4, **small),
        "qwen2-gqa": lambda: Qwen2Config(num_key_value_heads=2, **small),
        "qwen2-sliding": lambda: Qwen2Config(
            num_key_value_heads=2, use_sliding_window=True, sliding_window=16, **small
        ),
        "mistral-sliding": lambda: MistralConfig(num_key_value_heads=2, sliding_window=16, **small),
        "gemma2": lambda: Gemma2Config(num_key_value_heads=2, head_dim=16, **small),
        "llama-gelu": lambda: LlamaConfig(num_key_value_heads=4, hidden_act="gelu", **small),
        "qwen3": lambda: Qwen3Config(num_key_value_heads=2, **small),  # q/k norms: not a Llama-family layer
    }
    config = configs[kind]()
    config._attn_implementation = attention
    return config


@pytest.mark.parametrize(
    ("device", "kind", "attention", "expected"),
    [
        ("cpu", "llama", "sdpa", ALL),
        ("cpu", "qwen2-gqa", "sdpa", ALL),
        ("cpu", "qwen2-sliding", "sdpa", LIBRARY),
        ("cpu", "mistral-sliding", "sdpa", LIBRARY),
        ("cpu", "gemma2", "sdpa", LIBRARY),  # sliding layers and soft-capping
        ("cpu", "llama-gelu", "sdpa", NOT_LEAN),
        ("cpu", "qwen3", "sdpa", NOT_LEAN),
        ("cpu", "llama", "eager", LIBRARY),
        ("cuda", "llama", "sdpa", LIBRARY),
        ("cuda:0", "qwen2-gqa", "sdpa", LIBRARY),
        ("cuda:1", "llama", "flash_attention_2", LIBRARY),
        ("cuda", "gemma2", "sdpa", LIBRARY),
    ],
)
def test_fast_paths_engage_only_on_cpu(device: str, kind: str, attention: str, expected: FastPaths) -> None:
    assert select(device, _config(kind, attention)) == expected
