"""Per-request attention for the continuous-batching path when no flash kernel is available (CPU, most GPUs
without flash-attn).

transformers' SDPA path concatenates every request's KV into one sequence and attends densely under a
block-diagonal mask, so each token pays for every other request's context: a 32-request decode step on
CPU costs about five single-request steps. Here each request attends only to its own keys, located by the
`cu_seq_lens_q` / `cu_seq_lens_k` offsets the library already passes; no mask is built at all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

ATTENTION_NAME = "llmq_varlen_sdpa"


def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, total_q, head_dim]
    key: torch.Tensor,  # [1, kv_heads, total_kv, head_dim]: each request's past and new keys, concatenated
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if kwargs.get("block_table") is not None or "cu_seq_lens_q" not in kwargs:
        raise RuntimeError(f"{ATTENTION_NAME} serves only transformers' continuous-batching index path")
    query_offsets = kwargs["cu_seq_lens_q"].tolist()
    key_offsets = kwargs["cu_seq_lens_k"].tolist()
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for q_start, q_end, k_start, k_end in zip(
        query_offsets, query_offsets[1:], key_offsets, key_offsets[1:], strict=False
    ):
        q_len, k_len = q_end - q_start, k_end - k_start
        mask = None
        if 1 < q_len < k_len:  # a prefill chunk after cached context: causal, aligned to the last key
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        outputs.append(
            functional.scaled_dot_product_attention(
                query[:, :, q_start:q_end],
                key[:, :, k_start:k_end],
                value[:, :, k_start:k_end],
                attn_mask=mask,
                is_causal=1 < q_len == k_len,
                scale=scaling,
                enable_gqa=gqa,
            )
        )
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return output.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, varlen_sdpa_forward)


def supports_varlen(model: Any) -> bool:
    """Plain full attention only: no sliding window, sinks or soft-capping, which this function does not apply."""
    config = model.config.get_text_config()
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (
        config._attn_implementation == "sdpa"
        and layer_types == {"full_attention"}
        and not getattr(config, "use_sliding_window", False)
        and getattr(config, "attn_logit_softcapping", None) is None
    )
