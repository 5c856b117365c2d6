"""The Dockerfile, parsed (no Docker engine runs here): the images run as a non-root user with a health check,
install the torch the Makefile pins, and the CPU runtime image has no compiler yet finds the kernels its build
stage compiled. That last part is also run: the build stage's own kernel-building command, then a worker's
kernel lookup as the runtime stage sets it up, with the compiler wrappers of deploy/docker."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.deploy.support import ROOT
from worker.engine.kernels import cpu_kernels

DOCKERFILE = (ROOT / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
WRAPPERS = ROOT / "deploy" / "docker"
COMPILERS = ("gcc", "g++", "clang", "build-essential", "libc6-dev", "cpp", "make")


def stages() -> dict[str, str]:
    """Each named stage's instructions (continuation lines joined), by its name."""
    text = DOCKERFILE.replace("\\\n", " ")
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        match = re.match(r"FROM \S+(?: AS (\S+))?$", line)
        if match:
            name = match.group(1)
            if name:
                out[name] = ""
            continue
        if name:
            out[name] += line + "\n"
    return out


def env(stage: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in re.findall(r"^ENV (.+)$", stages()[stage], re.M):
        found.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return found


def copies(stage: str) -> list[tuple[str | None, str, str]]:
    """(from-stage, source, destination) of each COPY."""
    out = []
    for line in re.findall(r"^COPY (.+)$", stages()[stage], re.M):
        words = line.split()
        source_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
        paths = [w for w in words if not w.startswith("--")]
        out.append((source_stage, paths[0], paths[1]))
    return out


def apt_packages(stage: str) -> set[str]:
    found = set()
    for command in re.findall(r"apt-get install ([^&]+)", stages()[stage]):
        found |= {word for word in command.split() if not word.startswith("-")}
    return found


def test_dockerfile_runs_as_non_root_with_a_health_check() -> None:
    for target in ("cpu", "cuda"):
        stage = stages()[target]
        assert re.search(r"^USER llmq$", stage, re.M), target
        assert "HEALTHCHECK" in stage and '"worker.health"' in stage, target
        assert 'ENTRYPOINT ["llmq-worker"]' in stage and "VOLUME /models" in stage, target
    assert re.search(r"^USER llmq$", stages()["cpu-compiler"], re.M)  # the compiler comes as root, runs as llmq
    assert DOCKERFILE.rstrip().endswith("FROM cpu")  # the default image is the small CPU one


def test_torch_is_the_makefiles_pin() -> None:
    (makefile_pin,) = re.findall(r"^TORCH_SPEC \?= (\S+)$", MAKEFILE, re.M)
    (dockerfile_pin,) = re.findall(r"^ARG TORCH_SPEC=(\S+)$", DOCKERFILE, re.M)
    assert dockerfile_pin == makefile_pin
    assert "torch>=" not in DOCKERFILE and "torch<" not in DOCKERFILE
    for name, stage in stages().items():
        installs_torch = re.findall(r"pip install [^\n]*torch", stage)
        for install in installs_torch:
            assert '"$TORCH_SPEC"' in install, (name, install)
        if installs_torch:
            assert re.search(r"^ARG TORCH_SPEC$", stage, re.M), f"{name} must declare the build arg to see it"
    assert {name for name, stage in stages().items() if '"$TORCH_SPEC"' in stage} == {"cpu-build", "cuda"}


def test_the_cpu_runtime_stage_has_no_compiler() -> None:
    assert not apt_packages("cpu") & set(COMPILERS), apt_packages("cpu")
    assert "gcc" in apt_packages("cpu-build")
    assert "libgomp1" in apt_packages("cpu")  # the kernels' OpenMP runtime
    # Nothing built is installed in the runtime stage itself: it copies the build stage's environment.
    assert "pip install" not in stages()["cpu"]
    assert (("cpu-build", "/opt/llmq", "/opt/llmq")) in copies("cpu")
    assert "gcc" in apt_packages("cpu-compiler")  # the opt-in variant for other CPUs


def test_the_runtime_looks_up_the_kernels_where_the_build_stage_put_them() -> None:
    """The kernels' cache key includes $CC and the cache lives under $XDG_CACHE_HOME: both stages set the same,
    the runtime copies that cache, and its CC is the failing wrapper where the build stage's runs gcc."""
    build, runtime = env("cpu-build"), env("cpu")
    assert build["CC"] == runtime["CC"] and build["XDG_CACHE_HOME"] == runtime["XDG_CACHE_HOME"]
    cache = build["XDG_CACHE_HOME"]
    assert ("cpu-build", cache, cache) in copies("cpu")
    assert (None, "deploy/docker/llmq-cc-gcc", build["CC"]) in copies("cpu-build")
    assert (None, "deploy/docker/llmq-cc-none", runtime["CC"]) in copies("cpu")
    assert (None, "deploy/docker/llmq-cc-gcc", runtime["CC"]) in copies("cpu-compiler")
    assert runtime["PATH"].startswith("/opt/llmq/bin:") and build["PATH"] == runtime["PATH"]
    # The build stage builds every kernel (the bfloat16 ones where the CPU has bfloat16) and fails if it could not.
    assert "k.load() is not None" in stages()["cpu-build"] and "k.rms_norm(" in stages()["cpu-build"]
    assert "k.load(torch.bfloat16) is not None and k.few_rows() is not None" in stages()["cpu-build"]
    assert "k.decoder_layer(576, torch.bfloat16) is not None" in stages()["cpu-build"]
    assert re.search(r'ls "\$XDG_CACHE_HOME"/llmq/kernels/\*\.so \| wc -l\)" -ge 2', stages()["cpu-build"])


def test_the_build_context_carries_the_wrappers() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "deploy" in ignored and "!deploy/docker" in ignored and ".env" in ignored
    for wrapper in ("llmq-cc-gcc", "llmq-cc-none"):
        assert os.access(WRAPPERS / wrapper, os.X_OK), f"{wrapper} must be executable (COPY keeps the mode)"


def _python(code: str, environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=environment, cwd=ROOT
    )


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_a_compilerless_runtime_uses_the_kernels_the_build_stage_compiled(tmp_path: Path) -> None:
    build_stage = stages()["cpu-build"]
    (build_command,) = re.findall(r'python -c "([^"]+)"', build_stage)
    bin_dir, cache = tmp_path / "bin", tmp_path / "cache"
    bin_dir.mkdir()
    compiler = bin_dir / "llmq-cc"  # the same path in both "stages", as in the Dockerfile
    base = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(cache), "CC": str(compiler), "PYTHONPATH": str(ROOT)}

    # The build stage: the wrapper runs gcc; the Dockerfile's own command builds the kernels (four, where AVX2 builds
    # the float32 few-row product and decoder layer; three more with bfloat16: decode, few-row, decoder layer).
    shutil.copy2(WRAPPERS / "llmq-cc-gcc", compiler)
    gcc_dir = str(Path(shutil.which("gcc") or "").parent)
    built = _python(build_command, {**base, "PATH": f"{bin_dir}:{gcc_dir}:/bin"})
    assert built.returncode == 0, built.stderr
    kernels = sorted(cache.glob("llmq/kernels/*.so"))
    float32_few_rows = cpu_kernels.few_rows(torch.float32) is not None
    bfloat16 = cpu_kernels.native_bfloat16()
    assert len(kernels) == 2 + 2 * float32_few_rows + 3 * bfloat16, kernels
    stamps = [path.stat().st_mtime_ns for path in kernels]

    # The runtime stage: no compiler (the wrapper fails if called). The same CPU finds both kernels built; another
    # CPU (another key) makes the worker try a build, which fails saying why, and the torch path runs.
    shutil.copy2(WRAPPERS / "llmq-cc-none", compiler)
    runtime = _python(
        "import torch; from worker.engine.kernels import cpu_kernels as k; assert k.load() is not None; "
        f"k.rms_norm(576); assert (k.few_rows(torch.float32) is not None) == {float32_few_rows}; "
        f"assert (k.decoder_layer(576) is not None) == {float32_few_rows}; "
        f"assert (k.decoder_layer(576, torch.bfloat16) is not None) == {bfloat16}; "
        "print('found', flush=True); k._cpu_identity = lambda: b'another cpu'; k.load.cache_clear(); "
        "assert k.load() is None",
        {**base, "PATH": f"{bin_dir}:/nonexistent"},
    )
    assert runtime.returncode == 0, runtime.stderr
    # One warning, from the other CPU's decode kernel: on this CPU both loaded without a build.
    assert runtime.stdout == "found\n" and runtime.stderr.count("unavailable") == 1, runtime.stderr
    assert "this image has no C compiler" in runtime.stderr and "cpu-compiler" in runtime.stderr
    assert [path.stat().st_mtime_ns for path in sorted(cache.glob("llmq/kernels/*.so"))] == stamps
