"""`bench/few_rows.py`: a `--quick` run prints a figure for every row count, and `--kernel-source` tells another
build of the shipped code (the same bits) from one that sums differently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import few_rows as bench
from worker.engine.kernels import cpu_kernels


@pytest.fixture(autouse=True)
def float32_kernel() -> None:
    if cpu_kernels.few_rows(torch.float32) is None:
        pytest.skip("no float32 few-row kernel on this machine (AVX2 and FMA, or AVX-512, and a C compiler)")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    bench.main(["--quick", "--dtype", "float32", "--rows", "1,3,8", "--rounds", "2", *argv])
    printed = capsys.readouterr().out
    assert printed.count("few_rows/onednn") == 3
    return json.loads(printed.strip().splitlines()[-1])


def test_a_quick_run_times_both_ways_at_every_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    figures = run(capsys)
    assert figures["dtype"] == "float32" and "other_equal_bits" not in figures
    assert list(figures["rows"]) == ["1", "3", "8"]
    for row in figures["rows"].values():
        assert row["few_rows_ms"] > 0 and row["onednn_ms"] > 0
        assert row["few_rows_over_onednn"] == pytest.approx(row["few_rows_ms"] / row["onednn_ms"], rel=0.05)


def test_another_build_of_the_same_code_gives_its_bits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped source with a comment added: a build of its own (another cache key), the same arithmetic."""
    other = tmp_path / "few_rows_float32.c"
    other.write_text(cpu_kernels.FEW_ROWS_FLOAT32_SOURCE.read_text() + f"\n/* {tmp_path.name} */\n")
    figures = run(capsys, "--kernel-source", str(other))
    assert figures["other_equal_bits"] is True
    assert all(row["other_ms"] > 0 for row in figures["rows"].values())


def test_a_source_that_sums_otherwise_is_told_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shipped = cpu_kernels.FEW_ROWS_FLOAT32_SOURCE.read_text()
    summed = "float sum = vec_sum(sums[o][r]);"
    assert summed in shipped, "the shipped kernel's lane sum moved: update this test's edit"
    other = tmp_path / "few_rows_float32.c"
    other.write_text(shipped.replace(summed, "float sum = vec_sum(sums[o][r]) * 1.5f;"))
    assert run(capsys, "--kernel-source", str(other))["other_equal_bits"] is False
