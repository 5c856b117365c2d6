"""Which of our CPU fast paths the engine uses, decided in one place from the device and the model.

Our per-request/batched attention (`attention.py`), its paged cache reads (`paged_reads.py`, with the native decode
kernel of `kernels/cpu_kernels.py` where it builds) and the lean decoder layers (`lean_layers.py`) were measured to
win on CPU, where the library falls back to dense masked SDPA and a step's op dispatch costs more than its matrix
multiplies. On CUDA the library's own paths are better and must stay untouched: flash / paged kernels with a block
table, CUDA graphs, no host synchronisation per layer. So they are CPU-only, attention also needs plain full
attention, and lean layers a Llama-family layer. (The fused sampler, `sampling.py`, is not a choice made here: it
carries the per-request features and installs itself wherever CUDA graphs are off.)

`library.start` asks `choose(model, config.varlen_attention)` before the manager's warmup (switches attention when
`varlen_attention`, installs lean layers when `lean_layers`) and installs the paged reads after the warmup, where
`paged_reads` and the model runs our attention on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.engine import lean_layers
from worker.engine.attention import supports_varlen_config


@dataclass(frozen=True, slots=True)
class FastPaths:
    varlen_attention: bool  # our attention function instead of the library's dense masked SDPA
    paged_reads: bool  # attention reads the paged cache directly (needs our attention function)
    lean_layers: bool  # our decoder-layer forward (needs our attention function and a Llama-family model)


def select(device: str | torch.device, config: Any) -> FastPaths:
    """The paths for a model config on a device (`"cpu"`, `"cuda:0"`, ...). Pure: testable without the device."""
    on_cpu = torch.device(device).type == "cpu"
    varlen = on_cpu and supports_varlen_config(config)
    lean = varlen and lean_layers.supports_config(config)
    return FastPaths(varlen_attention=varlen, paged_reads=varlen, lean_layers=lean)


def choose(model: Any, varlen_attention: bool = True) -> FastPaths:
    """The paths for a loaded model; `varlen_attention=False` (the engine setting) keeps the library's attention."""
    paths = select(model.device, model.config)
    if varlen_attention:
        return paths
    return FastPaths(varlen_attention=False, paged_reads=False, lean_layers=False)
