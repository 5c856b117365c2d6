"""Each native kernel's C signature, declared once here and used by both sides.

The build (`cpu_kernels._built`) writes these prototypes into a header that the compiler force-includes before the
kernel's source (`-include`), so a definition that disagrees with its declaration in any type is a compile error,
and ctypes takes its `argtypes` / `restype` from the same table (`bind`): the C code trusts every argument it gets,
so a mismatch would otherwise be silent memory corruption. `tests/engine/test_kernel_signatures.py` also checks the
parameter names against the sources, which C itself does not compare.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

# The C types a kernel may take, and how ctypes passes each (pointers as plain addresses: `tensor.data_ptr()`).
_ARGUMENT_TYPES: dict[str, Any] = {
    "const float *": ctypes.c_void_p,
    "float *": ctypes.c_void_p,
    "const uint16_t *": ctypes.c_void_p,  # bfloat16
    "uint16_t *": ctypes.c_void_p,
    "const int64_t *": ctypes.c_void_p,
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
}
_RESULT_TYPES: dict[str, Any] = {"int": ctypes.c_int, "void": None}


@dataclass(frozen=True, slots=True)
class Signature:
    """One exported C function: its result type and its `(C type, name)` parameters, in order."""

    name: str
    result: str
    parameters: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        unknown = [c_type for c_type, _ in self.parameters if c_type not in _ARGUMENT_TYPES]
        if self.result not in _RESULT_TYPES or unknown:
            raise ValueError(f"{self.name}: no ctypes mapping for {unknown or self.result!r}")

    def declaration(self) -> str:
        """The C declaration, as the source writes its definition (`const float *query`, `int heads`)."""
        parameters = ", ".join(_parameter(c_type, name) for c_type, name in self.parameters)
        return f"{self.result} {self.name}({parameters})"

    def bind(self, library: ctypes.CDLL) -> Any:
        """The function from a loaded library, with its ctypes types set from this declaration."""
        function = getattr(library, self.name)
        function.restype = _RESULT_TYPES[self.result]
        function.argtypes = [_ARGUMENT_TYPES[c_type] for c_type, _ in self.parameters]
        return function


def _parameter(c_type: str, name: str) -> str:
    return f"{c_type}{name}" if c_type.endswith("*") else f"{c_type} {name}"


def header(*signatures: Signature) -> str:
    """The header the build force-includes: every declaration, so the compiler checks each definition against it."""
    lines = ["/* Generated from worker/engine/kernels/signatures.py at build time. */", "#include <stdint.h>"]
    return "\n".join([*lines, *(f"{signature.declaration()};" for signature in signatures), ""])


PAGED_DECODE = Signature(
    "llmq_paged_decode",
    "int",
    (
        ("const float *", "query"),
        ("const float *", "keys"),
        ("const float *", "values"),
        ("const int64_t *", "index"),
        ("const int64_t *", "starts"),
        ("const int64_t *", "lengths"),
        ("const int64_t *", "query_rows"),
        ("int64_t", "requests"),
        ("int", "heads"),
        ("int", "kv_heads"),
        ("int", "head_dim"),
        ("float", "scale"),
        ("float *", "out"),
        ("int", "threads"),
    ),
)
PAGED_DECODE_BF16 = Signature(  # the same kernel built for a bfloat16 cache (`-DLLMQ_KV_BFLOAT16`)
    "llmq_paged_decode_bf16",
    "int",
    tuple(
        ("const uint16_t *", name) if name in ("keys", "values") else (c_type, name)
        for c_type, name in PAGED_DECODE.parameters
    ),
)
RMS_NORM = Signature(
    "llmq_rms_norm",
    "void",
    (
        ("const float *", "x"),
        ("const float *", "weight"),
        ("float *", "out"),
        ("int64_t", "rows"),
        ("int64_t", "width"),
        ("float", "eps"),
        ("int", "lanes"),
        ("int", "threads"),
    ),
)
FEW_ROWS_BF16 = Signature(
    "llmq_few_rows_bf16",
    "void",
    (
        ("const uint16_t *", "x"),
        ("const uint16_t *", "weight"),
        ("const uint16_t *", "bias"),
        ("uint16_t *", "out"),
        ("int64_t", "rows"),
        ("int64_t", "in_features"),
        ("int64_t", "out_features"),
        ("int", "threads"),
    ),
)
FEW_ROWS_FLOAT32 = Signature(  # `out_stride`: the output's row length, above `out_features` for a column slice
    "llmq_few_rows_float32",
    "void",
    (
        ("const float *", "x"),
        ("const float *", "weight"),
        ("const float *", "bias"),
        ("float *", "out"),
        ("int64_t", "rows"),
        ("int64_t", "in_features"),
        ("int64_t", "out_features"),
        ("int64_t", "out_stride"),
        ("int", "threads"),
    ),
)
ATTENTION_IN_FLOAT32 = Signature(  # `decoder_layer.c`: a layer's half before attention
    "llmq_attention_in_float32",
    "int",
    (
        ("const float *", "hidden"),
        ("const float *", "norm_weight"),
        ("float", "eps"),
        ("int", "lanes"),
        ("const float *", "q_weight"),
        ("const float *", "k_weight"),
        ("const float *", "v_weight"),
        ("const float *", "q_bias"),
        ("const float *", "k_bias"),
        ("const float *", "v_bias"),
        ("const float *", "cos"),
        ("const float *", "signed_sin"),
        ("float *", "qkv"),
        ("int64_t", "rows"),
        ("int64_t", "hidden_size"),
        ("int64_t", "q_width"),
        ("int64_t", "kv_width"),
        ("int64_t", "head_dim"),
        ("int", "threads"),
    ),
)
ATTENTION_OUT_FLOAT32 = Signature(  # `decoder_layer.c`: a layer's half after attention
    "llmq_attention_out_float32",
    "int",
    (
        ("const float *", "attended"),
        ("const float *", "residual"),
        ("const float *", "o_weight"),
        ("const float *", "o_bias"),
        ("const float *", "norm_weight"),
        ("float", "eps"),
        ("int", "lanes"),
        ("const float *", "gate_weight"),
        ("const float *", "up_weight"),
        ("const float *", "down_weight"),
        ("const float *", "gate_bias"),
        ("const float *", "up_bias"),
        ("const float *", "down_bias"),
        ("float *", "out"),
        ("int64_t", "rows"),
        ("int64_t", "hidden_size"),
        ("int64_t", "attended_width"),
        ("int64_t", "intermediate"),
        ("int", "threads"),
    ),
)
DECODER_LAYER_FLOAT32 = Signature(  # `decoder_layer.c`: a whole layer for a step of decode rows
    "llmq_decoder_layer_float32",
    "int",
    (
        *ATTENTION_IN_FLOAT32.parameters[:12],  # the first half's: hidden ... signed_sin
        ("float *", "key_cache"),
        ("float *", "value_cache"),
        ("const int64_t *", "write_index"),
        ("const int64_t *", "index"),
        ("const int64_t *", "starts"),
        ("const int64_t *", "lengths"),
        ("const int64_t *", "query_rows"),
        ("float", "scale"),
        *ATTENTION_OUT_FLOAT32.parameters[2:4],  # o_weight, o_bias
        ("const float *", "norm_post_weight"),
        ("float", "eps_post"),
        *ATTENTION_OUT_FLOAT32.parameters[7:14],  # gate_weight ... down_bias, out
        *ATTENTION_IN_FLOAT32.parameters[13:18],  # rows, hidden_size, q_width, kv_width, head_dim
        ("int64_t", "intermediate"),
        ("int", "threads"),
    ),
)


def _bfloat16_twin(signature: Signature) -> Signature:
    """`decoder_layer.c`'s function built with -DLLMQ_BFLOAT16: every tensor bfloat16 (`_bf16`, not `_float32`)."""
    bfloat16 = {"const float *": "const uint16_t *", "float *": "uint16_t *"}
    return Signature(
        signature.name.replace("_float32", "_bf16"),
        signature.result,
        tuple((bfloat16.get(c_type, c_type), name) for c_type, name in signature.parameters),
    )


ATTENTION_IN_BF16 = _bfloat16_twin(ATTENTION_IN_FLOAT32)
ATTENTION_OUT_BF16 = _bfloat16_twin(ATTENTION_OUT_FLOAT32)
DECODER_LAYER_BF16 = _bfloat16_twin(DECODER_LAYER_FLOAT32)
