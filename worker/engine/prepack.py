"""Float32 and bfloat16 linear layers on CPU with their weights pre-packed once for oneDNN, instead of on every call.

A plain `F.linear` on CPU re-lays out (packs) the weight matrix for the GEMM kernel at each call; for a 135M model
that is most of a decode step's matrix-multiply time at small batches. oneDNN can keep the weight in its own
layout: measured here 1.7-2.2x faster for 1-32 rows and for 256-token prefills, with greedy outputs unchanged on
SmolLM2. The cost is memory: a second copy of every linear weight (the dense one stays, for `generate`'s
other users, tied embeddings and `state_dict`; float32 SmolLM2: about 0.5 GB more).

Every product's rows are padded to one of a few counts (`row_bucket`). oneDNN builds a primitive for each input
shape it meets and keeps it in two caches (its own and ideep's, 1,024 entries each), and a primitive holds native
memory: about 0.6 MB plus `rows x out_features` floats of scratch. An engine step multiplies as many rows as it
has tokens, a different count almost every step, so unpadded a worker grew about 200 KB per request served until
both caches filled (in-process, the tiny test model: +530 MB over 1,300 requests, still rising; padded: +33 MB from
request 100 to 500, then flat). Padded, the shapes are bounded by the largest step
(`max_batch_tokens`): 5 up to 16 rows, 8 per doubling beyond, so at most 1/8 of a product's rows are padding.

Bfloat16 (`LLMQ_DTYPE=bfloat16`) keeps its weights dense: oneDNN's bf16 kernels (AMX or AVX-512 BF16) gain nothing from
a packed copy here, but the padding to bounded row counts matters as much. Steps of up to `FEW_ROWS` rows take the
native few-row kernel instead (`kernels/few_rows.c`), which reads the weights about twice as fast; on a CPU without AMX
steps of up to `FEW_ROWS_BFLOAT16_WITHOUT_AMX` rows (`few_rows_limit`), where it also sums faster. Bfloat16 products'
bits depend on the row count (oneDNN picks a kernel by shape, and the few-row kernel sums in its own order), so unlike
float32, a request's bf16 outputs may differ with the batch it ran in.

Float32 steps of a few rows (`few_rows_limit`: up to 16 with AVX-512, else 6) may take the float32 few-row kernel
(`kernels/few_rows_float32.c`) on the dense weights, when the operator asks (`prepack(model, float32_few_rows=True)`,
`LLMQ_FLOAT32_FEW_ROWS`): 1.3-2x oneDNN's speed there, no memory added, but its sums run in another order than oneDNN's,
so float32 outputs are then close to `generate`'s, not equal bit for bit, and depend on the batch as bfloat16's do.

`prepack(model)` swaps each float32 or bfloat16 `nn.Linear` for a `PackedLinear` that shares its parameters (tied
weights stay tied). It packs again if the weight is changed in place or swapped for another (`DerivedWeights`), and
falls back to `F.linear` for anything else (autograd, float16, other devices, an input of another dtype).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, Generic, Self, TypeVar

import torch
from torch import nn
from torch.nn import functional

from worker.engine.kernels import cpu_kernels

Derived = TypeVar("Derived")

_POWERS_OF_TWO_UP_TO = 16  # up to here a product reads its weights more than it computes: padding rows is cheap
_BUCKETS_PER_DOUBLING = 8
_linear_pointwise: Any = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # None without oneDNN
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Products of up to this many rows run the few-row kernel: float32's, where asked, and bfloat16's on a CPU with AMX.
# Float32's on an AVX2 EPYC: 19.5 ms against oneDNN's packed 23.6 at 1 row (1.21x), 1.8-2.0x at 2-4 (oneDNN reads its
# layout at half speed there), 1.3x at 5-6, 1.07x at 8. Bfloat16's on a Xeon with AMX, SmolLM2's 30 layers, 2
# threads: 8.7 ms at 1 row against oneDNN's 18.8 (2.15x), 1.5x at 4, 1.1x at 6, 0.9x at 8, where oneDNN's AMX tiles
# do the sums better (measured while the kernel still kept its sums in memory: `kernels/block_rows.h`).
FEW_ROWS = 6
# Bfloat16 products run the few-row kernel up to this many rows on a CPU without AMX, where oneDNN's bfloat16
# products use the same AVX-512 BF16 dot products: on a Zen 5 the kernel took 17.4 and 18.7 ms against oneDNN's 27.2
# and 21.8 at 32 rows in two runs, about the same at 48 (`python -m bench.few_rows`), and the busy workload ran 1.15x
# faster than at 6 rows in two alternated rounds. Measured on that Zen 5 only, as the float32 limit below.
FEW_ROWS_BFLOAT16_WITHOUT_AMX = 32
# Float32's (where asked) built for AVX-512 on that Zen 5: 22.8 ms against oneDNN's packed 28.3 at 16 rows, about
# even at 24; the busy workload ran 1.09x faster than at 6 rows. AVX2's 16 registers hold fewer sums: 6 stays there.
FEW_ROWS_FLOAT32_AVX512 = 16


class DerivedWeights(Generic[Derived]):
    """What `derive` makes of some weights (a packed copy, an int8 one), made again when any of them is swapped for
    another tensor or changed in place (`_version`). It holds the tensors it was made from, so a new parameter can
    never pass for the old one by reusing its id. (A change through `.data` bypasses `_version`, as it does autograd;
    such a change needs a fresh load.)"""

    __slots__ = ("_derive", "_sources", "_value", "_versions")

    def __init__(self, derive: Callable[..., Derived]) -> None:
        self._derive = derive
        self._sources: tuple[torch.Tensor, ...] = ()
        self._versions: tuple[int, ...] = ()
        self._value: Derived | None = None

    @property
    def made(self) -> bool:
        return self._value is not None

    def of(self, *weights: torch.Tensor) -> Derived:
        versions = tuple(weight._version for weight in weights)
        if self._value is None or versions != self._versions or any(map(operator.is_not, weights, self._sources)):
            self._value = self._derive(*(weight.detach() for weight in weights))
            self._sources, self._versions = weights, versions
        return self._value


@functools.cache
def few_rows_limit(dtype: torch.dtype) -> int:
    """The most rows a product in `dtype` takes the few-row kernel for (and a lean layer the native layer, which is
    built on it): for bfloat16 `FEW_ROWS` on a CPU with AMX, else `FEW_ROWS_BFLOAT16_WITHOUT_AMX`; for float32
    `FEW_ROWS_FLOAT32_AVX512` on a CPU with AVX-512, else `FEW_ROWS`."""
    if dtype == torch.bfloat16:
        return FEW_ROWS if cpu_kernels.amx() else FEW_ROWS_BFLOAT16_WITHOUT_AMX
    return FEW_ROWS_FLOAT32_AVX512 if cpu_kernels.avx512() else FEW_ROWS


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and _linear_pointwise is not None


def row_bucket(rows: int) -> int:
    """The row count a product of `rows` rows runs at: the next power of two up to 16, else the next multiple of an
    eighth of the power of two below `rows` (17 -> 18, 100 -> 104, 300 -> 320)."""
    if rows <= _POWERS_OF_TWO_UP_TO:
        return 1 << (rows - 1).bit_length() if rows > 0 else 0
    power_below = 1 << ((rows - 1).bit_length() - 1)
    step = power_below // _BUCKETS_PER_DOUBLING
    return -(-rows // step) * step


def packed_product(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dense: torch.Tensor | None = None
) -> torch.Tensor:
    """`rows @ weight.T + bias` for 2-D `rows` and a `pack`ed `weight` of their dtype: up to `few_rows_limit` rows
    by the few-row kernel on the dense weight (bfloat16's own, kept dense, or float32's `dense` where given: asked
    for), else by oneDNN (`onednn_product`)."""
    plain = dense if weight.is_mkldnn else weight
    if plain is not None and rows.shape[0] <= few_rows_limit(plain.dtype):
        few_rows = cpu_kernels.few_rows(plain.dtype)
        if few_rows is not None:
            return few_rows(rows.contiguous(), plain, bias)
    return onednn_product(rows, weight, bias)


def onednn_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`rows @ weight.T + bias` by oneDNN for a `pack`ed `weight`, run at `row_bucket` rows (zero rows appended, their
    outputs dropped) so that oneDNN meets a bounded set of shapes."""
    count = rows.shape[0]
    padding = row_bucket(count) - count
    if padding:
        rows = functional.pad(rows, (0, 0, 0, padding))
    if weight.is_mkldnn:
        out = _linear_pointwise(rows, weight, bias, "none", [], "")
    else:
        out = functional.linear(rows, weight, bias)
    return out[:count] if padding else out


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The copy of `weight` products run on: oneDNN's layout for float32, the dense weight itself for bfloat16."""
    return weight.to_mkldnn() if weight.dtype == torch.float32 else weight.contiguous()


class PackedLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) that multiplies with a oneDNN-packed copy of its weight, and
    float32 steps of a few rows with the few-row kernel on its dense weight where `float32_few_rows` (asked for)."""

    packed: DerivedWeights[torch.Tensor]
    float32_few_rows: bool

    @classmethod
    def wrap(cls, linear: nn.Linear, *, float32_few_rows: bool = False) -> Self:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias  # shared: tied weights stay tied
        packed.packed = DerivedWeights(pack)
        packed.float32_few_rows = float32_few_rows
        return packed

    def cpu_inference(self, x: torch.Tensor) -> bool:
        """Float32 or bfloat16 (input and weight alike) on CPU without autograd: where a packed (or quantized) copy
        of the weight may be used."""
        weight = self.weight
        return (
            x.device.type == "cpu"
            and x.dtype == weight.dtype
            and weight.dtype in PACKED_DTYPES
            and weight.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not self.cpu_inference(x):
            return functional.linear(x, weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        out = packed_product(x.reshape(-1, self.in_features), self.packed_weight(), bias, self.few_rows_weight())
        return out.view(*x.shape[:-1], self.out_features)

    def packed_weight(self) -> torch.Tensor:
        """The oneDNN copy of the weight, packed on first use and again after the weight changes."""
        return self.packed.of(self.weight)

    def few_rows_weight(self) -> torch.Tensor | None:
        """The dense float32 weight, for `packed_product`'s few-row kernel where it was asked for; else None."""
        return self.weight.detach() if self.float32_few_rows and self.weight.dtype == torch.float32 else None


class StackedLinears:
    """Linear layers that read the same input, multiplied as one product: their weights (and biases) stacked and
    pre-packed together, their outputs side by side in one `[rows, sum of out_features]` tensor.

    A decode step's products are small, so a call's fixed cost and the thread split of a narrow output weigh: one
    call for q/k/v and one for gate/up measured 1.1-1.5x faster than five on SmolLM2's shapes at 1-512 rows. Each
    output column is the same dot product as in its own layer, bitwise (checked in tests). For float32 or bfloat16
    CPU inference only (the caller's to know): packs on first use and again when any weight changes; the biases are
    read at each call."""

    def __init__(self, linears: Sequence[PackedLinear]) -> None:
        if not self.stackable(linears):
            raise ValueError("StackedLinears takes pre-packed layers of one dtype and input width, all biased or none")
        self.linears = tuple(linears)
        self._packed: DerivedWeights[torch.Tensor] = DerivedWeights(lambda *weights: pack(torch.cat(weights)))
        self._out_features = sum(linear.out_features for linear in linears)

    @staticmethod
    def stackable(linears: Sequence[nn.Module]) -> bool:
        return (
            len(linears) > 0
            and all(type(linear) is PackedLinear for linear in linears)
            and len({(linear.in_features, linear.bias is None, linear.weight.dtype) for linear in linears}) == 1
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x`: `[rows, in_features]` in the weights' dtype. Biases as a `PackedLinear` reads its own: at each call.
        Float32 steps of a few rows, where asked for, take the few-row kernel on each layer's dense weight (none is
        stacked), each writing its columns of one output."""
        if x.shape[0] <= few_rows_limit(torch.float32) and self.linears[0].few_rows_weight() is not None:
            few_rows = cpu_kernels.few_rows(torch.float32)
            if few_rows is not None:
                return self._few_rows(few_rows, x.contiguous())
        weight = self._packed.of(*(linear.weight for linear in self.linears))
        biases = [linear.bias.detach() for linear in self.linears if linear.bias is not None]
        return packed_product(x, weight, torch.cat(biases) if biases else None)

    def _few_rows(self, few_rows: cpu_kernels.FewRows, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self._out_features)
        first = 0
        for linear in self.linears:
            bias = None if linear.bias is None else linear.bias.detach()
            few_rows(x, linear.weight.detach(), bias, out[:, first : first + linear.out_features])
            first += linear.out_features
        return out


def prepack(model: Any, *, float32_few_rows: bool = False) -> int:
    """Swaps every float32 or bfloat16 CPU `nn.Linear` in `model` for a `PackedLinear`; returns how many. No-op
    without oneDNN. `float32_few_rows`: float32 steps of up to `few_rows_limit` rows take the few-row kernel (faster,
    outputs close to but not bitwise `generate`'s)."""
    if not available():
        return 0
    wrap = functools.partial(PackedLinear.wrap, float32_few_rows=float32_few_rows)
    return swap_linears(model, wrap, lambda linear: type(linear) is nn.Linear, PACKED_DTYPES)


def swap_linears(
    model: Any,
    wrap: Callable[[nn.Linear], nn.Module],
    wanted: Callable[[nn.Linear], bool],
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> int:
    """Replaces each CPU linear layer of `model` with weights of one of `dtypes` that `wanted` accepts by
    `wrap(layer)`; returns how many. A layer reached through two parents (tied weights) is wrapped once and stays
    shared."""
    wrapped: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child.weight.dtype in dtypes
                and child.weight.device.type == "cpu"
                and wanted(child)
            ):
                if id(child) not in wrapped:
                    wrapped[id(child)] = wrap(child)
                setattr(parent, name, wrapped[id(child)])
    return len(wrapped)
