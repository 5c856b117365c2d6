"""`missing_path`: which `--model` values are local paths that are not there (refused before the engine loads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.model_spec import missing_path


@pytest.mark.parametrize("spec", ["/no/such/folder", "./missing", "../missing.gguf", "missing.gguf", "~/no-such-llmq"])
def test_a_path_that_is_not_there_is_named(spec: str) -> None:
    assert missing_path(spec) == Path(spec).expanduser()


@pytest.mark.parametrize("spec", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "smollm2", "org/model.v2"])
def test_a_hub_id_or_the_alias_is_no_path(spec: str) -> None:
    assert missing_path(spec) is None


def test_a_path_that_is_there_is_not_missing(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert missing_path(str(tmp_path)) is None
    assert missing_path(str(tmp_path / "model.gguf")) is None
    assert missing_path(str(tmp_path / "other.gguf")) == tmp_path / "other.gguf"
