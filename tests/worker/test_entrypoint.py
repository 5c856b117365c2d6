"""`llmq-worker` as a person meets it: `--version` and `--help` without loading torch, help that shows no pydantic
internals, one line (not a traceback) when the `worker` extra is missing, and flags that outrank the environment.
The helpers here serve tests/gateway/test_entrypoint.py too."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from pydantic import BaseModel

import client
from serverlog.cli import parse
from testing.tiny_models import save_tiny_model
from worker.config import Settings

ROOT = Path(__file__).parent.parent.parent

# Runs an entry point with some top-level modules unimportable, as they are without the extra; a module that the
# command tries to load anyway fails it, so a clean `--help` under the block also shows it never loaded them.
_BLOCKED = """
import sys
blocked = set(sys.argv[2].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name in blocked or name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from importlib import import_module
import_module(sys.argv[1]).main(sys.argv[3:])
"""

# What pydantic-settings' own CLI printed: type reprs, `{Path,null}`-style unions, masked secrets.
_PYDANTIC_INTERNALS = re.compile(r"SecretStr|\{\w+(,\w+)+\}|\*{3,}|default factory")


def without_settings() -> dict[str, str]:
    """This process's environment less its `LLMQ_*` variables, with the repository on the import path."""
    return {key: value for key, value in os.environ.items() if not key.startswith("LLMQ_")} | {"PYTHONPATH": str(ROOT)}


def command(module: str, *args: str, blocked: Iterable[str] = (), cwd: Path) -> subprocess.CompletedProcess[str]:
    """`module`'s `main(args)` in a fresh interpreter, with no `LLMQ_*` variables and no `.env` (cwd is empty)."""
    env = without_settings() | {"COLUMNS": "100"}
    argv = [sys.executable, "-c", _BLOCKED, module, ",".join(blocked) or "-", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


def flag_help(help_text: str) -> dict[str, str]:
    """Each option of `--help` -> its help text, whitespace collapsed (argparse puts it after two spaces or on the
    next lines)."""
    options = help_text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    entries = re.split(r"\n(?=  -)", options)
    parts = [re.split(r"\s{2,}", entry.strip(), maxsplit=1) for entry in entries]
    return {part[0].split(",")[0].split()[0]: " ".join(part[1].split()) if len(part) > 1 else "" for part in parts}


def check_help(done: subprocess.CompletedProcess[str], settings_cls: type[BaseModel], env_prefix: str) -> None:
    """A clean help: every setting a flag, every flag a help line with its environment variable, nothing of
    pydantic's."""
    assert done.returncode == 0, done.stderr
    assert not _PYDANTIC_INTERNALS.search(done.stdout), _PYDANTIC_INTERNALS.search(done.stdout)
    flags = flag_help(done.stdout)
    assert {f"--{name.replace('_', '-')}" for name in settings_cls.model_fields} | {"-h", "--version"} == set(flags)
    assert all(flags.values()), [flag for flag, text in flags.items() if not text]
    for name in settings_cls.model_fields:
        assert f"env {env_prefix}{name.upper()}" in flags[f"--{name.replace('_', '-')}"]


def test_version_is_the_distributions_and_loads_no_torch(tmp_path: Path) -> None:
    done = command("worker.__main__", "--version", blocked=["torch", "transformers"], cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"llmq-redis {client.__version__}\n", "")


def test_help_is_clean_and_loads_no_torch(tmp_path: Path) -> None:
    done = command("worker.__main__", "--help", blocked=["torch", "transformers"], cwd=tmp_path)
    check_help(done, Settings, "LLMQ_")
    flags = flag_help(done.stdout)
    assert "default: redis://localhost:6379/0" in flags["--redis-url"]  # a secret's default, shown: no password
    assert "default: unset" in flags["--seed"] and "default: on" in flags["--preemption"]
    assert "Exit status" in done.stdout and "'worker' extra" in done.stdout


@pytest.mark.parametrize("missing", ["torch", "transformers", "pydantic_settings"])
def test_without_the_extra_one_line_says_what_to_install(tmp_path: Path, missing: str) -> None:
    done = command("worker.__main__", "--model", "smollm2", blocked=[missing], cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == "llmq-worker: the worker needs the 'worker' extra: pip install 'llmq-redis[worker]'\n"


@pytest.mark.parametrize("hash_seed", ["0", "1", "2"])
def test_every_module_of_the_extra_is_looked_up_in_one_order(tmp_path: Path, hash_seed: str) -> None:
    """Each run asks for all of the extra's modules in the same order, whatever the string hashing: a set's order
    and a check that stopped at the first miss once made a run look up 'accelerate' alone on some seeds."""
    script = (
        "import worker.__main__ as entry; looked = []; "
        "entry._installed = lambda name: looked.append(name) or name != 'gguf'; "
        "print(entry.extra_missing(), *looked)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    missing, *looked = done.stdout.split()
    assert missing == "True"
    extra = ["accelerate", "gguf", "prometheus_client", "pydantic_settings", "structlog", "torch", "transformers"]
    assert looked == extra


def test_another_missing_module_is_not_blamed_on_the_extra(tmp_path: Path) -> None:
    done = command("worker.__main__", blocked=["worker.process"], cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" in done.stderr and "extra" not in done.stderr


def test_a_redis_url_it_cannot_use_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """A closed port is refused in one line, before the engine's imports (torch, transformers: seconds) run."""
    script = (
        "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr)); "
        "from worker.__main__ import main; main(sys.argv[1:])"
    )
    env = without_settings()
    argv = [sys.executable, "-c", script, "--redis-url", "redis://127.0.0.1:1/0", "--model", "smollm2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    first, torch_loaded = done.stderr.strip().splitlines()
    assert first.startswith("llmq-worker: cannot use Redis at redis://127.0.0.1:1/0"), first
    assert torch_loaded == "False"


@pytest.fixture
def no_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for key in [key for key in os.environ if key.startswith("LLMQ_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)  # no .env
    return monkeypatch


def test_flags_outrank_the_environment_and_null_unsets(no_environment: pytest.MonkeyPatch) -> None:
    no_environment.setenv("LLMQ_QUEUE", "from-env")
    no_environment.setenv("LLMQ_SEED", "7")
    no_environment.setenv("LLMQ_MAX_RUNNING", "9")
    settings = parse(
        Settings,
        ["--queue", "from-flag", "--seed", "null", "--no-preemption", "--lane-share=0.2"],
        description="",
        exits="",
    )
    assert (settings.queue, settings.seed, settings.max_running) == ("from-flag", None, 9)
    assert (settings.preemption, settings.lane_share) == (False, 0.2)


def test_a_bad_value_is_a_usage_error_that_never_prints_it(
    no_environment: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_environment.setenv("LLMQ_REDIS_URL", "redis://app:hunter2@host:6379/0")
    with pytest.raises(SystemExit) as stop:
        parse(Settings, ["--max-running", "0", "--page-size", "many"], description="", exits="")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "hunter2" not in err
    assert "--max-running (LLMQ_MAX_RUNNING): Input should be greater than or equal to 1" in err
    assert "--page-size (LLMQ_PAGE_SIZE)" in err and "many" not in err


def test_an_empty_model_name_is_a_usage_error(
    no_environment: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused with the settings, not passed on to the tokenizer's loader (a traceback about sentencepiece)."""
    with pytest.raises(SystemExit) as stop:
        parse(Settings, ["--model", " "], description="", exits="")
    assert stop.value.code == 2
    assert (
        "--model (LLMQ_MODEL): names no model: give 'smollm2', a hub id, a folder or a .gguf file"
        in capsys.readouterr().err
    )


def _worker_argv(redis_url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "worker", "--redis-url", redis_url, "--metrics-port", "0", *args]


def _worker(redis_url: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = _worker_argv(redis_url, *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=without_settings(), cwd=cwd)


def test_a_started_worker_freezes_its_startup_heap_and_drains_on_sigterm(redis_url: str, tmp_path: Path) -> None:
    """Once the engine runs, what startup left is moved out of the collector's reach (one line says how much); the
    first SIGTERM then drains and the process exits 0."""
    folder = save_tiny_model(tmp_path / "model")
    with subprocess.Popen(
        _worker_argv(redis_url, "--model", str(folder), "--log-format", "json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env=without_settings(),
    ) as process:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if '"worker ready"' in line:
                break
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
    frozen = [json.loads(line) for line in lines if '"startup heap frozen"' in line]
    assert len(frozen) == 1, lines
    assert frozen[0]["objects"] > 50_000, frozen  # torch, transformers and the model: hundreds of thousands
    assert process.returncode == 0, rest
    assert '"worker stopped"' in rest, rest


@pytest.mark.parametrize("model", ["/no/such/folder", "./missing.gguf"])
def test_a_model_that_does_not_load_ends_in_one_line(redis_url: str, tmp_path: Path, model: str) -> None:
    """A path that is not there is named as such (not as a malformed hub id), in one line, exit status 1, at once:
    before the worker imports the engine and loads anything."""
    done = _worker(redis_url, tmp_path, "--model", model)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "loading model" not in done.stderr, done.stderr
    missing = Path(model).expanduser()
    assert (
        done.stderr.splitlines()[-1] == f"llmq-worker: cannot load model {model!r}: no such file or folder: {missing}"
    )


def test_an_engine_too_big_for_memory_is_a_setting_to_change(redis_url: str, tmp_path: Path) -> None:
    """A sizing the library's footprint check refuses ends in one line naming the settings to lower, exit status 2
    (a setting to change, as for a bad flag)."""
    folder = save_tiny_model(tmp_path / "model")
    done = _worker(redis_url, tmp_path, "--model", str(folder), "--max-running", "99999999999999999999")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("llmq-worker: the engine does not fit in memory (Memory footprint "), last
    assert last.endswith("): lower --kv-cache-tokens, --max-running, --max-batch-tokens or --page-size"), last


def test_a_page_larger_than_the_cache_is_a_usage_error(
    no_environment: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache of no whole page is refused with the settings, before the model loads."""
    with pytest.raises(SystemExit) as stop:
        parse(Settings, ["--page-size", "99999999"], description="", exits="")
    assert stop.value.code == 2
    assert "page_size (99999999) must not exceed kv_cache_tokens (16384): the cache would hold no page" in (
        capsys.readouterr().err
    )
    assert parse(Settings, ["--page-size", "64", "--kv-cache-tokens", "64"], description="", exits="").page_size == 64
