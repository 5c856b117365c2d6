"""Each native kernel's C signature is declared once (`kernels/signatures.py`): the sources define exactly it, the
build makes the compiler check it, and ctypes binds from it."""

from __future__ import annotations

import ctypes
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.engine.kernels import cpu_kernels
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

KERNELS = [
    (cpu_kernels.SOURCE, PAGED_DECODE),
    (cpu_kernels.SOURCE, PAGED_DECODE_BF16),
    (cpu_kernels.RMS_NORM_SOURCE, RMS_NORM),
    (cpu_kernels.FEW_ROWS_SOURCE, FEW_ROWS_BF16),
    (cpu_kernels.FEW_ROWS_FLOAT32_SOURCE, FEW_ROWS_FLOAT32),
    (cpu_kernels.DECODER_LAYER_SOURCE, ATTENTION_IN_FLOAT32),
    (cpu_kernels.DECODER_LAYER_SOURCE, ATTENTION_OUT_FLOAT32),
    (cpu_kernels.DECODER_LAYER_SOURCE, DECODER_LAYER_FLOAT32),
    (cpu_kernels.DECODER_LAYER_SOURCE, ATTENTION_IN_BF16),
    (cpu_kernels.DECODER_LAYER_SOURCE, ATTENTION_OUT_BF16),
    (cpu_kernels.DECODER_LAYER_SOURCE, DECODER_LAYER_BF16),
]


def definition(source: Path, name: str) -> str:
    """The source's definition of `name`, from its result type to the closing parenthesis, on one line."""
    match = re.search(rf"^(\w+)\s+{name}\(([^)]*)\)", source.read_text(), flags=re.MULTILINE)
    assert match is not None, f"{source.name} defines no {name}"
    return " ".join(match.group(0).split())


@pytest.mark.parametrize(("source", "signature"), KERNELS, ids=lambda x: getattr(x, "name", ""))
def test_each_source_defines_its_declared_signature(source: Path, signature: Signature) -> None:
    """Types and parameter names, in order (the compiler checks the types; the names are for people)."""
    assert definition(source, signature.name) == signature.declaration()


def test_the_header_declares_every_kernel() -> None:
    text = header(PAGED_DECODE, RMS_NORM)
    assert f"{PAGED_DECODE.declaration()};" in text and f"{RMS_NORM.declaration()};" in text


def test_ctypes_types_come_from_the_declaration() -> None:
    class Library:
        llmq_paged_decode = ctypes.CFUNCTYPE(None)(lambda: None)

    function = PAGED_DECODE.bind(Library())  # type: ignore[arg-type]
    assert function.restype is ctypes.c_int
    assert len(function.argtypes) == len(PAGED_DECODE.parameters) == 14
    assert function.argtypes[7] is ctypes.c_int64 and function.argtypes[11] is ctypes.c_float


def test_a_declaration_without_a_ctypes_mapping_is_refused() -> None:
    with pytest.raises(ValueError, match="no ctypes mapping"):
        Signature("llmq_bad", "int", (("double", "x"),))


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.load.cache_clear()
    yield tmp_path
    cpu_kernels.load.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_source_that_disagrees_with_its_declaration_does_not_build(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One parameter's type changed in the C (an `int` where the declaration says `int64_t`): the build fails and
    the engine keeps the torch path, where a hand-written argtypes list would have passed it wrong arguments."""
    changed = cpu_kernels.SOURCE.read_text().replace(
        "const int64_t *query_rows, int64_t requests,", "const int64_t *query_rows, int requests,"
    )
    assert changed != cpu_kernels.SOURCE.read_text()
    source = fresh_cache / "paged_decode.c"
    source.write_text(changed)
    monkeypatch.setattr(cpu_kernels, "SOURCE", source)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
    assert "declaration" in caplog.text and "llmq_paged_decode" in caplog.text  # the compiler's complaint, logged


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_kernel_is_rebuilt_when_a_source_it_includes_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder layer includes the few-row and RMSNorm sources: a change to either is a new build, never the
    cached binary of the old code."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sources = tmp_path / "kernels"
    sources.mkdir()
    for path in cpu_kernels.DECODER_LAYER_SOURCE.parent.glob("*.[ch]"):
        (sources / path.name).write_bytes(path.read_bytes())
    layer = sources / cpu_kernels.DECODER_LAYER_SOURCE.name
    declared = (ATTENTION_IN_FLOAT32, ATTENTION_OUT_FLOAT32, DECODER_LAYER_FLOAT32)
    first = cpu_kernels._built(layer, declared, cpu_kernels.EXACT_FLAGS)
    assert cpu_kernels._built(layer, declared, cpu_kernels.EXACT_FLAGS) == first
    included = sources / "few_rows_float32.c"
    included.write_text(included.read_text().replace("#define OUTPUTS 4", "#define OUTPUTS 2"))
    second = cpu_kernels._built(layer, declared, cpu_kernels.EXACT_FLAGS)
    assert second != first and second.exists()
