"""Attention for the continuous-batching path when no flash kernel is available (CPU).

transformers' SDPA path concatenates every request's KV into one sequence and attends densely under a
block-diagonal mask, so each token pays for every other request's context. Here:
- decode rows (one query each) of a step are attended together, a few padded calls per layer instead of one per
  request, reading their keys straight from the paged cache (`paged_reads.py`, one copy into the padded layout);
  the query heads sharing a KV head ride as that head's query rows, so grouped-query attention needs no repeat;
- prefill chunks go one request at a time (causal; aligned to the last key when the chunk follows cached context),
  located by the `cu_seq_lens_q` / `cu_seq_lens_k` offsets the library already passes. No dense mask is built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

from worker.engine.paged_reads import PAGED_KV, DecodeGroup, PagedKV

ATTENTION_NAME = "llmq_varlen_sdpa"


def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, total_q, head_dim]
    key: torch.Tensor,  # [1, kv_heads, total_kv, head_dim]: each request's keys; with PAGED_KV, only the new ones
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if kwargs.get("block_table") is not None or "cu_seq_lens_q" not in kwargs:
        raise RuntimeError(f"{ATTENTION_NAME} serves only transformers' continuous-batching index path")
    paged: PagedKV | None = kwargs.get(PAGED_KV)
    if paged is not None:
        return paged_attention(query, key, value, paged, scaling), None
    query_offsets = kwargs["cu_seq_lens_q"].tolist()
    key_offsets = kwargs["cu_seq_lens_k"].tolist()
    outputs = [
        request_attention(query[:, :, q_start:q_end], key[:, :, k_start:k_end], value[:, :, k_start:k_end], scaling)
        for q_start, q_end, k_start, k_end in zip(
            query_offsets, query_offsets[1:], key_offsets, key_offsets[1:], strict=False
        )
    ]
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return output.transpose(1, 2).contiguous(), None


def request_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """One request: `[1, heads, q_len, d]` against its `[1, kv_heads, k_len, d]`, causal from its last key back."""
    q_len, k_len = query.shape[2], key.shape[2]
    mask = None
    if 1 < q_len < k_len:  # a prefill chunk after cached context: causal, aligned to the last key
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    return functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=1 < q_len == k_len,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def paged_attention(
    query: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor, paged: PagedKV, scaling: float | None
) -> torch.Tensor:
    """A whole step from the paged cache; returns `[1, total_q, heads, head_dim]` like the per-request path."""
    heads, total_q, head_dim = query.shape[1], query.shape[2], query.shape[3]
    output = query.new_empty(1, total_q, heads, head_dim)
    native = paged.plan.native
    if native is not None:  # every decode row, read in place; queries and sums in float32 whatever the cache holds
        rows_first = query[0].transpose(0, 1)
        scale = head_dim**-0.5 if scaling is None else scaling
        if query.dtype == torch.float32:
            native.kernel(rows_first.contiguous(), paged.keys, paged.values, native.rows, scale, output[0])
        else:  # the prefill chunks below overwrite their own rows
            wide = torch.empty(output.shape[1:], dtype=torch.float32)
            native.kernel(rows_first.float().contiguous(), paged.keys, paged.values, native.rows, scale, wide)
            output[0].copy_(wide)
    for group in paged.plan.decode:
        output[0].index_copy_(0, group.rows, decode_attention(query, group, paged, scaling))
    read_index = paged.plan.read_index
    for q_start, q_end, k_start, k_end in paged.plan.prefill:
        q = query[:, :, q_start:q_end]
        if k_end - k_start == q_end - q_start:  # a fresh prompt: its keys are exactly the new ones
            k, v = new_keys[:, :, q_start:q_end], new_values[:, :, q_start:q_end]
        else:  # a chunk after cached context: this request's keys only
            rows = read_index[k_start:k_end]
            k, v = (x.index_select(0, rows).transpose(0, 1).unsqueeze(0) for x in (paged.keys, paged.values))
        output[0, q_start:q_end] = request_attention(q, k, v, scaling)[0].transpose(0, 1)
    return output


def decode_attention(query: torch.Tensor, group: DecodeGroup, paged: PagedKV, scaling: float | None) -> torch.Tensor:
    """One padded call for a group of decode rows: `[n, heads, head_dim]`. The `heads / kv_heads` query heads of one
    KV head become that head's query rows (no causal mask applies to a single new token), so grouped-query models
    need no key repeat."""
    keys, values = group.gather(paged.keys, paged.values)  # [n, kv_heads, width, d]
    n, kv_heads, head_dim = keys.shape[0], keys.shape[1], keys.shape[3]
    q = query[0].index_select(1, group.rows).transpose(0, 1)  # [n, heads, d]
    q = q.reshape(n, kv_heads, -1, head_dim)  # query head h reads kv head h // (heads / kv_heads)
    mask = None if group.mask is None else group.mask.to(query.dtype)
    out = functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(n, -1, head_dim)


def supports_varlen(model: Any) -> bool:
    return supports_varlen_config(model.config)


def supports_varlen_config(config: Any) -> bool:
    """Plain full attention only: no sliding window, sinks or soft-capping, which this function does not apply."""
    config = config.get_text_config()
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return (
        config._attn_implementation == "sdpa"
        and layer_types == {"full_attention"}
        and (getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True))
        and getattr(config, "attn_logit_softcapping", None) is None
    )
