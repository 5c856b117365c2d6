"""Llama-family decoder layers for the CPU engine in half the tensor ops of the library's, with the same arithmetic.

On CPU a lone request's decode step is bound by op dispatch, not by its matrix multiplies: the library's layer runs
about 86 tensor ops and 13 module calls (views, no-op dtype round trips, `rotate_half`'s slices and `cat`, ...),
which on SmolLM2's 30 layers took ~50 ms of a ~90 ms token where the matrix multiplies take ~38. The layer forward
installed here computes the same thing in ~40 ops and no module calls:
- RMSNorm as one native call (`cpu_kernels.rms_norm`, torch's bits, checked before use), else one `torch.rms_norm`
  (bitwise equal to the library's five-op version);
- the pre-packed projections (`prepack.py`) called directly, q/k/v as one product and gate/up as another over
  their stacked weights (`StackedLinears`: the same bits per column, 4 products a layer instead of 7, which made a
  16-row decode step ~9 % faster on SmolLM2);
- rotary embedding as `x * cos + roll(x) * signed_sin`, where `signed_sin` carries `rotate_half`'s minus sign
  (the same products and sums, so the same bits), on q and k together, with `cos` / `signed_sin` made once per
  step for every layer;
- SiLU, the gating product and both residual adds in place.
Steps of up to `few_rows_limit` rows (`prepack.py`: 6 to 32 by dtype and CPU) go further where the
few-row kernel serves the products (bfloat16, or float32 when asked for): the layer runs in native code
(`kernels/decoder_layer.c`), in one call for a step of decode rows only (the cache write and the decode attention
inside), else in two around the attention.
It serves only the engine's continuous-batching steps (a `read_index` in the step's arguments) with our attention
function; anything else (`generate`, training, another attention) runs the library's layer unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional

from worker.engine.attention import ATTENTION_NAME, varlen_sdpa_forward
from worker.engine.kernels import cpu_kernels
from worker.engine.paged_reads import decode_step
from worker.engine.prepack import PackedLinear, StackedLinears, few_rows_limit, packed_product

# Decoder layers whose forward this reproduces (checked against the library's, bitwise, in tests), by model type.
SUPPORTED_LAYERS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer"}
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class RotaryTables:
    """`cos` and `signed_sin` as `[tokens, 1, head_dim]`, made from a step's position embeddings once for all layers."""

    __slots__ = ("_source", "cos", "cos_rows", "signed_sin", "signed_sin_rows")

    def __init__(self) -> None:
        self._source: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cos = self.signed_sin = self.cos_rows = self.signed_sin_rows = torch.empty(0)

    def update(self, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> None:
        if position_embeddings is self._source:
            return
        cos, sin = position_embeddings  # [1, tokens, head_dim]
        half = sin.shape[-1] // 2
        self.cos_rows = cos[0].contiguous()  # [tokens, head_dim], as the native layer takes them
        self.signed_sin_rows = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        self.cos, self.signed_sin = self.cos_rows.unsqueeze(1), self.signed_sin_rows.unsqueeze(1)
        self._source = position_embeddings

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """`x * cos + rotate_half(x) * sin` for `[tokens, heads, head_dim]`, where `rotate_half(x)` is `roll(x)`
        with its first half negated."""
        rotated = torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(self.signed_sin)
        return (x * self.cos).add_(rotated)


def supports_config(config: Any) -> bool:
    """A model type whose layers this reproduces, with SiLU gating."""
    config = config.get_text_config()
    return config.model_type in SUPPORTED_LAYERS and config.hidden_act in ("silu", "swish")


def supports(layer: Any) -> bool:
    """A supported layer class with every projection pre-packed (`PackedLinear`, or its int8 kind) on the CPU."""
    if type(layer).__name__ not in SUPPORTED_LAYERS.values():
        return False
    return all(isinstance(layer.get_submodule(name), PackedLinear) for name in (*_PROJECTIONS, *_MLP))


def install(model: Any) -> bool:
    """Gives every decoder layer of `model` the lean forward, where all are supported. True when installed."""
    layers = list(getattr(model.get_decoder(), "layers", []))
    if not supports_config(model.config) or not layers or not all(supports(layer) for layer in layers):
        return False
    rotary = RotaryTables()  # shared: the first layer of a step fills it for the others
    for layer in layers:
        if "forward" not in vars(layer):
            layer.forward = _lean_forward(layer, type(layer).forward.__get__(layer), rotary)
    return True


def uninstall(model: Any) -> None:
    for layer in getattr(model.get_decoder(), "layers", []):
        vars(layer).pop("forward", None)


def _lean_forward(layer: Any, library_forward: Any, rotary: RotaryTables) -> Any:
    attn = layer.self_attn
    q_proj, k_proj = attn.q_proj, attn.k_proj
    attention_in, output, mlp_in, down_proj = (product for product, _ in layer_products(layer))
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    hidden_size = norm_in.weight.shape[0]
    rms_norm = _rms_norm(hidden_size, norm_in.weight.dtype)
    head_dim = attn.head_dim
    heads = q_proj.out_features // head_dim
    rotated_width = q_proj.out_features + k_proj.out_features  # q and k, side by side in `attention_in`'s output
    intermediate = layer.get_submodule(_MLP[0]).out_features
    native = _native_layer(layer, hidden_size)
    kv_heads = k_proj.out_features // head_dim
    scale = head_dim**-0.5 if attn.scaling is None else float(attn.scaling)  # as `paged_attention` takes it

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if (
            "read_index" not in kwargs
            or position_embeddings is None
            or torch.is_grad_enabled()
            or attn.config._attn_implementation != ATTENTION_NAME
        ):
            return library_forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        rotary.update(position_embeddings)
        residual = hidden_states[0]  # [tokens, hidden]
        tokens = residual.shape[0]
        in_one_call = native if tokens <= few_rows_limit(residual.dtype) else None
        if in_one_call is not None:  # native code: the whole layer, or the norm, q/k/v and rotary in one call
            halves = in_one_call.halves()
            residual = residual.contiguous()
            step = None if cache is None else decode_step(cache, attn.layer_idx, kwargs)
            if step is not None:  # decode rows only: the whole layer, cache write and attention too, in one call
                cache_view, writes = step
                cos, signed_sin = rotary.cos_rows, rotary.signed_sin_rows
                return in_one_call.kernel.decode_step(
                    halves, residual, cos, signed_sin, cache_view, writes, scale
                ).unsqueeze(0)
            states = halves[0](residual, rotary.cos_rows, rotary.signed_sin_rows)
            states = states.view(tokens, -1, head_dim).transpose(0, 1).unsqueeze(0)  # [1, all heads, tokens, dim]
            query, key, value = states[:, :heads], states[:, heads : heads + kv_heads], states[:, heads + kv_heads :]
        else:
            x = rms_norm(residual, norm_in.weight, norm_in.variance_epsilon)
            qkv = attention_in(x)  # [tokens, (heads + 2 * kv_heads) * head_dim]
            rotated = rotary.apply(qkv[:, :rotated_width].view(tokens, -1, head_dim)).transpose(0, 1).unsqueeze(0)
            query, key = rotated[:, :heads], rotated[:, heads:]
            value = qkv[:, rotated_width:].view(tokens, -1, head_dim).transpose(0, 1).unsqueeze(0)
        kwargs.update(position_ids=position_ids, use_cache=use_cache)
        if cache is not None:
            key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
        attended, _ = varlen_sdpa_forward(attn, query, key, value, attention_mask, scaling=attn.scaling, **kwargs)
        if in_one_call is not None:  # output projection, residual, norm, MLP, residual in one native call
            return halves[1](attended.reshape(tokens, -1).contiguous(), residual).unsqueeze(0)
        hidden = output(attended.view(tokens, -1)).add_(residual)
        x = rms_norm(hidden, norm_post.weight, norm_post.variance_epsilon)
        gate_up = mlp_in(x)  # [tokens, 2 * intermediate]
        gated = functional.silu(gate_up[:, :intermediate]).mul_(gate_up[:, intermediate:])
        return down_proj(gated).add_(hidden).unsqueeze(0)

    return forward


class _NativeLayer:
    """A layer's weights (float32 or bfloat16) bound to the native decoder layer (`cpu_kernels.DecoderLayer`): once,
    and again whenever a parameter of the layer is replaced or its storage swapped (its tensors' addresses are
    compared at every call, a few microseconds), so the weights used are always the modules' own."""

    def __init__(self, layer: Any, kernel: cpu_kernels.DecoderLayer, head_dim: int) -> None:
        self.kernel, self.head_dim = kernel, head_dim
        self.norm_in, self.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        self.attention = tuple(layer.get_submodule(name) for name in _PROJECTIONS[:3])
        self.output = layer.get_submodule(_PROJECTIONS[3])
        self.mlp = tuple(layer.get_submodule(name) for name in _MLP)
        self._parameters = [
            (module._parameters, name)
            for module in (self.norm_in, *self.attention, self.output, self.norm_post, *self.mlp)
            for name in ("weight", "bias")
            if name in module._parameters
        ]
        self._bound_to: tuple[object, ...] = ()
        self._in: cpu_kernels.AttentionIn | None = None
        self._out: cpu_kernels.AttentionOut | None = None

    def halves(self) -> tuple[cpu_kernels.AttentionIn, cpu_kernels.AttentionOut]:
        """The halves bound to the layer's current weights (and norm epsilons)."""
        tensors = [parameters[name] for parameters, name in self._parameters]
        addresses = (None if tensor is None else tensor.data_ptr() for tensor in tensors)
        now = (*addresses, self.norm_in.variance_epsilon, self.norm_post.variance_epsilon)
        if now != self._bound_to or self._in is None or self._out is None:
            norm_in = (self.norm_in.weight, self.norm_in.variance_epsilon)
            self._in = self.kernel.bind_in(norm_in, *_weights_and_biases(self.attention), self.head_dim)
            norm_post = (self.norm_post.weight, self.norm_post.variance_epsilon)
            output = (self.output.weight, self.output.bias)
            self._out = self.kernel.bind_out(output, norm_post, *_weights_and_biases(self.mlp))
            self._bound_to = now
        return self._in, self._out


def _weights_and_biases(linears: tuple[Any, ...]) -> tuple[Any, Any]:
    return tuple(linear.weight for linear in linears), tuple(linear.bias for linear in linears)


def _native_layer(layer: Any, hidden_size: int) -> _NativeLayer | None:
    """The layer on the native decoder-layer code, where its products of a few rows take the few-row kernel (whose
    rounding the native code shares): bfloat16 layers wherever that kernel builds, float32 ones where the operator
    asked for it (`LLMQ_FLOAT32_FEW_ROWS`); and where the native layer builds here. Else None."""
    linears = [layer.get_submodule(name) for name in (*_PROJECTIONS, *_MLP)]
    if not all(type(linear) is PackedLinear for linear in linears):
        return None
    dtype = layer.input_layernorm.weight.dtype
    if any(linear.weight.dtype != dtype for linear in linears):
        return None
    if dtype == torch.float32 and not all(linear.few_rows_weight() is not None for linear in linears):
        return None  # not asked for: no kernel is built (nor a missing compiler warned about)
    if cpu_kernels.few_rows(dtype) is None:
        return None
    kernel = cpu_kernels.decoder_layer(hidden_size, dtype)
    return None if kernel is None else _NativeLayer(layer, kernel, layer.self_attn.head_dim)


def _rms_norm(width: int, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """RMSNorm over rows of `width` as `(x, weight, eps) -> normed`: the native one for float32 where it reproduces
    torch's here (one call instead of seven ops: about 3 % of a SmolLM2 decode step), else `torch.rms_norm`. In
    another dtype (bfloat16) the library's own steps: it rounds the normed rows before the weight multiplies them,
    where `torch.rms_norm` rounds once at the end, and a bit's difference there moves greedy outputs. Its float32
    part is then the native norm with a weight of ones (times 1.0 is exact): four ops instead of eight."""
    native = cpu_kernels.rms_norm(width)
    if dtype == torch.float32:
        if native is not None:
            return native
        return lambda x, weight, eps: torch.rms_norm(x, (width,), weight, eps)
    if native is None:
        return _library_rms_norm
    ones = torch.ones(width)

    def rounded_then_weighted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * native(x.float(), ones, eps).to(x.dtype)

    return rounded_then_weighted


def _library_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm.forward`'s arithmetic: float32 inside, rounded to `x`'s dtype, then times the weight."""
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def layer_products(layer: Any) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """The matrix products the lean forward runs for `layer`, in order, each with its input width: q/k/v stacked,
    the output projection, gate/up stacked, down. (`bench.engine` times these for its matmul-only bound.)"""
    q_proj, k_proj, v_proj, o_proj = (layer.get_submodule(name) for name in _PROJECTIONS)
    gate_proj, up_proj, down_proj = (layer.get_submodule(name) for name in _MLP)
    return [
        (_stacked(q_proj, k_proj, v_proj), q_proj.in_features),
        (_projection(o_proj), o_proj.in_features),
        (_stacked(gate_proj, up_proj), gate_proj.in_features),
        (_projection(down_proj), down_proj.in_features),
    ]


def _stacked(*linears: PackedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """Linear layers that read the same input as one function of it, their outputs side by side: one product where
    they stack (float32, bfloat16), else each its own (int8) and the outputs concatenated."""
    if StackedLinears.stackable(linears):
        return StackedLinears(linears)
    projections = [_projection(linear) for linear in linears]
    return lambda x: torch.cat([project(x) for project in projections], dim=-1)


def _projection(linear: PackedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear` as a function of 2-D rows: a pre-packed layer straight to the oneDNN kernel (no module call, no
    reshapes); another kind (int8) through its own forward."""
    if type(linear) is not PackedLinear:
        return linear

    def project(x: torch.Tensor) -> torch.Tensor:
        return packed_product(x, linear.packed_weight(), linear.bias, linear.few_rows_weight())

    return project
