"""The CPU engine's native kernels: decode attention straight from the paged cache (`paged_decode.c`), RMSNorm
in one call with torch's exact arithmetic (`rms_norm.c`) and products of a few rows at the speed the weights can be
read (`few_rows.c` for bfloat16, `few_rows_float32.c` for float32 when asked: `LLMQ_FLOAT32_FEW_ROWS`).

torch has no attention that reads keys through an index, so the pure-torch path copies every decode row's keys and
values into a padded layout first (`paged_reads.DecodeGroup`), which cost as much as the attention itself. The C
kernel reads them in place: measured here 1.5-2x faster than gather + SDPA for 32 decode rows, 2.5x for one.
oneDNN's bfloat16 products read a decode step's weights at half the speed the memory gives; `few_rows.c` streams
them (`few_rows()`, only where the CPU has AVX-512 BF16). Its float32 twin (`few_rows(torch.float32)`, AVX2 or
AVX-512) streams float32 weights faster than oneDNN's packed products too, but sums in another order, so the engine
runs it only when the operator trades float32's bitwise agreement with `generate` for it.
torch's CPU RMSNorm is seven tensor ops; the native one is one call that `rms_norm()` hands out only for a row
width where it has just given torch's bits exactly.

Each is compiled on first use with the machine's C compiler (`cc`, or `$CC`) for this very CPU (`-march=native`)
and cached under `~/.cache/llmq/kernels` (`$XDG_CACHE_HOME`), keyed by the source, its declared signature, the flags,
the compiler as named and the CPU, so a cache shared between different machines never hands one a binary for
another; the cache is read before a compiler is looked for, so an image whose build stage filled it needs none.
Each C signature is declared once (`signatures.py`): the compiler checks the source against it and ctypes binds
from it. Where there is no compiler (or it fails), `load()` and `rms_norm()` return None, each logging one warning
that names what is missing and the slower torch path that runs instead, and the engine keeps that path; the worker
exports which one runs as `llmq:engine_path` (`library.start` records it, `worker/metrics.py` serves it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.config import KernelBuildSettings
from worker.engine.kernels.signatures import (
    ATTENTION_IN_BF16,
    ATTENTION_IN_FLOAT32,
    ATTENTION_OUT_BF16,
    ATTENTION_OUT_FLOAT32,
    DECODER_LAYER_BF16,
    DECODER_LAYER_FLOAT32,
    FEW_ROWS_BF16,
    FEW_ROWS_FLOAT32,
    PAGED_DECODE,
    PAGED_DECODE_BF16,
    RMS_NORM,
    Signature,
    header,
)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
RMS_NORM_SOURCE = Path(__file__).with_name("rms_norm.c")
FEW_ROWS_SOURCE = Path(__file__).with_name("few_rows.c")
FEW_ROWS_FLOAT32_SOURCE = Path(__file__).with_name("few_rows_float32.c")
DECODER_LAYER_SOURCE = Path(__file__).with_name("decoder_layer.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
EXACT_FLAGS = (*FLAGS, "-ffp-contract=off")  # no fused multiply-add where torch rounds twice
# What runs instead where a kernel cannot be built: named in its warning.
PAGED_DECODE_FALLBACK = "decode rows' keys and values copied into padded groups for torch SDPA, slower decode"
RMS_NORM_FALLBACK = "torch.rms_norm, several tensor ops a norm instead of one call"
FEW_ROWS_FALLBACK = "oneDNN's bfloat16 products for every step, about half as fast for a few rows"
FEW_ROWS_FLOAT32_FALLBACK = "oneDNN's packed float32 products for every step, slower for a few rows"
DECODER_LAYER_FALLBACK = "the lean layer's torch ops around the few-row products, slower for a few rows"
# The decoder layer's functions by the dtype it was built for (`decoder_layer.c`, bfloat16 with -DLLMQ_BFLOAT16).
_DECODER_LAYER_SIGNATURES = {
    torch.float32: (ATTENTION_IN_FLOAT32, ATTENTION_OUT_FLOAT32, DECODER_LAYER_FLOAT32),
    torch.bfloat16: (ATTENTION_IN_BF16, ATTENTION_OUT_BF16, DECODER_LAYER_BF16),
}


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A step's decode rows for the kernel: row i attends query row `query_rows[i]` over the cache rows
    `index[starts[i] : starts[i] + lengths[i]]`. 1-D int64 tensors (made contiguous), checked here once, so that a
    call only compares their extremes with the step's tensors: the C code trusts every offset it is given."""

    query_rows: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    index: torch.Tensor
    last_query_row: int = field(init=False, default=-1)
    last_cache_row: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        for name in ("query_rows", "starts", "lengths", "index"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.int64 or tensor.dim() != 1 or tensor.device.type != "cpu":
                shape = tuple(tensor.shape)
                raise ValueError(f"DecodeRows.{name} must be a 1-D int64 CPU tensor, not {tensor.dtype} {shape}")
            object.__setattr__(self, name, tensor.contiguous())
        count = self.query_rows.numel()
        if self.starts.numel() != count or self.lengths.numel() != count:
            raise ValueError("DecodeRows needs one start and one length per query row")
        if count == 0:
            return
        ends = self.starts + self.lengths
        if int(self.lengths.min()) < 1 or int(self.starts.min()) < 0 or int(ends.max()) > self.index.numel():
            raise ValueError("DecodeRows spans must be non-empty and lie within the index")
        if int(self.query_rows.min()) < 0 or int(self.index.min()) < 0:
            raise ValueError("DecodeRows rows must not be negative")
        object.__setattr__(self, "last_query_row", int(self.query_rows.max()))
        object.__setattr__(self, "last_cache_row", int(self.index.max()))


@dataclass(frozen=True, slots=True)
class DecodeWrites:
    """A step whose rows are all decode rows, for `DecoderLayer.decode_step`: row r's new key and value go to cache
    row `write_index[r]`, then `rows` are attended (every row of the step once). Checked here once a step, so that a
    layer's call only compares the extremes with its cache."""

    rows: DecodeRows
    write_index: torch.Tensor
    last_write_row: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        index = self.write_index
        if index.dtype != torch.int64 or index.dim() != 1 or not index.is_cpu:
            raise ValueError(f"DecodeWrites.write_index must be a 1-D int64 CPU tensor, not {index.dtype}")
        object.__setattr__(self, "write_index", index.contiguous())
        count = self.rows.query_rows.numel()
        if index.numel() != count or count == 0:
            raise ValueError("DecodeWrites needs one cache row to write per decode row, and a row")
        if not torch.equal(self.rows.query_rows.sort().values, torch.arange(count)) or int(index.min()) < 0:
            raise ValueError("DecodeWrites rows must be the step's rows, each once, and cache rows not negative")
        object.__setattr__(self, "last_write_row", int(index.max()))


class PagedDecode:
    """The loaded kernel, for a cache of one dtype (float32, or bfloat16)."""

    def __init__(self, library: ctypes.CDLL, cache_dtype: torch.dtype = torch.float32) -> None:
        self._function = (PAGED_DECODE if cache_dtype == torch.float32 else PAGED_DECODE_BF16).bind(library)
        self.cache_dtype = cache_dtype

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: DecodeRows,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """`query`, `out`: `[tokens, heads, head_dim]`, float32; `keys`, `values`: `[cache rows, kv_heads, head_dim]`
        (the library's per-layer views, whose row counts may differ) in the kernel's cache dtype; all contiguous.
        Writes the decode rows of `out`, leaves its other rows alone."""
        _require_contiguous("paged_decode", torch.float32, query, out)
        _require_contiguous("paged_decode", self.cache_dtype, keys, values, what="keys and values")
        if query.dim() != 3 or keys.dim() != 3 or values.shape[1:] != keys.shape[1:] or out.shape != query.shape:
            raise ValueError(f"paged_decode: query {tuple(query.shape)} does not fit keys {tuple(keys.shape)}")
        heads, kv_heads, head_dim = query.shape[1], keys.shape[1], keys.shape[2]
        if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads or query.shape[2] != head_dim:
            raise ValueError(f"paged_decode: query {tuple(query.shape)} does not fit keys {tuple(keys.shape)}")
        if rows.last_query_row >= query.shape[0] or rows.last_cache_row >= min(keys.shape[0], values.shape[0]):
            raise ValueError("paged_decode: DecodeRows point past the query or the cache")
        status = self._function(
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), rows.index.data_ptr(), rows.starts.data_ptr(),
            rows.lengths.data_ptr(), rows.query_rows.data_ptr(), rows.query_rows.numel(), heads, kv_heads, head_dim,
            scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("paged_decode could not allocate its score buffers")


class RmsNorm:
    """The loaded RMSNorm for rows of one width (the one it was checked on), summing in the vector width that
    reproduced torch there."""

    def __init__(self, library: ctypes.CDLL, width: int, lanes: int) -> None:
        self._function = RMS_NORM.bind(library)
        self.width, self.lanes = width, lanes

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`torch.rms_norm(x, (width,), weight, eps)` for contiguous float32 `[rows, width]` rows on the CPU."""
        _require_contiguous("rms_norm", torch.float32, x, weight)
        if x.dim() != 2 or x.shape[1] != self.width or weight.shape != (self.width,):
            shapes = f"rows {tuple(x.shape)} or weight {tuple(weight.shape)}"
            raise ValueError(f"rms_norm of width {self.width}: {shapes} do not fit")
        out = torch.empty_like(x)
        threads = torch.get_num_threads()
        self._function(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], self.width, eps, self.lanes, threads
        )
        return out


class FewRows:
    """The loaded product for a few rows of one dtype: bfloat16 (`few_rows.c`) or float32 (`few_rows_float32.c`)."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype = torch.bfloat16) -> None:
        self._function = (FEW_ROWS_BF16 if dtype == torch.bfloat16 else FEW_ROWS_FLOAT32).bind(library)
        self.dtype = dtype

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x @ weight.T + bias` for contiguous CPU `x` `[rows, in]`, `weight` `[out, in]`, `bias` `[out]` of the
        kernel's dtype. Float32 may write into `out`, `[rows, out]` with contiguous rows: a column slice of a wider
        output (products stacked side by side); returned."""
        _require_contiguous("few_rows", self.dtype, *((x, weight) if bias is None else (x, weight, bias)))
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"few_rows: rows {tuple(x.shape)} do not fit weight {tuple(weight.shape)}")
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"few_rows: bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
        shape = (x.shape[0], weight.shape[0])
        if out is None:
            out = x.new_empty(shape)
        elif self.dtype != torch.float32 or out.dtype != self.dtype or out.device.type != "cpu":
            raise ValueError("few_rows: an `out` is taken by the float32 kernel only, float32 on the CPU")
        elif out.shape != shape or out.stride(1) != 1 or (shape[0] > 1 and out.stride(0) < shape[1]):
            raise ValueError(f"few_rows: out {tuple(out.shape)} is no {shape} of contiguous rows")
        sizes = [x.shape[0], x.shape[1], weight.shape[0]]
        if self.dtype == torch.float32:
            sizes.append(out.stride(0))
        self._function(
            x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), *sizes,
            torch.get_num_threads(),
        )  # fmt: skip
        return out


class DecoderLayer:
    """The loaded decoder layer for hidden rows of one width and one dtype (float32, or bfloat16: every tensor it
    takes), in halves: before attention (`attention_in`) and after it (`attention_out`), or whole for a step of
    decode rows (`decode_step`). Every weight `[out, in]` and bias is checked against the others' shapes (the C code
    trusts them); biases may be None. `bind_in` / `bind_out` check a layer's weights once and return its half as a
    call that checks only the rows it is given: the lean layer's steps call those (about a hundred checks a layer and
    step fewer); `attention_in` / `attention_out` bind and call at once."""

    def __init__(self, library: ctypes.CDLL, width: int, lanes: int, dtype: torch.dtype = torch.float32) -> None:
        signatures = _DECODER_LAYER_SIGNATURES[dtype]
        self._attention_in, self._attention_out, self._decode_step = (s.bind(library) for s in signatures)
        self.width, self.lanes, self.dtype = width, lanes, dtype

    def bind_in(
        self,
        norm: tuple[torch.Tensor, float],
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
        head_dim: int,
    ) -> AttentionIn:
        """The half before attention with these weights: `RMSNorm(hidden) * norm[0]` (eps `norm[1]`), then q, k and
        v (`weights`, `biases`), q and k rotated per head of `head_dim`."""
        _require_product("attention_in", weights, biases, self.width, None, self.dtype)
        _require_contiguous("attention_in", self.dtype, norm[0])
        q_width, kv_width = weights[0].shape[0], weights[1].shape[0]
        if (
            weights[2].shape[0] != kv_width
            or norm[0].shape != (self.width,)
            or head_dim < 2
            or head_dim % 2
            or q_width % head_dim
            or kv_width % head_dim
        ):
            raise ValueError(f"attention_in: q {q_width}, k/v {kv_width}, head_dim {head_dim} do not fit")
        return AttentionIn(self, (norm[0], *weights, *biases), (norm[1], q_width, kv_width, head_dim))

    def bind_out(
        self,
        output: tuple[torch.Tensor, torch.Tensor | None],
        norm: tuple[torch.Tensor, float],
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    ) -> AttentionOut:
        """The half after attention with these weights: `output` = (o's weight, bias), `norm` the post-attention
        norm, `weights` and `biases` gate's, up's and down's."""
        attended_width = output[0].shape[1] if output[0].dim() == 2 else -1
        intermediate = weights[0].shape[0]
        _require_product("attention_out", output[:1], output[1:], attended_width, self.width, self.dtype)
        _require_product("attention_out", weights[:2], biases[:2], self.width, intermediate, self.dtype)
        _require_product("attention_out", weights[2:], biases[2:], intermediate, self.width, self.dtype)
        _require_contiguous("attention_out", self.dtype, norm[0])
        if norm[0].shape != (self.width,):
            raise ValueError(f"attention_out: norm {tuple(norm[0].shape)} does not fit rows of {self.width}")
        return AttentionOut(self, (*output, norm[0], *weights, *biases), (norm[1], attended_width, intermediate))

    def attention_in(
        self,
        hidden: torch.Tensor,
        norm: tuple[torch.Tensor, float],
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> torch.Tensor:
        """`[q | k | v]` of `RMSNorm(hidden) * norm[0]` (eps `norm[1]`), q and k rotated per head with `cos` and
        `signed_sin` (`[rows, head_dim]`, the sine's first half negated): `[rows, q_out + 2 * kv_out]`."""
        return self.bind_in(norm, weights, biases, cos.shape[-1])(hidden, cos, signed_sin)

    def attention_out(
        self,
        attended: torch.Tensor,
        residual: torch.Tensor,
        output: tuple[torch.Tensor, torch.Tensor | None],
        norm: tuple[torch.Tensor, float],
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    ) -> torch.Tensor:
        """`h + down(SiLU(gate(n)) * up(n))`, where `h = residual + o(attended)` with `output` = (o's weight, bias)
        and `n = RMSNorm(h) * norm[0]`; `weights` and `biases` are gate's, up's and down's: `[rows, width]`."""
        return self.bind_out(output, norm, weights, biases)(attended, residual)

    def decode_step(
        self,
        halves: tuple[AttentionIn, AttentionOut],
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        writes: DecodeWrites,
        scale: float,
    ) -> torch.Tensor:
        """A whole layer for a step of decode rows in one call: the `halves` (bound to its weights) around writing each
        row's new key and value into `cache` (the layer's `[cache rows, kv_heads, head_dim]` keys and values) and
        the decode attention `PagedDecode` runs, with the same bits as those calls in turn."""
        attention_in, attention_out = halves
        keys, values = cache
        _require_rows("decode_step", hidden, self.width, self.dtype)
        rows = hidden.shape[0]
        attention_in.check_rotary(rows, cos, signed_sin)
        _require_contiguous("decode_step", self.dtype, keys, values, what="keys and values")
        kv_width = attention_in.kv_width
        cache_rows = min(keys.shape[0], values.shape[0])
        if keys.dim() != 3 or values.shape[1:] != keys.shape[1:] or keys.shape[1] * keys.shape[2] != kv_width:
            raise ValueError(f"decode_step: keys {tuple(keys.shape)} do not hold rows of {kv_width}")
        if writes.write_index.numel() != rows or max(writes.last_write_row, writes.rows.last_cache_row) >= cache_rows:
            raise ValueError("decode_step: DecodeWrites do not fit the step's rows or the cache")
        heads, kv_heads = attention_out.attended_width // attention_in.head_dim, kv_width // attention_in.head_dim
        if (
            attention_in.kernel is not self  # bound by another width or dtype: the C code would misread them
            or attention_out.kernel is not self
            or attention_out.attended_width != attention_in.q_width
            or heads % kv_heads
        ):
            raise ValueError("decode_step: the halves are not one layer's of this kernel")
        decode = writes.rows
        out = hidden.new_empty(rows, self.width)
        status = self._decode_step(
            hidden.data_ptr(), *attention_in.pointers, cos.data_ptr(), signed_sin.data_ptr(), keys.data_ptr(),
            values.data_ptr(), writes.write_index.data_ptr(), decode.index.data_ptr(), decode.starts.data_ptr(),
            decode.lengths.data_ptr(), decode.query_rows.data_ptr(), scale, *attention_out.pointers,
            *attention_out.mlp_pointers, out.data_ptr(),
            rows, self.width, attention_out.attended_width, kv_width, attention_in.head_dim,
            attention_out.intermediate, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("decode_step could not allocate its scratch rows")
        return out


class AttentionIn:
    """A layer's half before attention, its weights checked (`DecoderLayer.bind_in`) and held, so they outlive the
    pointers handed to C (`pointers`: the norm's and the products', in the C functions' order). `kernel` is the
    layer kernel that bound it: `decode_step` takes only its own kernel's halves."""

    __slots__ = ("_held", "head_dim", "kernel", "kv_width", "pointers", "q_width")

    def __init__(
        self, kernel: DecoderLayer, tensors: tuple[torch.Tensor | None, ...], sizes: tuple[float, int, int, int]
    ) -> None:
        eps, q_width, kv_width, head_dim = sizes
        self.kernel, self._held = kernel, tensors
        norm_weight, *products = _pointers(tensors)
        self.pointers = (norm_weight, eps, kernel.lanes, *products)
        self.head_dim, self.kv_width, self.q_width = int(head_dim), int(kv_width), int(q_width)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`[q | k | v]` of `hidden` `[rows, width]`, with `cos` and `signed_sin` `[rows, head_dim]`."""
        kernel = self.kernel
        _require_rows("attention_in", hidden, kernel.width, kernel.dtype)
        rows = hidden.shape[0]
        self.check_rotary(rows, cos, signed_sin)
        qkv = hidden.new_empty(rows, self.q_width + 2 * self.kv_width)
        status = kernel._attention_in(
            hidden.data_ptr(), *self.pointers, cos.data_ptr(), signed_sin.data_ptr(), qkv.data_ptr(), rows,
            kernel.width, self.q_width, self.kv_width, self.head_dim, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("attention_in could not allocate its scratch rows")
        return qkv

    def check_rotary(self, rows: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        _require_contiguous("attention_in", self.kernel.dtype, cos, signed_sin)
        if cos.shape != (rows, self.head_dim) or signed_sin.shape != cos.shape:
            raise ValueError(f"attention_in: rotary {tuple(cos.shape)} does not fit {rows} rows of {self.head_dim}")


class AttentionOut:
    """A layer's half after attention, its weights checked (`DecoderLayer.bind_out`) and held (`pointers`: o's and
    the norm's, `mlp_pointers`: the MLP's, in the C functions' order); `kernel` as `AttentionIn`'s."""

    __slots__ = ("_held", "attended_width", "intermediate", "kernel", "mlp_pointers", "pointers")

    def __init__(
        self, kernel: DecoderLayer, tensors: tuple[torch.Tensor | None, ...], sizes: tuple[float, int, int]
    ) -> None:
        eps, attended_width, intermediate = sizes
        self.kernel, self._held = kernel, tensors
        self.attended_width, self.intermediate = int(attended_width), int(intermediate)
        o_weight, o_bias, norm_weight, *mlp = _pointers(tensors)
        self.pointers, self.mlp_pointers = (o_weight, o_bias, norm_weight, eps), tuple(mlp)

    def __call__(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output rows for `attended` `[rows, attended width]` and `residual` `[rows, width]`."""
        kernel = self.kernel
        _require_rows("attention_out", residual, kernel.width, kernel.dtype)
        _require_rows("attention_out", attended, self.attended_width, kernel.dtype)
        rows = residual.shape[0]
        if attended.shape[0] != rows:
            raise ValueError(f"attention_out: attended {tuple(attended.shape)} does not fit {rows} rows")
        out = residual.new_empty(rows, kernel.width)
        status = kernel._attention_out(
            attended.data_ptr(), residual.data_ptr(), *self.pointers, kernel.lanes, *self.mlp_pointers,
            out.data_ptr(), rows, kernel.width, self.attended_width, self.intermediate, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("attention_out could not allocate its scratch rows")
        return out


def _pointers(tensors: tuple[torch.Tensor | None, ...]) -> list[int | None]:
    return [None if tensor is None else tensor.data_ptr() for tensor in tensors]


def _require_rows(kernel: str, rows: torch.Tensor, width: int, dtype: torch.dtype) -> None:
    _require_contiguous(kernel, dtype, rows)
    if rows.dim() != 2 or rows.shape[1] != width:
        raise ValueError(f"{kernel}: rows {tuple(rows.shape)} are not [rows, {width}]")


def _require_product(
    kernel: str,
    weights: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor | None, ...],
    in_features: int,
    out_features: int | None,
    dtype: torch.dtype,
) -> None:
    """Weights `[out, in_features]` (all `out_features` wide where given), each bias None or `[out]`."""
    _require_contiguous(kernel, dtype, *weights, *(bias for bias in biases if bias is not None))
    for weight, bias in zip(weights, biases, strict=True):
        wrong_width = out_features is not None and weight.shape[0] != out_features
        if weight.dim() != 2 or weight.shape[1] != in_features or wrong_width:
            raise ValueError(f"{kernel}: weight {tuple(weight.shape)} does not take rows of {in_features}")
        if bias is not None and bias.shape != (weight.shape[0],):
            raise ValueError(f"{kernel}: bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")


def _require_contiguous(kernel: str, dtype: torch.dtype, *tensors: torch.Tensor, what: str = "tensors") -> None:
    """The C code reads raw memory of one dtype: anything else is refused before a pointer is handed over."""
    if any(t.dtype != dtype or not t.is_contiguous() or not t.is_cpu for t in tensors):
        raise ValueError(f"{kernel} takes contiguous {str(dtype).removeprefix('torch.')} CPU {what}")


@functools.cache
def load(cache_dtype: torch.dtype = torch.float32) -> PagedDecode | None:
    """The decode kernel for a float32 or bfloat16 cache, built (once per machine) and loaded; None where it cannot
    be built here, or for another dtype."""
    if cache_dtype == torch.float32:
        library = _library(SOURCE, PAGED_DECODE, FLAGS, "paged-decode kernel", PAGED_DECODE_FALLBACK)
    elif cache_dtype == torch.bfloat16:
        flags = (*FLAGS, "-DLLMQ_KV_BFLOAT16")
        library = _library(SOURCE, PAGED_DECODE_BF16, flags, "bfloat16 paged-decode kernel", PAGED_DECODE_FALLBACK)
    else:
        return None
    return None if library is None else PagedDecode(library, cache_dtype)


@functools.cache
def few_rows(dtype: torch.dtype = torch.bfloat16, source: Path | None = None) -> FewRows | None:
    """The few-row product for `dtype`, built and loaded: bfloat16 where the CPU has AVX-512 BF16, float32 where it
    has AVX2 and FMA or AVX-512; None elsewhere, for another dtype, or where it cannot be built. `source`: another
    version of the kernel's file, in a folder with the headers it includes (`bench.few_rows` times two side by side)."""
    if dtype == torch.bfloat16 and native_bfloat16():
        name, fallback = "few-row bfloat16 kernel", FEW_ROWS_FALLBACK
        library = _library(source or FEW_ROWS_SOURCE, FEW_ROWS_BF16, FLAGS, name, fallback)
    elif dtype == torch.float32:
        name, fallback = "few-row float32 kernel", FEW_ROWS_FLOAT32_FALLBACK
        library = _library(source or FEW_ROWS_FLOAT32_SOURCE, FEW_ROWS_FLOAT32, FLAGS, name, fallback)
    else:
        return None
    return None if library is None else FewRows(library, dtype)


@functools.cache
def decoder_layer(width: int, dtype: torch.dtype = torch.float32) -> DecoderLayer | None:
    """The decoder layer in native calls (`decoder_layer.c`) for hidden rows of `width` in `dtype`, built and loaded:
    float32 where the CPU has AVX2 and FMA or AVX-512, bfloat16 where it has AVX-512 BF16, and in both where the
    native RMSNorm gives torch's bits at `width` (the layer's norm is that one); else None, and the lean layer keeps
    its torch ops."""
    norm = rms_norm(width)
    if norm is None or dtype not in _DECODER_LAYER_SIGNATURES:
        return None
    if dtype == torch.bfloat16 and not native_bfloat16():
        return None
    name = f"{str(dtype).removeprefix('torch.')} decoder-layer kernel"
    flags = (*EXACT_FLAGS, "-DLLMQ_BFLOAT16") if dtype == torch.bfloat16 else EXACT_FLAGS
    library = _library(DECODER_LAYER_SOURCE, _DECODER_LAYER_SIGNATURES[dtype], flags, name, DECODER_LAYER_FALLBACK)
    return None if library is None else DecoderLayer(library, width, norm.lanes, dtype)


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16, which every CPU with AMX also has)."""
    return _torch_reports("_is_avx512_bf16_supported")


def avx512() -> bool:
    """Whether this CPU has AVX-512, for which the float32 few-row kernel is built with twice AVX2's vector width."""
    return _torch_reports("_is_avx512_supported")


def amx() -> bool:
    """Whether this CPU has AMX tiles, on which oneDNN's bfloat16 products outrun the few-row kernel past a few rows."""
    return _torch_reports("_is_amx_tile_supported")


def _torch_reports(check: str) -> bool:
    """torch's own CPU feature check `torch.cpu.<check>()`; False where this torch has none."""
    supported = getattr(torch.cpu, check, None)
    return bool(supported is not None and supported())


@functools.cache
def rms_norm(width: int) -> RmsNorm | None:
    """The native RMSNorm for rows of `width`, where it gives torch's bits on random rows here (each vector width
    torch may sum in is tried); else None, and the caller keeps `torch.rms_norm`."""
    if width < 1:
        return None
    library = _library(RMS_NORM_SOURCE, RMS_NORM, EXACT_FLAGS, "RMSNorm kernel", RMS_NORM_FALLBACK)
    if library is None:
        return None
    generator = torch.Generator().manual_seed(width)
    weight = torch.randn(width, generator=generator)
    shapes = ((1, 1.0), (16, 30.0), (67, 1e-3))  # rows and scale; 67 rows take the threaded path
    samples = [torch.randn(rows, width, generator=generator) * scale for rows, scale in shapes]
    for lanes in (8, 16):  # torch's float vectors: 8 lanes on x86 (AVX2 and AVX-512 builds) and NEON, 16 else
        norm = RmsNorm(library, width, lanes)
        if all(torch.equal(norm(x, weight, 1e-5), torch.rms_norm(x, (width,), weight, 1e-5)) for x in samples):
            return norm
    log.warning("native RMSNorm does not reproduce torch's for width %d here, using torch's", width)
    return None


def _library(
    source: Path, signatures: Signature | tuple[Signature, ...], flags: tuple[str, ...], name: str, fallback: str
) -> ctypes.CDLL | None:
    """`source` built with `flags` against its declared `signatures` (once per machine) and loaded; None where it
    cannot be built, with one warning naming why and the slower `fallback` that runs instead."""
    try:
        declared = signatures if isinstance(signatures, tuple) else (signatures,)
        return ctypes.CDLL(str(_built(source, declared, flags)))
    except subprocess.CalledProcessError as error:
        reason = f"{error}: {error.stderr.decode(errors='replace')[-800:]}"
    except (OSError, subprocess.SubprocessError) as error:
        reason = str(error)
    log.warning("native %s unavailable, using the torch path (%s): %s", name, fallback, reason)
    return None


def _compiler(settings: KernelBuildSettings) -> str:
    """The C compiler to build with: `$CC` where set (it must exist), else `cc` or `gcc` on PATH."""
    if settings.cc is not None:
        if shutil.which(settings.cc) is None:
            raise OSError(f"no C compiler: $CC={settings.cc!r} is not an executable on PATH")
        return settings.cc
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler: neither cc nor gcc is on PATH and $CC is not set")
    return compiler


def _built(source_path: Path, signatures: tuple[Signature, ...], flags: tuple[str, ...]) -> Path:
    """The cached build of `source_path`, built first on a miss. The cache is looked up before any compiler is:
    a runtime image that carries kernels its build stage compiled needs none (keyed by the compiler as named,
    `$CC` or `cc`, so both stages must name the same one)."""
    settings = KernelBuildSettings()  # read at every build, not once: a fixed compiler or cache may appear later
    source = source_path.read_bytes()
    included = [*sorted(source_path.parent.glob("*.h")), *_included_sources(source_path)]  # its #includes
    headers = b"".join(path.read_bytes() for path in included)
    declared = header(*signatures)
    named = (settings.cc or "cc").encode()
    key = hashlib.sha256(
        b"\0".join([source, headers, declared.encode(), " ".join(flags).encode(), named, _cpu_identity()])
    )
    target = _cache_dir(settings.xdg_cache_home) / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        compiler = _compiler(settings)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as staging:
            staged = Path(staging) / target.name
            declarations = Path(staging) / "llmq_kernel.h"
            declarations.write_text(declared)
            command = [compiler, *flags, "-include", str(declarations), "-o", str(staged), str(source_path)]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            os.replace(staged, target)  # atomic: processes building at once each install a whole file
    return target


def _included_sources(source_path: Path) -> list[Path]:
    """The kernel sources `source_path` includes (`#include "other.c"`), which its build key must cover too."""
    names = re.findall(rb'^#include "(\w+\.c)"', source_path.read_bytes(), flags=re.MULTILINE)
    return [source_path.with_name(name.decode()) for name in names]


def _cache_dir(xdg_cache_home: str | None) -> Path:
    base = xdg_cache_home or Path.home() / ".cache"
    return Path(base) / "llmq" / "kernels"


def _cpu_identity() -> bytes:
    """What `-march=native` depends on: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode() + platform.machine().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(wanted))).encode()
