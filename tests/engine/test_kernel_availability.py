"""Without a C compiler the engine runs its torch fallbacks, says so in one warning per kernel (what is missing,
what runs instead), and its metrics name the paths that run (`llmq:engine_path`); with one, the compiled kernels."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker.engine.kernels import cpu_kernels
from worker.metrics import Metrics


@pytest.fixture
def fresh_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Kernels are built again, into an empty cache that hides the machine's built ones; the process-wide kernels
    are back after the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.load.cache_clear()
    cpu_kernels.rms_norm.cache_clear()
    yield tmp_path
    cpu_kernels.load.cache_clear()
    cpu_kernels.rms_norm.cache_clear()


def built(cache: Path) -> list[str]:
    """The kernels built into `cache`, by name."""
    return sorted(path.name.split("-")[0] for path in cache.rglob("*.so"))


def engine_paths(engine: Any) -> dict[str, str]:
    """`llmq:engine_path` as a worker's registry serves it: component -> kernel, for the series at 1."""
    text = generate_latest(Metrics(engine, "default", "tiny").registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "llmq:engine_path"]
    assert all(sample.value == 1 for sample in family.samples)
    return {sample.labels["component"]: sample.labels["kernel"] for sample in family.samples}


async def test_without_a_compiler_the_fallbacks_run_and_say_so(
    llama_dir: Path,
    make_engine: Any,
    fresh_kernels: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        engine = await make_engine(llama_dir)
    assert (
        engine.stats().paths
        == engine_paths(engine)
        == {
            "attention": "varlen",
            "decoder_layers": "lean",
            "paged_decode": "fallback",
            "rms_norm": "fallback",
        }
    )
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one a kernel, not one a call
    assert all("no C compiler: $CC='/nonexistent/cc' is not an executable" in warning for warning in warnings)
    for kernel, fallback in (
        ("paged-decode", cpu_kernels.PAGED_DECODE_FALLBACK),
        ("RMSNorm", cpu_kernels.RMS_NORM_FALLBACK),
    ):
        assert len([w for w in warnings if f"native {kernel} kernel unavailable" in w and fallback in w]) == 1
    assert await asyncio.to_thread(built, fresh_kernels) == []


async def test_with_a_compiler_the_compiled_kernels_run(
    llama_dir: Path, make_engine: Any, fresh_kernels: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        engine = await make_engine(llama_dir)
    assert engine_paths(engine) == {
        "attention": "varlen",
        "decoder_layers": "lean",
        "paged_decode": "compiled",
        "rms_norm": "compiled",
    }
    assert not caplog.records
    assert await asyncio.to_thread(built, fresh_kernels) == ["paged_decode", "rms_norm"]


async def test_the_library_attention_reports_no_kernels(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir, varlen_attention=False)
    assert engine_paths(engine) == {"attention": "library", "decoder_layers": "library"}


def test_a_missing_compiler_is_named() -> None:
    with pytest.raises(OSError, match=r"\$CC='/nonexistent/cc' is not an executable"):
        cpu_kernels._compiler(cpu_kernels.KernelBuildSettings.model_validate({"CC": "/nonexistent/cc"}))
