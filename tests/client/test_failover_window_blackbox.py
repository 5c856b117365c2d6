"""Black-box tests of two start-up contracts, driven only through the installed console scripts.

`llmq --failover-timeout SECONDS` (or `LLMQ_FAILOVER_TIMEOUT_S`) bounds how long a command rides out a Redis
outage before it exits 4 (docs/cli.md, "Connecting"); `llmq-worker --model PATH` with a local path that is not
there exits 1 with one line naming the path, once Redis answers and before the engine is imported (docs/workers.md,
"When a worker does not start"). The CLI's Redis is a closed local port: nothing listens, so every connection is
refused at once; the worker's is the test session's redis-server. No test waits the default 20 s window, and timing
bounds are loose lower bounds or generous upper ones.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
LLMQ = str(BIN / "llmq")
LLMQ_WORKER = str(BIN / "llmq-worker")
UNAVAILABLE = 4
USAGE = 2
TIMEOUT_S = 60


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str
    elapsed: float


def _closed_url(password: str | None = None) -> str:
    """A Redis URL on 127.0.0.1 at a port that was free a moment ago and has nothing listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{port}/0"


def _run(argv: list[str], cwd: Path, env_extra: dict[str, str] | None = None) -> Run:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env.update(env_extra or {})
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    return Run(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def _assert_one_error_line(run: Run) -> None:
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("llmq: error: "), run.stderr


@pytest.mark.parametrize(
    "argv",
    [["--failover-timeout", "0", "status"], ["status", "--failover-timeout", "0"], ["queues", "--failover-timeout=0"]],
    ids=["before-subcommand", "after-subcommand", "equals-form"],
)
def test_zero_window_fails_at_once_with_exit_4(tmp_path: Path, argv: list[str]) -> None:
    run = _run([LLMQ, "--url", _closed_url(), *argv], tmp_path)
    assert run.returncode == UNAVAILABLE, run
    assert run.elapsed < 10, run
    _assert_one_error_line(run)


def test_short_window_rides_out_the_outage_then_exits_4(tmp_path: Path) -> None:
    run = _run([LLMQ, "--url", _closed_url(), "--failover-timeout", "2", "status"], tmp_path)
    assert run.returncode == UNAVAILABLE, run
    assert 1.5 <= run.elapsed < 15, run
    _assert_one_error_line(run)


def test_env_var_sets_the_window(tmp_path: Path) -> None:
    run = _run([LLMQ, "--url", _closed_url(), "status"], tmp_path, {"LLMQ_FAILOVER_TIMEOUT_S": "2"})
    assert run.returncode == UNAVAILABLE, run
    assert 1.5 <= run.elapsed < 15, run
    _assert_one_error_line(run)


def test_flag_outranks_the_env_var(tmp_path: Path) -> None:
    # The environment says fail at once; the flag, given after the subcommand, asks for a 2 s window.
    run = _run(
        [LLMQ, "--url", _closed_url(), "status", "--failover-timeout", "2"], tmp_path, {"LLMQ_FAILOVER_TIMEOUT_S": "0"}
    )
    assert run.returncode == UNAVAILABLE, run
    assert 1.5 <= run.elapsed < 15, run
    _assert_one_error_line(run)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "3601", "abc", ""])
def test_bad_flag_value_is_a_usage_error_naming_the_flag(tmp_path: Path, value: str) -> None:
    run = _run([LLMQ, "--url", _closed_url(), f"--failover-timeout={value}", "status"], tmp_path)
    assert run.returncode == USAGE, run
    assert "--failover-timeout" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert run.elapsed < 30, run


@pytest.mark.parametrize("value", ["-5", "nan", "forever"])
def test_bad_env_value_is_a_usage_error(tmp_path: Path, value: str) -> None:
    run = _run([LLMQ, "--url", _closed_url(), "status"], tmp_path, {"LLMQ_FAILOVER_TIMEOUT_S": value})
    assert run.returncode == USAGE, run
    assert "--failover-timeout" in run.stderr or "LLMQ_FAILOVER_TIMEOUT_S" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("window", ["0", "1"])
def test_password_never_appears_in_output(tmp_path: Path, window: str) -> None:
    secret = "s3cretpw"
    run = _run([LLMQ, "--url", _closed_url(secret), "status", "--failover-timeout", window], tmp_path)
    assert run.returncode == UNAVAILABLE, run
    assert secret not in run.stdout
    assert secret not in run.stderr
    _assert_one_error_line(run)


@pytest.mark.parametrize("spec", ["/no/such/dir", "./missing.gguf", "ABSENT"], ids=["absolute", "relative", "tmp"])
def test_worker_missing_model_path_exits_1_before_loading_anything(redis_url: str, tmp_path: Path, spec: str) -> None:
    if spec == "ABSENT":
        spec = str(tmp_path / "absent-model-folder")
    argv = [LLMQ_WORKER, "--redis-url", redis_url, "--metrics-port", "0", "--model", spec]
    run = _run(argv, tmp_path)
    assert run.returncode == 1, run
    assert "Traceback" not in run.stderr, run.stderr
    assert run.elapsed < 30, run
    last = run.stderr.strip().splitlines()[-1]
    prefix = f"llmq-worker: cannot load model '{spec}': no such file or folder: "
    assert last.startswith(prefix), last
    named = last[len(prefix) :]
    # The path is named as given, or normalised / made absolute; it is the model's path either way.
    assert named == spec or Path(named).name == Path(spec).name, last
    assert "cannot use Redis" not in run.stderr, run.stderr
    assert "loading model" not in run.stderr, run.stderr  # refused before the engine is imported
