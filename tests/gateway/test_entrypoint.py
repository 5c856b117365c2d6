"""`llmq-gateway` as a person meets it: `--version` and `--help` without loading Starlette, uvicorn or torch, help
that shows no pydantic internals, and one line (not a traceback) when the `gateway` extra is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

import client
from gateway.settings import GatewaySettings
from tests.worker.test_entrypoint import check_help, command, flag_help

LIGHT = ["torch", "transformers", "starlette", "uvicorn"]  # what --help and --version never load


def test_version_is_the_distributions(tmp_path: Path) -> None:
    done = command("gateway.__main__", "--version", blocked=LIGHT, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"llmq-redis {client.__version__}\n", "")


def test_help_is_clean_and_loads_nothing_heavy(tmp_path: Path) -> None:
    done = command("gateway.__main__", "--help", blocked=LIGHT, cwd=tmp_path)
    check_help(done, GatewaySettings, "LLMQ_GATEWAY_")
    assert "default: unset" in flag_help(done.stdout)["--api-keys"]  # a secret: unset, never asterisks
    assert "Exit status" in done.stdout and "'gateway' extra" in done.stdout


@pytest.mark.parametrize("missing", ["starlette", "uvicorn", "pydantic_settings", "structlog"])
def test_without_the_extra_one_line_says_what_to_install(tmp_path: Path, missing: str) -> None:
    done = command("gateway.__main__", "--port", "0", blocked=[missing], cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == "llmq-gateway: the gateway needs the 'gateway' extra: pip install 'llmq-redis[gateway]'\n"


def test_a_bad_flag_is_a_usage_error(tmp_path: Path) -> None:
    done = command("gateway.__main__", "--port", "http", "--api-keys", "s3cret", blocked=LIGHT, cwd=tmp_path)
    assert done.returncode == 2 and "s3cret" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "llmq-gateway: error: --port (LLMQ_GATEWAY_PORT): Input should be a valid integer, unable to parse string "
        "as an integer"
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--redis-url", "ftp://u:s3cret@h/0"], "--redis-url (LLMQ_GATEWAY_REDIS_URL): not a Redis URL"),
        (["--ssl-certfile", "/no/cert.pem"], "--ssl-certfile (LLMQ_GATEWAY_SSL_CERTFILE): no file at"),
        (["--api-keys", " , "], "--api-keys (LLMQ_GATEWAY_API_KEYS): names no key"),
    ],
    ids=["url", "certificate", "no-key"],
)
def test_what_would_fail_after_start_up_is_a_usage_error_naming_its_flag(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    """A URL that is no Redis URL, a missing certificate, API keys that name no key (which would serve an open
    API): refused before uvicorn starts, each as its flag's bad value, no password shown."""
    done = command("gateway.__main__", *flags, blocked=LIGHT, cwd=tmp_path)
    assert done.returncode == 2 and "s3cret" not in done.stderr and "Traceback" not in done.stderr
    assert named in done.stderr.splitlines()[-1], done.stderr
