"""What the light processes import: the gateway nothing of the worker's and no torch; the worker's health check
(run every 15 s by the container) no torch. Each in a fresh interpreter, since this one has imported everything."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def loaded_modules(*imports: str) -> set[str]:
    """The names of the modules a fresh interpreter holds after `imports`."""
    code = "import sys\n" + "".join(f"import {name}\n" for name in imports) + "print('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["gateway", "gateway.app", "gateway.__main__"])
def test_the_gateway_imports_nothing_of_the_worker_and_no_torch(module: str) -> None:
    loaded = loaded_modules(module)
    assert module in loaded
    assert not {name for name in loaded if name == "worker" or name.startswith("worker.")}
    assert "torch" not in loaded and "transformers" not in loaded


def test_the_health_check_imports_no_torch() -> None:
    loaded = loaded_modules("worker.health")
    assert "worker.health" in loaded and "worker.config" in loaded
    assert "torch" not in loaded and "transformers" not in loaded and "worker.engine" not in loaded


def test_the_settings_sizing_defaults_are_the_engines() -> None:
    """`worker.config` states the engine's sizing defaults itself (importing the engine would import torch)."""
    from worker.config import Settings
    from worker.engine import EngineConfig

    engine = EngineConfig()
    shared = [field.name for field in dataclasses.fields(EngineConfig) if field.name in Settings.model_fields]
    assert {"kv_cache_tokens", "page_size", "max_batch_tokens", "max_running", "prefix_sharing"} <= set(shared)
    for name in shared:
        assert Settings.model_fields[name].default == getattr(engine, name), name
