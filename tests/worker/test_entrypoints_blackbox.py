"""Black-box checks of the three commands (issue 29), run as a user runs them: the console scripts of this venv
in subprocesses, with imports blocked by a `sitecustomize` on PYTHONPATH where a missing extra is simulated.

What is checked: `--version` of each command; that `--version` and `--help` of the worker and the gateway import
none of torch, transformers, accelerate, starlette, uvicorn; the one-line message without an extra; that `--help`
gives every flag a help line naming its LLMQ_* variable, with no pydantic internals; that bad values (flags,
variables, .env lines) exit 2 naming the flag and never echo a secret.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

DIST = "llmq-redis"
BIN = Path(sys.executable).parent
COMMANDS = ["llmq", "llmq-worker", "llmq-gateway"]
SERVERS = ["llmq-worker", "llmq-gateway"]
HEAVY = ["torch", "transformers", "accelerate", "starlette", "uvicorn"]

# secrets the environment holds while the commands fail: none may appear in anything they print
ENV_PASSWORD = "envPassw0rd-hunter2"
FLAG_PASSWORD = "flagPassw0rd-swordfish"
API_KEY = "sk-envapikey-0123456789"
FLAG_API_KEY = "sk-flagapikey-9876543210"
SECRETS = [ENV_PASSWORD, FLAG_PASSWORD, API_KEY, FLAG_API_KEY]

SITECUSTOMIZE = """\
import os
import sys

_BLOCK = tuple(filter(None, os.environ.get("BLOCK_IMPORTS", "").split(",")))
_LOG = os.environ.get("BLOCK_LOG")


class _Blocker:
    # a meta-path finder in front of all others: the blocked modules look uninstalled, and each try is logged
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in _BLOCK):
            if _LOG:
                with open(_LOG, "a") as f:
                    f.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


if os.environ.get("BLOCK_MODE") == "none-in-sys-modules":
    for _name in _BLOCK:
        sys.modules[_name] = None  # what importlib.util.find_spec reports as not installed
sys.meta_path.insert(0, _Blocker())
"""


# Runs a console script's entry function once per case in one process (the cases as JSON on stdin, each an argv and
# the variables it adds), as the interpreter would run it alone: what it prints, and the exit code `SystemExit`
# carries (a message printed to stderr and 1, as Python does). One process for dozens of bad values instead of one
# each: each start imports the client, pydantic and redis (about a second here). `test_the_driver_reports_what_the_
# script_does` checks it against the real script.
DRIVER = """\
import contextlib, io, json, os, sys
from importlib.metadata import entry_points

[entry] = [e for e in entry_points(group="console_scripts") if e.name == sys.argv[1]]
main = entry.load()
base = dict(os.environ)
results = []
for argv, extra in json.load(sys.stdin):
    os.environ.clear()
    os.environ.update(base, **extra)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
    results.append([code, out.getvalue(), err.getvalue()])
sys.stdout.write(json.dumps(results))
"""

Case = tuple[list[str], dict[str, str]]  # an argv and the variables it adds


def _script(command: str) -> str:
    path = BIN / command
    if not path.exists():
        pytest.skip(f"{command} is not installed in this venv")
    return str(path)


@dataclass
class Sandbox:
    root: Path

    @property
    def log(self) -> Path:
        return self.root / "imports.log"

    def attempted(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def env(self, block: list[str] | tuple[str, ...] = (), mode: str = "finder", **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("LLMQ_", "PYTHONPATH", "PYTHONWARNINGS", "COLUMNS", "OTEL_"))
        }
        env.update(
            PYTHONPATH=str(self.root / "site"),
            BLOCK_IMPORTS=",".join(block),
            BLOCK_LOG=str(self.log),
            BLOCK_MODE=mode,
            COLUMNS="200",
            # nothing listens on port 1: a command that got past its settings fails fast instead of serving
            LLMQ_REDIS_URL=f"redis://llmq:{ENV_PASSWORD}@127.0.0.1:1/0",
            LLMQ_GATEWAY_REDIS_URL=f"redis://llmq:{ENV_PASSWORD}@127.0.0.1:1/0",
            LLMQ_GATEWAY_API_KEYS=f"{API_KEY},{API_KEY}-2",
            LLMQ_GATEWAY_HOST="127.0.0.1",
            LLMQ_GATEWAY_PORT="0",
            LLMQ_METRICS_PORT="0",
            LLMQ_HEALTH_FILE=str(self.root / "health"),
        )
        env.update(extra)
        return env

    def run(
        self,
        command: str,
        *args: str,
        block: list[str] | tuple[str, ...] = (),
        mode: str = "finder",
        cwd: Path | None = None,
        timeout: float = 90,
        **extra: str,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [_script(command), *args],
            cwd=cwd or self.root / "cwd",
            capture_output=True,
            text=True,
            errors="backslashreplace",
            env=self.env(block, mode, **extra),
            timeout=timeout,
        )

    def run_many(self, command: str, cases: list[Case]) -> list[subprocess.CompletedProcess[str]]:
        """Each case as `run(command, *argv, **variables)` would give it, all in one process (`DRIVER`)."""
        _script(command)  # skips where the command is not installed
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, command],
            input=json.dumps(cases),
            cwd=self.root / "cwd",
            capture_output=True,
            text=True,
            errors="backslashreplace",
            env=self.env(),
            timeout=90 + 5 * len(cases),
        )
        assert done.returncode == 0, done.stderr
        return [
            subprocess.CompletedProcess([command, *argv], code, out, err)
            for (argv, _), (code, out, err) in zip(cases, json.loads(done.stdout), strict=True)
        ]


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp_path / "cwd").mkdir()  # an empty working directory: no .env of the checkout's
    return Sandbox(tmp_path)


@pytest.fixture(scope="module")
def version() -> str:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import client, importlib.metadata as m; print(client.__version__, m.version({DIST!r}))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    ours, installed = done.stdout.split()
    assert ours == installed, (ours, installed)
    return ours


def _no_secret(done: subprocess.CompletedProcess[str]) -> None:
    printed = done.stdout + done.stderr
    for secret in SECRETS:
        assert secret not in printed, f"{secret!r} echoed:\n{printed}"


# -- the blocker itself ------------------------------------------------------------------------------------------


def test_the_blocker_blocks_and_logs(sandbox: Sandbox) -> None:
    """Control: the simulation works (else the no-import tests below would pass vacuously)."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch"],
        capture_output=True,
        text=True,
        env=sandbox.env(["torch"]),
        cwd=sandbox.root,
    )
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr
    assert sandbox.attempted() == ["torch"]


def test_the_worker_really_reaches_for_torch_when_run(sandbox: Sandbox) -> None:
    """Control: a real run does look for torch (so the empty logs of --help/--version mean something)."""
    done = sandbox.run("llmq-worker", block=HEAVY)
    assert done.returncode != 0
    assert set(sandbox.attempted()) & {"torch", "transformers"}, sandbox.attempted()


# -- --version ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_version_prints_the_distribution_and_its_version(sandbox: Sandbox, version: str, command: str) -> None:
    done = sandbox.run(command, "--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{DIST} {version}\n", "")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--version", "--help", "-h"])
def test_version_and_help_import_no_heavy_module(sandbox: Sandbox, command: str, flag: str) -> None:
    done = sandbox.run(command, flag, block=HEAVY)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "printed nothing"
    assert "Traceback" not in done.stderr
    assert sandbox.attempted() == [], f"{command} {flag} tried to import {sandbox.attempted()}"


@pytest.mark.parametrize("command", SERVERS)
@pytest.mark.parametrize(
    "others",
    [
        ["--queue", "q"],
        ["--queue", "ünïcødé-キュー-🚀"],
        ["--redis-url", ""],
        ["--redis-url", f"redis://u:{FLAG_PASSWORD}@h/0"],
        ["--log-level", "debug"],
        ["--bogus-flag"],
        ["--log-level", "loud"],
        ["--redis-url", "x" * 100_000],
    ],
    ids=lambda v: repr(v)[:40],
)
def test_version_first_wins_over_any_other_flag(
    sandbox: Sandbox, version: str, command: str, others: list[str]
) -> None:
    done = sandbox.run(command, "--version", *others, block=HEAVY)
    assert (done.returncode, done.stdout) == (0, f"{DIST} {version}\n"), done.stderr
    assert sandbox.attempted() == []
    _no_secret(done)


@pytest.mark.parametrize("command", SERVERS)
def test_version_after_a_bad_value_still_answers(sandbox: Sandbox, version: str, command: str) -> None:
    bad = ["--max-new-tokens", "notanint"]
    done = sandbox.run(command, *bad, "--version", block=HEAVY)
    # argparse order: either the version (values checked after parsing) or a usage error, never a traceback
    assert "Traceback" not in done.stderr
    assert done.returncode in (0, 2), done.stderr
    if done.returncode == 0:
        assert done.stdout == f"{DIST} {version}\n"
    assert sandbox.attempted() == []


@pytest.mark.parametrize("command", SERVERS)
def test_help_then_version_prints_help(sandbox: Sandbox, command: str) -> None:
    done = sandbox.run(command, "--help", "--version", block=HEAVY)
    assert done.returncode == 0
    assert done.stdout.startswith(f"usage: {command}")


# -- without the extras ------------------------------------------------------------------------------------------

WITHOUT_EXTRA = [
    ("llmq-worker", "worker", ["torch"]),
    ("llmq-worker", "worker", ["transformers"]),
    ("llmq-worker", "worker", ["torch", "transformers", "accelerate", "gguf"]),
    ("llmq-worker", "worker", ["pydantic_settings", "structlog", "prometheus_client"]),
    ("llmq-gateway", "gateway", ["starlette"]),
    ("llmq-gateway", "gateway", ["uvicorn"]),
    ("llmq-gateway", "gateway", ["starlette", "uvicorn"]),
    ("llmq-gateway", "gateway", ["pydantic_settings", "structlog", "prometheus_client"]),
]


@pytest.mark.parametrize("mode", ["finder", "none-in-sys-modules"])
@pytest.mark.parametrize(("command", "extra", "block"), WITHOUT_EXTRA, ids=lambda v: str(v))
def test_without_its_extra_a_command_says_so_in_one_line(
    sandbox: Sandbox, command: str, extra: str, block: list[str], mode: str
) -> None:
    done = sandbox.run(command, block=block, mode=mode)
    assert done.returncode != 0
    assert done.stdout == ""
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    assert extra in line, line
    assert f"pip install '{DIST}[{extra}]'" in line or f"pip install {DIST}[{extra}]" in line, line
    _no_secret(done)


@pytest.mark.parametrize(("command", "extra", "block"), WITHOUT_EXTRA[:3] + WITHOUT_EXTRA[4:7], ids=str)
def test_without_its_extra_the_message_wins_over_flags(
    sandbox: Sandbox, command: str, extra: str, block: list[str]
) -> None:
    """Valid flags, hostile text in them: still the one line, not a traceback somewhere further on."""
    done = sandbox.run(
        command, "--prefix", "ünï 🚀 \u202e", "--redis-url", f"redis://u:{FLAG_PASSWORD}@h/0", block=block
    )
    assert done.returncode != 0
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"[{extra}]" in done.stderr
    _no_secret(done)


def test_the_gateway_does_not_need_torch(sandbox: Sandbox, version: str) -> None:
    for flag in ("--version", "--help"):
        done = sandbox.run("llmq-gateway", flag, block=["torch", "transformers", "accelerate", "gguf"])
        assert done.returncode == 0, done.stderr
    assert sandbox.attempted() == []


# -- --help ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    flags: list[str]
    invocation: str
    help: str


def _options(help_text: str) -> list[Option]:
    """The entries of argparse's `options:` section (COLUMNS=200: one entry is one or two lines)."""
    section = help_text.split("\noptions:\n", 1)[1]
    entries: list[list[str]] = []
    for line in section.splitlines():
        if not line.strip():
            if entries:
                break
            continue
        if re.match(r"  -", line):
            entries.append([line])
        elif line.startswith("   ") and entries:
            entries[-1].append(line)
        else:
            break
    options = []
    for lines in entries:
        parts = re.split(r"\s{2,}", lines[0].strip(), maxsplit=1)
        invocation, rest = parts[0], parts[1] if len(parts) > 1 else ""
        help_part = " ".join([rest, *(x.strip() for x in lines[1:])]).strip()
        flags = re.findall(r"(?<![\w-])--?[A-Za-z0-9][\w-]*", invocation)
        options.append(Option(flags, invocation, re.sub(r"\s+", " ", help_part)))
    return options


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("help")
    box = Sandbox(root)
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (root / "cwd").mkdir()
    out = {}
    for command in SERVERS:
        done = box.run(command, "--help")
        assert done.returncode == 0, done.stderr
        out[command] = done.stdout
    return out


def _env_name(command: str, flag: str) -> str:
    prefix = "LLMQ_GATEWAY_" if command == "llmq-gateway" else "LLMQ_"
    return prefix + flag.removeprefix("--").upper().replace("-", "_")


def _settings(command: str, helps: dict[str, str]) -> list[Option]:
    options = [o for o in _options(helps[command]) if not {"-h", "--help", "--version"} & set(o.flags)]
    assert len(options) >= 15, [o.invocation for o in options]
    return options


@pytest.mark.parametrize("command", SERVERS)
def test_help_gives_every_flag_a_help_line(command: str, helps: dict[str, str]) -> None:
    options = _options(helps[command])
    flags = [f for o in options for f in o.flags]
    assert len(flags) == len(set(flags)), "a flag listed twice"
    for option in options:
        assert re.search(r"[a-z]{3}", option.help), f"no help for {option.invocation!r}"


@pytest.mark.parametrize("command", SERVERS)
def test_help_names_each_flags_own_variable(command: str, helps: dict[str, str]) -> None:
    for option in _settings(command, helps):
        long = [f for f in option.flags if f.startswith("--") and not f.startswith("--no-")]
        assert long, option.invocation
        assert _env_name(command, long[0]) in option.help.split("env ", 1)[-1], (option.invocation, option.help)
        assert re.search(r"\bLLMQ_[A-Z0-9_]+", option.help), option.help


@pytest.mark.parametrize("command", SERVERS)
def test_help_shows_no_pydantic_internals(command: str, helps: dict[str, str]) -> None:
    text = helps[command]
    for pattern in [
        r"SecretStr",
        r"Secret\[",
        r"\*{3,}",
        r"\{[^}\n]*\bnull\b[^}\n]*\}",
        r"\{[^}\n]*\b(Path|int|str|float|bool|dict|list)\b[^}\n]*\}",
        r"PydanticUndefined",
        r"NoneType",
        r"Optional\[",
        r"Union\[",
        r"Literal\[",
        r"Annotated",
        r"typing\.",
        r"pydantic",
        r"<class ",
        r"FieldInfo",
        r"\b(list|dict|set|tuple)\[",
        r"annotation=",
    ]:
        found = re.search(pattern, text)
        assert found is None, f"{pattern!r} in help: ...{text[max(0, found.start() - 80) : found.end() + 80]}..."


@pytest.mark.parametrize("command", SERVERS)
def test_help_does_not_show_secrets_from_the_environment(sandbox: Sandbox, command: str) -> None:
    done = sandbox.run(command, "--help")
    assert done.returncode == 0
    _no_secret(done)


@pytest.mark.parametrize("command", SERVERS)
@pytest.mark.parametrize("columns", ["1", "20", "60", "10000"])
def test_help_at_any_terminal_width(sandbox: Sandbox, command: str, columns: str) -> None:
    done = sandbox.run(command, "--help", COLUMNS=columns, block=HEAVY)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "--redis-url" in done.stdout


@pytest.mark.parametrize("command", SERVERS)
def test_help_in_an_ascii_locale(sandbox: Sandbox, command: str) -> None:
    done = sandbox.run(command, "--help", LC_ALL="C", LANG="C", PYTHONIOENCODING="ascii", PYTHONUTF8="0")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


# -- bad values --------------------------------------------------------------------------------------------------


def _bad_value(option: Option) -> str | None:
    """A value the option's metavar says is wrong, or None where any text is allowed."""
    metavar = option.invocation.split(" ", 1)[1].split(",")[0] if " " in option.invocation else ""
    if "INT" in metavar:
        return "notanint"
    if "FLOAT" in metavar:
        return "notafloat"
    if "|" in metavar:
        return "not-a-choice"
    if any(f.startswith("--no-") for f in option.flags):
        return "maybe-not-a-bool"
    return None


def _typed(command: str, helps: dict[str, str]) -> list[tuple[str, str]]:
    out = []
    for option in _settings(command, helps):
        bad = _bad_value(option)
        if bad is not None:
            out.append((option.flags[0], bad))
    return out


def _assert_usage_error(done: subprocess.CompletedProcess[str], command: str, *names: str) -> None:
    assert done.returncode == 2, (done.args, done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, (done.args, done.stderr)
    assert done.stdout == ""
    assert any(name in done.stderr for name in names), f"none of {names} in {done.stderr!r}"
    assert f"{command}: error:" in done.stderr or f"{command}:" in done.stderr, done.stderr
    _no_secret(done)


@pytest.mark.parametrize("command", SERVERS)
def test_the_driver_reports_what_the_script_does(sandbox: Sandbox, command: str, helps: dict[str, str]) -> None:
    """Control for `Sandbox.run_many`: a bad flag, a bad variable and an unknown flag give the same exit code and
    output in the driver as through the real console script."""
    [(flag, bad), *_] = [(f, b) for f, b in _typed(command, helps) if b != "maybe-not-a-bool"]
    cases: list[Case] = [([flag, bad], {}), ([], {_env_name(command, flag): bad}), (["--no-such-flag"], {})]
    for (argv, variables), driven in zip(cases, sandbox.run_many(command, cases), strict=True):
        alone = sandbox.run(command, *argv, **variables)
        assert (driven.returncode, driven.stdout, driven.stderr) == (alone.returncode, alone.stdout, alone.stderr)
        assert driven.returncode == 2


@pytest.mark.parametrize("command", SERVERS)
def test_a_bad_flag_value_exits_2_naming_the_flag(sandbox: Sandbox, command: str, helps: dict[str, str]) -> None:
    typed = _typed(command, helps)
    assert len(typed) >= 10, typed
    # a switch takes no value: the extra word would be an unrecognized argument
    flags = [(flag, bad) for flag, bad in typed if bad != "maybe-not-a-bool"]
    url = f"redis://u:{FLAG_PASSWORD}@h/0"
    runs = sandbox.run_many(command, [([flag, bad, "--redis-url", url], {}) for flag, bad in flags])
    for (flag, _), done in zip(flags, runs, strict=True):
        _assert_usage_error(done, command, flag)


@pytest.mark.parametrize("command", SERVERS)
def test_a_bad_variable_exits_2_naming_it(sandbox: Sandbox, command: str, helps: dict[str, str]) -> None:
    typed = _typed(command, helps)
    runs = sandbox.run_many(command, [([], {_env_name(command, flag): bad}) for flag, bad in typed])
    for (flag, _), done in zip(typed, runs, strict=True):
        _assert_usage_error(done, command, flag, _env_name(command, flag))


GATEWAY_BAD_VALUES = [
    ["--port", "notanumber"],
    ["--port", ""],
    ["--port", " "],
    ["--port", "-1"],
    ["--port", "65536"],
    ["--port", "9" * 30],
    ["--port", "9" * 5000],
    ["--port", "8000.5"],
    ["--port", "0x1F90"],
    ["--port", "\uff18\uff10\uff10\uff10"],
    ["--port", "\udcff"],
    ["--max-body-bytes", "lots"],
    ["--request-timeout-s", "soon"],
    ["--log-level", "loud"],
    ["--log-format", "xml"],
]


def test_gateway_bad_values(sandbox: Sandbox) -> None:
    extras = ([], ["--api-keys", FLAG_API_KEY], ["--redis-url", f"rediss://admin:{FLAG_PASSWORD}@h:6380/0"])
    cases: list[Case] = [([*extra, *args], {}) for args in GATEWAY_BAD_VALUES for extra in extras]
    for (argv, _), done in zip(cases, sandbox.run_many("llmq-gateway", cases), strict=True):
        _assert_usage_error(done, "llmq-gateway", argv[-2])


WORKER_BAD_VALUES = [
    ["--max-running", "notanint"],
    ["--max-running", ""],
    ["--max-running", "1.5"],
    ["--max-running", "-1"],
    ["--max-running", "9" * 5000],
    ["--max-running", "\uff13"],
    ["--max-running", "\udcff"],
    ["--seed", "1.5"],
    ["--seed", "🌱"],
    ["--kv-cache-tokens", "lots"],
    ["--heartbeat-s", "abc"],
    ["--heartbeat-s", "-1"],
    ["--heartbeat-s", "nan"],
    ["--quantize", "int4"],
    ["--log-level", "loud"],
    ["--log-format", ""],
]


def test_worker_bad_values(sandbox: Sandbox) -> None:
    extras = ([], ["--redis-url", f"redis://admin:{FLAG_PASSWORD}@h:6380/0"])
    cases: list[Case] = [([*extra, *args], {}) for args in WORKER_BAD_VALUES for extra in extras]
    for (argv, _), done in zip(cases, sandbox.run_many("llmq-worker", cases), strict=True):
        _assert_usage_error(done, "llmq-worker", argv[-2])


@pytest.mark.parametrize("command", SERVERS)
def test_unknown_or_incomplete_arguments_exit_2(sandbox: Sandbox, command: str) -> None:
    cases: list[Case] = [
        (args, {}) for args in (["--no-such-flag", "1"], ["--bogus\udcff"], ["--queue"], ["positional"])
    ]
    for done in sandbox.run_many(command, cases):
        assert done.returncode == 2, (done.args, done.stderr)
        assert "Traceback" not in done.stderr and done.stderr.startswith("usage:"), (done.args, done.stderr)
        _no_secret(done)


@pytest.mark.parametrize(
    ("command", "variable", "flag"),
    [("llmq-worker", "LLMQ_MAX_RUNNING", "--max-running"), ("llmq-gateway", "LLMQ_GATEWAY_PORT", "--port")],
)
def test_a_bad_dotenv_line_exits_2_without_the_password_of_another(
    sandbox: Sandbox, command: str, variable: str, flag: str
) -> None:
    cwd = sandbox.root / "cwd"
    url_var = "LLMQ_GATEWAY_REDIS_URL" if command == "llmq-gateway" else "LLMQ_REDIS_URL"
    (cwd / ".env").write_text(f"{url_var}=redis://u:{FLAG_PASSWORD}@127.0.0.1:1/0\n{variable}=abc\n")
    env = sandbox.env()
    env.pop(url_var)
    env.pop(variable, None)
    done = subprocess.run([_script(command)], cwd=cwd, capture_output=True, text=True, env=env, timeout=90)
    _assert_usage_error(done, command, flag, variable)


def test_worker_with_an_unusable_redis_url_says_so_without_the_password(sandbox: Sandbox) -> None:
    for url in [f"ftp://u:{FLAG_PASSWORD}@h/0", f"redis://u:{FLAG_PASSWORD}@h:notaport/0", ""]:
        done = sandbox.run("llmq-worker", "--redis-url", url)
        assert done.returncode in (1, 2), done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) <= 2, done.stderr
        _no_secret(done)


# -- bugs --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [f"ftp://u:{FLAG_PASSWORD}@h/0", ""], ids=["ftp", "empty"])
def test_gateway_rejects_a_malformed_redis_url_like_a_bad_value(sandbox: Sandbox, url: str) -> None:
    done = sandbox.run("llmq-gateway", "--redis-url", url, timeout=60)
    _no_secret(done)
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    _assert_usage_error(done, "llmq-gateway", "--redis-url", "LLMQ_GATEWAY_REDIS_URL")


def test_gateway_names_a_missing_certificate_file(sandbox: Sandbox) -> None:
    missing = sandbox.root / "missing" / "cert.pem"
    done = sandbox.run(
        "llmq-gateway", "--ssl-certfile", str(missing), "--ssl-keyfile", str(missing.with_name("key.pem")), timeout=60
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "--ssl-certfile" in done.stderr or "LLMQ_GATEWAY_SSL_CERTFILE" in done.stderr, done.stderr


@pytest.mark.parametrize("line", ["REDIS_PASSWORD=s3cret-compose", "LLMQ_GATEWAY_PORT=8001"])
def test_worker_tolerates_a_dotenv_shared_with_compose_or_the_gateway(sandbox: Sandbox, line: str) -> None:
    cwd = sandbox.root / "cwd"
    (cwd / ".env").write_text(f"{line}\n")
    done = sandbox.run("llmq-worker")  # past its settings it fails on Redis (port 1), in one line
    assert "s3cret-compose" not in done.stderr
    assert done.returncode == 1, done.stderr
    assert "Extra inputs" not in done.stderr, done.stderr


def test_worker_names_an_unknown_dotenv_variable_as_written(sandbox: Sandbox) -> None:
    (sandbox.root / "cwd" / ".env").write_text("LLMQ_TYPO_FLAG=1\n")
    done = sandbox.run("llmq-worker")
    assert "Traceback" not in done.stderr
    assert "LLMQ_LLMQ_" not in done.stderr and "--llmq-" not in done.stderr, done.stderr
