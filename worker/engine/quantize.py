"""Int8 weights for CPU decode steps (`LLMQ_QUANTIZE=int8`): faster small batches, greedy outputs close to float32.

A decode step multiplies a few rows by every weight: its matrix products are bound by reading the weights, so
int8 weights (a quarter of the bytes) pay where the activations stay precise. `torch.ops.aten._weight_int8pack_mm`
does exactly that (int8 weights with one scale per output channel, bfloat16 activations, float32 sums). Steps of
more than `INT8_MAX_ROWS` rows (prefill chunks) are bound by arithmetic, where that kernel is slower than oneDNN's
float32 one; they keep the pre-packed float32 path (`PackedLinear`).

Measured on SmolLM2-135M's layer shapes, 2 threads, ms for the 30 layers' 7 products (float32 pre-packed / int8):
1 row 11.3 / 4.4, 8 rows 26.0 / 14.8, 16 rows 37.6 / 27.2, 32 rows 56.1 / 52.2, 64 rows 99.4 / 97.5, 128 rows
164.5 / 195.7. The alternatives tried: int8 activations with one scale per token (`torch._int_mm`) or per tensor
(fbgemm's dynamic linear) are 2-4x faster than float32 in the kernel, but change SmolLM2's greedy outputs within a
few tokens (a few activation channels are far larger than the rest); writing each activation as two int8 digits
kept float32-grade agreement but was no faster than float32 at 2 threads.

The output head stays float32 (pre-packed): it decides near-ties between tokens directly, and int8 weights there
moved greedy outputs' first difference from float32 earlier (token 65 -> 58 of 96 on 16 requests). Memory: an int8
copy of each converted weight (a quarter of its float32 size) besides prepack's; the float32 weight stays for
large batches, tied weights and `state_dict`.
"""

from __future__ import annotations

from typing import Any, Self

import torch
from torch import nn

from worker.engine.prepack import DerivedWeights, PackedLinear, swap_linears
from worker.engine.prepack import available as prepack_available

INT8_MAX_ROWS = 32  # up to here (decode steps) int8 is faster; beyond, pre-packed float32 is
_K_MULTIPLE = 16  # the int8 kernel reads 16 activations at a time, aligned: other widths would read past a row


def available() -> bool:
    return prepack_available() and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(PackedLinear):
    """A `PackedLinear` (same parameters, same state dict) that multiplies small float32 CPU batches in int8."""

    int8: DerivedWeights[tuple[torch.Tensor, torch.Tensor]]  # `quantize_weight`'s, made at the first int8 call

    @classmethod
    def wrap(cls, linear: nn.Linear, *, float32_few_rows: bool = False) -> Self:
        wrapped = super().wrap(linear, float32_few_rows=float32_few_rows)  # unused: int8 runs every few-row step
        wrapped.int8 = DerivedWeights(quantize_weight)
        return wrapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.numel() > INT8_MAX_ROWS * self.in_features or not self.cpu_inference(x):
            return super().forward(x)  # pre-packed float32, or the plain fallback
        int8, scales = self.int8.of(weight)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16, memory_format=torch.contiguous_format)
        out = torch.ops.aten._weight_int8pack_mm(rows, int8, scales)
        out = out.float() if self.bias is None else torch.add(self.bias.detach(), out)
        return out.view(*x.shape[:-1], self.out_features)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 values and bfloat16 scales per output channel (row). The scales are rounded to bfloat16 first and the
    weight divided by the rounded ones, so `int8 * scale` carries no extra error from the scales' dtype."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-30).to(torch.bfloat16)
    int8 = torch.round(weight / scales.float()[:, None]).clamp_(-128, 127).to(torch.int8)
    return int8, scales


def quantize_int8(model: Any) -> int:
    """Swaps every float32 CPU linear layer of `model` but its output head for an `Int8Linear`; returns how many.

    Plain and pre-packed layers alike; the embedding, the head and layers whose input width the int8 kernel cannot
    read (not a multiple of 16) stay as they are."""
    if not available():
        raise RuntimeError("int8 needs torch with oneDNN and torch.ops.aten._weight_int8pack_mm")
    head = model.get_output_embeddings()

    def convertible(linear: nn.Linear) -> bool:
        return not isinstance(linear, Int8Linear) and linear is not head and linear.in_features % _K_MULTIPLE == 0

    return swap_linears(model, Int8Linear.wrap, convertible)
