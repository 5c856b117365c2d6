"""Attention reads straight from the paged KV cache, instead of from a per-layer copy of every request's K and V.

transformers' paged cache (5.24, index path) writes each layer's new K/V and then `index_select`s every running
request's whole past into one concatenated tensor, which attention then slices again: a second full copy of the
cache per layer and step, which was about a third of a 32-row decode step on CPU. `library.py` overrides that one
cache's `update` (an instance attribute, nothing global) with `PagedReads.update`: it writes the new K/V as the
library does, skips the read-back, and hands attention the layer's cache view and a per-step `StepPlan`. Attention
then reads each decode row's keys in place with the native kernel (`kernels/cpu_kernels.py`), or, where it could not
be built, copies them once into the padded layout of a few batched SDPA calls (`attention.py`).

The plan is built once per step (the first layer) and shared by every layer: all decode rows for the kernel, or
sorted by length and cut into a few padded groups (each one gather and one attention call); prefill chunks are kept
per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from worker.engine.kernels.cpu_kernels import DecodeRows, DecodeWrites, PagedDecode

PAGED_KV = "llmq_paged_kv"  # the attention kwarg that carries a `PagedKV`
DECODE_STEP = "_llmq_decode_step"  # the cache's attribute that `decode_step` calls (`library.install_paged_reads`)
# What one more attention call costs, in padded key rows (one row = one key of one decode row): a call and its
# gather cost about as much as ~2k key rows on CPU, so two rows of lengths 40 and 600 go to separate calls.
GROUP_COST_ROWS = 2048


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows of similar key length, attended in one padded call."""

    rows: torch.Tensor  # positions of these rows in the step's flat query, [n]
    index: torch.Tensor  # cache rows to read, [n * width]: each row's keys, padded with its last key
    mask: torch.Tensor | None  # additive, [n, 1, 1, width]: -inf on padding; None when no row is padded
    width: int
    buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def gather(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This group's keys and values as `[n, kv_heads, width, head_dim]` views, copied once into buffers reused by
        every layer of the step (a fresh multi-MB tensor per layer costs more than the copy on a busy CPU)."""
        buffers = self.buffers.get(keys.dtype)
        if buffers is None:
            shape = (self.index.numel(), *keys.shape[1:])
            buffers = self.buffers[keys.dtype] = (keys.new_empty(shape), values.new_empty(shape))
        key_rows = torch.index_select(keys, 0, self.index, out=buffers[0])
        value_rows = torch.index_select(values, 0, self.index, out=buffers[1])
        n = self.rows.numel()
        return (
            key_rows.view(n, self.width, *keys.shape[1:]).transpose(1, 2),
            value_rows.view(n, self.width, *values.shape[1:]).transpose(1, 2),
        )


@dataclass(frozen=True, slots=True)
class NativeDecode:
    """Every decode row of a step, for one call of the native kernel."""

    kernel: PagedDecode
    rows: DecodeRows


@dataclass(slots=True)
class StepPlan:
    """How one step's rows are attended: decode rows natively or in groups, prefill chunks one by one."""

    decode: list[DecodeGroup]
    prefill: list[tuple[int, int, int, int]]  # (q_start, q_end, k_start, k_end) in the flat query and read index
    read_index: torch.Tensor  # cache rows of every request's keys, concatenated (the library's layout)
    native: NativeDecode | None = None
    writes: DecodeWrites | None = None  # made on first ask (`PagedReads.decode_writes`) for a step of decode rows


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's cache view (`[cache rows, kv_heads, head_dim]`, new K/V already written) and the step's plan."""

    keys: torch.Tensor
    values: torch.Tensor
    plan: StepPlan


def plan_step(
    query_offsets: list[int],
    key_offsets: list[int],
    read_index: torch.Tensor,
    cost_rows: int = GROUP_COST_ROWS,
    kernel: PagedDecode | None = None,
) -> StepPlan:
    """Splits a step's requests into decode rows (one query row each: for `kernel`, else in groups) and prefill
    chunks."""
    decode: list[tuple[int, int, int]] = []  # (key length, query position, key start)
    prefill = []
    for q_start, q_end, k_start, k_end in zip(
        query_offsets, query_offsets[1:], key_offsets, key_offsets[1:], strict=False
    ):
        if q_end - q_start == 1:
            decode.append((k_end - k_start, q_start, k_start))
        elif q_end > q_start:
            prefill.append((q_start, q_end, k_start, k_end))
    if kernel is not None:
        native = None
        if decode:
            columns = zip(*decode, strict=True)
            lengths, query_rows, starts = (torch.tensor(column, dtype=torch.int64) for column in columns)
            native = NativeDecode(kernel, DecodeRows(query_rows, starts, lengths, read_index.to(torch.int64)))
        return StepPlan([], prefill, read_index, native)
    decode.sort()
    groups = [
        _group(decode[first:last], read_index) for first, last in split_by_length([d[0] for d in decode], cost_rows)
    ]
    return StepPlan(groups, prefill, read_index)


def split_by_length(lengths: list[int], cost_rows: int = GROUP_COST_ROWS) -> list[tuple[int, int]]:
    """Cuts ascending lengths into contiguous groups minimising padded rows plus `cost_rows` per group (exact DP)."""
    count = len(lengths)
    best = [0] + [0] * count
    cut = [0] * (count + 1)
    for last in range(1, count + 1):
        best[last], cut[last] = min(
            (best[first] + (last - first) * lengths[last - 1] + cost_rows, first) for first in range(last)
        )
    spans = []
    last = count
    while last > 0:
        spans.append((cut[last], last))
        last = cut[last]
    return spans[::-1]


def _group(rows: list[tuple[int, int, int]], read_index: torch.Tensor) -> DecodeGroup:
    device = read_index.device
    lengths = torch.tensor([length for length, _, _ in rows], device=device)
    starts = torch.tensor([start for _, _, start in rows], device=device)
    width = int(rows[-1][0])
    offsets = torch.arange(width, device=device)
    valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)
    positions = starts.unsqueeze(1) + torch.minimum(offsets.unsqueeze(0), (lengths - 1).unsqueeze(1))
    mask = None
    if not bool(valid.all()):
        mask = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(~valid, float("-inf"))
        mask = mask[:, None, None, :]
    return DecodeGroup(
        rows=torch.tensor([position for _, position, _ in rows], device=device),
        index=read_index[positions.reshape(-1)],
        mask=mask,
        width=width,
    )


class PagedReads:
    """One cache's reads on the steps that read it: each layer's new K/V written into its cache view, the step
    planned once (its first layer) for every layer of the same cache group, decode rows planned for `kernel` where
    given."""

    def __init__(self, kernel: PagedDecode | None = None) -> None:
        self.kernel = kernel
        self._source: object = None  # the step's list of read indices (rebuilt by the library for every batch)
        self._plans: dict[int, StepPlan] = {}  # by cache group, for the step whose list is `_source`

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        view: tuple[torch.Tensor, torch.Tensor],
        group: int,
        layer_type: str,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new K/V (`[1, kv_heads, new, head_dim]`) into the layer's cache `view` and puts `PagedKV` into
        the attention `kwargs`; returns only the new K/V, as attention reads the past through `PAGED_KV`. `group` is
        the layer's cache group (its row of `read_index` / `write_index`), `layer_type` its key of `cu_seq_lens_k`."""
        keys, values = view
        write_index = kwargs["write_index"][group]
        keys.index_copy_(0, write_index, key_states[0].transpose(0, 1))
        values.index_copy_(0, write_index, value_states[0].transpose(0, 1))
        kwargs[PAGED_KV] = PagedKV(keys, values, self._plan(group, layer_type, kwargs))
        return key_states, value_states

    def decode_writes(self, group: int, layer_type: str, kwargs: dict[str, Any]) -> DecodeWrites | None:
        """The step's `DecodeWrites` where every row is a decode row for the kernel: a layer may then write its new
        K/V into its cache view and attend in one call (`DecoderLayer.decode_step`) instead of `update` and
        attention; else None. Made once a step, by the first layer that asks."""
        plan = self._plan(group, layer_type, kwargs)
        if plan.writes is None and plan.native is not None and not plan.prefill:
            plan.writes = DecodeWrites(plan.native.rows, kwargs["write_index"][group].to(torch.int64))
        return plan.writes

    def _plan(self, group: int, layer_type: str, kwargs: dict[str, Any]) -> StepPlan:
        """The step's plan for cache `group`, made by its first layer."""
        read_indices = kwargs["read_index"]
        if self._source is not read_indices:  # first layer of a step
            self._source, self._plans = read_indices, {}
        plan = self._plans.get(group)
        if plan is None:
            key_offsets = kwargs["cu_seq_lens_k"][layer_type].tolist()
            plan = self._plans[group] = plan_step(
                kwargs["cu_seq_lens_q"].tolist(), key_offsets, read_indices[group], kernel=self.kernel
            )
        return plan


def decode_step(
    cache: Any, layer_idx: int, kwargs: dict[str, Any]
) -> tuple[tuple[torch.Tensor, torch.Tensor], DecodeWrites] | None:
    """Layer `layer_idx`'s cache view (keys, values) and the step's `DecodeWrites`, where the cache reads through
    `PagedReads` and every row of the step is a decode row for the native kernel; else None (`update` and attention
    then run as usual)."""
    find = getattr(cache, DECODE_STEP, None)
    return None if find is None else find(layer_idx, kwargs)
