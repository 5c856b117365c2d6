"""The distribution a user installs: built from this checkout the way a release is (`python -m build`), it prints
no deprecation, carries its name, its one version, its licence and its type hints, and installs by its name from
a local folder with the `llmq` command working."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import client

ROOT = Path(__file__).resolve().parents[1]
NAME = "llmq-redis"


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel and everything the build printed, built from a copy of the checkout's files (what git tracks or
    would: no earlier `build/` folder to ship stale files from) with the venv's setuptools, offline."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    for name in listed.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("*.whl")
    return wheel, done.stdout + done.stderr


def test_the_build_prints_no_deprecation(build: tuple[Path, str]) -> None:
    _, printed = build
    assert "deprecat" not in printed.lower(), printed


def test_the_wheel_names_its_distribution_version_licence_and_ships_type_hints(build: tuple[Path, str]) -> None:
    wheel, _ = build
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = (name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(metadata_name))
    assert metadata["Name"] == NAME
    assert metadata["Version"] == client.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert any(name.endswith("licenses/LICENSE") for name in names)
    assert {"client/py.typed", "worker/py.typed", "gateway/py.typed"} <= names
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert {"worker", "gateway", "tracing"} <= set(metadata.get_all("Provides-Extra"))


def test_it_installs_by_its_name_from_a_local_folder_and_llmq_reports_its_version(
    build: tuple[Path, str], tmp_path: Path
) -> None:
    wheel, _ = build
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    done = subprocess.run(
        [*install, "--find-links", str(wheel.parent), "--target", str(target), NAME],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    llmq = [sys.executable, str(target / "bin" / "llmq"), "--version"]
    version = subprocess.run(llmq, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"{NAME} {client.__version__}"
