"""Black-box checks of the distribution as a user gets it (issue 29), from outside: `python -m build` run on a
copy of the checkout's files, the wheel's own metadata, `pip install` by name from a folder of wheels into a
target directory, mypy run on a user's script against that install, and the installed console scripts run in
interpreters that have only the base dependencies (no extras) or everything but the heavy parts of an extra.

Nothing here reads the implementation: only the artefacts `python -m build` makes and what the commands print.
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DIST = "llmq-redis"
HEAVY_WORKER = {"torch", "transformers", "accelerate", "gguf"}  # what the worker extra adds that is heavy
HEAVY_GATEWAY = {"starlette", "uvicorn"}


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path
    printed: str
    isolated: bool


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would change what Python or pip prints or finds."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LLMQ_", "PYTHONPATH", "PYTHONWARNINGS", "PYTHONHOME", "VIRTUAL_ENV"))
    }
    env.update(extra)
    return env


def _copy_checkout(dest: Path) -> None:
    """What git tracks or would track, copied: never build in the checkout (its build/ folder is shared)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = ROOT / name
        if not src.is_file():  # deleted in the work tree (another session is editing), or a submodule
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    base = tmp_path_factory.mktemp("build")
    source = base / "src"
    _copy_checkout(source)
    out = base / "dist"
    env = _clean_env()
    # `python -m build` as a release runs it: an sdist, then the wheel built from that sdist, in an isolated env.
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        cwd=base,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    isolated = True
    if done.returncode != 0 and "Getting build dependencies" not in done.stdout + done.stderr:
        # the isolated env could not be made (no package index here): the venv's own setuptools builds it
        isolated = False
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
            cwd=base,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-4000:]
    wheels = sorted(out.glob("*.whl"))
    sdists = sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return Built(wheels[0], sdists[0], printed, isolated)


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        return email.parser.Parser().parsestr(zf.read(name).decode())


def _checkout_version() -> str:
    """`client.__version__` of the checkout, as a user's interpreter imports it (the venv's editable install)."""
    done = subprocess.run(
        [sys.executable, "-c", "import client; print(client.__version__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_clean_env(),
        check=True,
    )
    return done.stdout.strip()


# -- the build ---------------------------------------------------------------------------------------------------


def test_the_build_prints_no_deprecation_warning(built: Built) -> None:
    lines = [line for line in built.printed.splitlines() if re.search(r"deprecat", line, re.IGNORECASE)]
    assert lines == [], "\n".join(lines)


def test_the_build_was_the_default_isolated_one_or_says_why(built: Built) -> None:
    # the isolated build is what `python -m build` does; it falls back only where no index can be reached
    assert "Successfully built" in built.printed
    if built.isolated:
        assert "Creating isolated environment" in built.printed


def test_the_artefacts_are_named_after_the_distribution_and_client_version(built: Built) -> None:
    version = _checkout_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", version), version
    assert built.wheel.name == f"llmq_redis-{version}-py3-none-any.whl"
    assert built.sdist.name == f"llmq_redis-{version}.tar.gz"


def test_the_wheel_metadata_names_llmq_redis_and_the_client_version(built: Built) -> None:
    meta = _metadata(built.wheel)
    assert meta["Name"] == DIST
    assert meta["Version"] == _checkout_version()
    assert meta["Requires-Python"], "no Requires-Python"


def test_the_licence_is_the_spdx_expression_with_the_file_inside(built: Built) -> None:
    meta = _metadata(built.wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get("License") is None, "the legacy free-text License field next to the SPDX expression"
    assert "LICENSE" in meta.get_all("License-File", [])
    with zipfile.ZipFile(built.wheel) as zf:
        inside = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/licenses/LICENSE", n)]
        assert len(inside) == 1, [n for n in zf.namelist() if "dist-info" in n]
        text = zf.read(inside[0]).decode()
    assert text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text


def test_the_sdist_carries_the_licence_and_the_same_version(built: Built) -> None:
    version = _checkout_version()
    with tarfile.open(built.sdist) as tf:
        names = tf.getnames()
        top = f"llmq_redis-{version}"
        assert f"{top}/LICENSE" in names
        assert f"{top}/pyproject.toml" in names
        pkg_info = tf.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        meta = email.parser.Parser().parsestr(pkg_info.read().decode())
    assert meta["Name"] == DIST
    assert meta["Version"] == version
    assert meta["License-Expression"] == "Apache-2.0"


@pytest.mark.parametrize("package", ["client", "worker", "gateway"])
def test_the_wheel_ships_py_typed(built: Built, package: str) -> None:
    with zipfile.ZipFile(built.wheel) as zf:
        names = set(zf.namelist())
    assert f"{package}/py.typed" in names
    assert f"{package}/__init__.py" in names


def test_the_wheel_has_classifiers_and_none_for_the_licence(built: Built) -> None:
    classifiers = _metadata(built.wheel).get_all("Classifier", [])
    assert classifiers, "no classifiers"
    assert all(" :: " in c for c in classifiers), classifiers
    assert "Programming Language :: Python :: 3" in classifiers
    assert len(classifiers) == len(set(classifiers)), classifiers
    # PEP 639: with License-Expression, a `License ::` classifier must not be given as well
    assert not [c for c in classifiers if c.startswith("License ::")], classifiers


def _requirements(meta: email.message.Message) -> list[Requirement]:
    return [Requirement(r) for r in meta.get_all("Requires-Dist", [])]


def _extra_names(req: Requirement) -> set[str]:
    return set(re.findall(r'extra\s*==\s*"([^"]+)"', str(req.marker))) if req.marker else set()


def test_the_wheel_declares_the_extras(built: Built) -> None:
    meta = _metadata(built.wheel)
    extras = set(meta.get_all("Provides-Extra", []))
    assert {"worker", "gateway", "tracing", "dev", "docs"} <= extras, extras
    by_extra: dict[str, set[str]] = {}
    base: set[str] = set()
    for req in _requirements(meta):
        names = _extra_names(req)
        for extra in names:
            by_extra.setdefault(extra, set()).add(req.name.lower())
        if not names:
            base.add(req.name.lower())
    assert {"torch", "transformers"} <= by_extra["worker"]
    assert {"starlette", "uvicorn"} <= by_extra["gateway"]
    for extra in ("tracing", "dev", "docs"):
        assert by_extra.get(extra), f"extra {extra!r} pulls in nothing"
    # the base install is the thin client: none of the extras' heavy parts
    assert not base & (HEAVY_WORKER | HEAVY_GATEWAY), base
    assert "redis" in base


def test_the_wheel_declares_the_three_commands(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = zf.read(name).decode()
    scripts = re.search(r"\[console_scripts\]\n((?:[^\[].*\n?)*)", text)
    assert scripts is not None, text
    declared = {line.split("=")[0].strip() for line in scripts.group(1).splitlines() if "=" in line}
    assert {"llmq", "llmq-worker", "llmq-gateway"} <= declared


# -- the install -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Installed:
    target: Path
    version: str
    pip_output: str


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("install")
    wheels = base / "wheels"
    wheels.mkdir()
    shutil.copy2(built.wheel, wheels / built.wheel.name)
    target = base / "target"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(wheels),
            "--no-deps",
            "--target",
            str(target),
            DIST,
        ],
        cwd=base,
        capture_output=True,
        text=True,
        env=_clean_env(PIP_NO_INPUT="1"),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return Installed(target, _metadata(built.wheel)["Version"], done.stdout + done.stderr)


def test_pip_installs_it_by_name_from_a_folder_of_wheels(installed: Installed) -> None:
    target = installed.target
    assert (target / f"llmq_redis-{installed.version}.dist-info" / "METADATA").is_file()
    for package in ("client", "worker", "gateway"):
        assert (target / package / "__init__.py").is_file()
        assert (target / package / "py.typed").is_file()
    for script in ("llmq", "llmq-worker", "llmq-gateway"):
        assert (target / "bin" / script).is_file(), sorted(p.name for p in (target / "bin").iterdir())


def _closure(names: list[str]) -> set[str]:
    """The distributions `names` need, by their metadata in this venv (markers evaluated, extras not taken)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _site_of(dists: set[str], dest: Path) -> Path:
    """A folder holding only `dists` (links into this venv's site-packages): a Python path with nothing else."""
    dest.mkdir()
    for name in sorted(dists):
        dist = importlib.metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            link = dest / top
            if src.exists() and not link.exists() and top not in ("bin", "__pycache__"):
                link.symlink_to(src)
    return dest


@pytest.fixture(scope="module")
def base_requirements(built: Built) -> list[str]:
    meta = _metadata(built.wheel)
    return [r.name for r in _requirements(meta) if not _extra_names(r)]


@pytest.fixture(scope="module")
def base_site(base_requirements: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base install's dependencies and nothing more (no extra at all)."""
    return _site_of(_closure(base_requirements), tmp_path_factory.mktemp("site") / "base")


@pytest.fixture(scope="module")
def light_site(built: Built, base_requirements: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base dependencies plus the light part of the worker and gateway extras: torch, transformers,
    starlette, uvicorn and the like are really absent (not blocked), everything else is there."""
    meta = _metadata(built.wheel)
    light = [
        r.name
        for r in _requirements(meta)
        if _extra_names(r) & {"worker", "gateway"} and r.name.lower() not in HEAVY_WORKER | HEAVY_GATEWAY
    ]
    return _site_of(_closure(base_requirements + light), tmp_path_factory.mktemp("site") / "light")


def _run_installed(
    installed: Installed, site: Path, args: list[str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`args` run by an interpreter that sees only the target dir and `site` (-S: no site-packages of the venv,
    hence no editable install of the checkout either)."""
    env = _clean_env(
        PYTHONPATH=f"{installed.target}{os.pathsep}{site}",
        PYTHONNOUSERSITE="1",
        LLMQ_REDIS_URL="redis://llmquser:pw-not-for-output@127.0.0.1:1/0",
        LLMQ_GATEWAY_REDIS_URL="redis://llmquser:pw-not-for-output@127.0.0.1:1/0",
        LLMQ_GATEWAY_HOST="127.0.0.1",
        LLMQ_GATEWAY_PORT="0",
    )
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout
    )


def _script(installed: Installed, name: str) -> str:
    return str(installed.target / "bin" / name)


def test_the_installed_client_is_the_wheel_and_reports_its_version(
    installed: Installed, base_site: Path, tmp_path: Path
) -> None:
    done = _run_installed(
        installed,
        base_site,
        [
            "-c",
            "import client, importlib.metadata as m; print(client.__version__); print(client.__file__); "
            f"print(m.version({DIST!r}))",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    version, where, dist_version = done.stdout.split("\n")[:3]
    assert version == installed.version == dist_version
    assert Path(where).is_relative_to(installed.target), where


def test_the_sandbox_really_lacks_the_extras(installed: Installed, base_site: Path, light_site: Path) -> None:
    """The premise of the tests below: these interpreters cannot import the extras' modules."""
    for site, absent in ((base_site, ["torch", "starlette", "pydantic_settings"]), (light_site, ["torch"])):
        for module in absent:
            done = _run_installed(installed, site, ["-c", f"import {module}"], site)
            assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, (site, module)
    done = _run_installed(installed, light_site, ["-c", "import pydantic_settings"], light_site)
    assert done.returncode == 0, done.stderr


def test_llmq_version_on_the_base_install(installed: Installed, base_site: Path, tmp_path: Path) -> None:
    done = _run_installed(installed, base_site, [_script(installed, "llmq"), "--version"], tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{DIST} {installed.version}\n", "")
    done = _run_installed(installed, base_site, [_script(installed, "llmq"), "--help"], tmp_path)
    assert done.returncode == 0 and "usage: llmq" in done.stdout, done.stderr


@pytest.mark.parametrize("command", ["llmq-worker", "llmq-gateway"])
@pytest.mark.parametrize("args", [[], ["--version"], ["--help"], ["--queue", "q"]], ids=repr)
def test_without_any_extra_the_commands_answer_in_one_line(
    installed: Installed, base_site: Path, tmp_path: Path, command: str, args: list[str]
) -> None:
    """No extra at all (the plain `pip install llmq-redis`): either the command answers --version/--help, or it
    exits non-zero with one line naming the extra and the pip command; never a traceback."""
    extra = command.removeprefix("llmq-")
    done = _run_installed(installed, base_site, [_script(installed, command), *args], tmp_path)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    if args == ["--version"] and done.returncode == 0:
        assert done.stdout == f"{DIST} {installed.version}\n"
        return
    if args == ["--help"] and done.returncode == 0:
        assert f"usage: {command}" in done.stdout
        return
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"'{extra}'" in lines[0] or f"[{extra}]" in lines[0], lines[0]
    assert "pip install" in lines[0] and f"{DIST}[{extra}]" in lines[0], lines[0]
    assert "pw-not-for-output" not in done.stderr + done.stdout


@pytest.mark.parametrize("command", ["llmq-worker", "llmq-gateway"])
def test_version_and_help_need_none_of_the_heavy_modules(
    installed: Installed, light_site: Path, tmp_path: Path, command: str
) -> None:
    """torch, transformers, starlette, uvicorn really not installed: --version and --help still work."""
    done = _run_installed(installed, light_site, [_script(installed, command), "--version"], tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{DIST} {installed.version}\n", "")
    done = _run_installed(installed, light_site, [_script(installed, command), "--help"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"usage: {command}" in done.stdout and "--redis-url" in done.stdout


@pytest.mark.parametrize("command", ["llmq-worker", "llmq-gateway"])
def test_without_the_heavy_modules_the_command_names_its_extra(
    installed: Installed, light_site: Path, tmp_path: Path, command: str
) -> None:
    extra = command.removeprefix("llmq-")
    done = _run_installed(installed, light_site, [_script(installed, command)], tmp_path)
    assert done.returncode != 0
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"pip install '{DIST}[{extra}]'" in lines[0] or f"pip install {DIST}[{extra}]" in lines[0], lines[0]


# -- type checking against the install ---------------------------------------------------------------------------


def _mypy(script: str, target: Path, site: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "user.py").write_text(script)
    config = workdir / "mypy.ini"
    config.write_text("[mypy]\n")
    env = _clean_env(PYTHONPATH=f"{target}{os.pathsep}{site}", MYPY_CACHE_DIR=str(workdir / ".mypy_cache"))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--no-incremental", "user.py"],
        cwd=workdir,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


CLIENT_SCRIPT = """\
from client import Client, Job


def use(c: Client) -> Job:
    reveal_type(c.submit)
    job = c.submit("hello", max_new_tokens=3)
    c.submit(123, max_new_tokens="three")
    return job
"""


def test_mypy_reads_client_submit_types_from_the_installed_wheel(
    installed: Installed, base_site: Path, tmp_path: Path
) -> None:
    done = _mypy(CLIENT_SCRIPT, installed.target, base_site, tmp_path / "typed")
    out = done.stdout + done.stderr
    assert "import-untyped" not in out and "import-not-found" not in out, out
    revealed = re.search(r'Revealed type is "(.*)"', out)
    assert revealed is not None, out
    assert "prompt: str | None" in revealed.group(1) and "max_new_tokens: int | None" in revealed.group(1), out
    assert revealed.group(1).endswith("Job"), out
    # the one wrong call, both its wrong arguments, and nothing on the right one
    assert re.search(r'user\.py:7: error: Argument 1 to "submit" of "Client" has incompatible type "int"', out), out
    assert re.search(r'user\.py:7: error: Argument "max_new_tokens" to "submit".*"str"', out), out
    assert "user.py:6:" not in out, out
    assert done.returncode == 1


def test_mypy_control_without_py_typed_sees_nothing(installed: Installed, base_site: Path, tmp_path: Path) -> None:
    """The check above would pass vacuously if mypy read the checkout: without the markers it must not see types."""
    bare = tmp_path / "bare"
    shutil.copytree(installed.target, bare, symlinks=True)
    for marker in bare.rglob("py.typed"):
        marker.unlink()
    done = _mypy(CLIENT_SCRIPT, bare, base_site, tmp_path / "untyped")
    out = done.stdout + done.stderr
    assert "import-untyped" in out, out
    assert 'Revealed type is "Any"' in out, out


def test_mypy_reads_the_worker_and_gateway_types_too(installed: Installed, base_site: Path, tmp_path: Path) -> None:
    script = (
        "import gateway.__main__\nimport worker.__main__\n\n"
        'worker.__main__.main(["--version"])\n'
        "worker.__main__.main(5)\n"
        "gateway.__main__.main(5)\n"
    )
    done = _mypy(script, installed.target, base_site, tmp_path / "ws")
    out = done.stdout + done.stderr
    assert "import-untyped" not in out, out
    assert re.search(r'user\.py:5: error: Argument 1 to "main" has incompatible type "int"', out), out
    assert re.search(r'user\.py:6: error: Argument 1 to "main" has incompatible type "int"', out), out
    assert "user.py:4:" not in out, out
