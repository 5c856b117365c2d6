"""Redis AUTH (password and ACL user) and TLS for the client and the worker; no secret in errors or logs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from client import AsyncClient, Client, RedisUnavailable
from testing.certificates import make_certificates
from testing.tiny_models import save_tiny_model
from worker.config import Settings
from worker.embedded_redis import RedisServer
from worker.logging import redact
from worker.process import connect

PASSWORD = "s3cret-Pa55"
ACL_PASSWORD = "acl-Pa55word"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(
        tmp_path_factory.mktemp("auth-redis"),
        "--requirepass",
        PASSWORD,
        "--user",
        "app",
        "on",
        f">{ACL_PASSWORD}",
        "~*",
        "&*",
        "+@all",
    ).start()
    yield server
    server.stop()


def url(server: RedisServer, user: str, password: str, scheme: str = "redis") -> str:
    return f"{scheme}://{user}:{password}@127.0.0.1:{server.port}/0"


@pytest.mark.parametrize(("user", "password"), [("default", PASSWORD), ("app", ACL_PASSWORD)])
def test_right_credentials_work(auth_server: RedisServer, user: str, password: str) -> None:
    with Client(url(auth_server, user, password)) as client:
        assert client.status().depth == 0


@pytest.mark.parametrize(("user", "password"), [("default", "wrong-one"), ("app", PASSWORD), ("nobody", "x")])
async def test_wrong_credentials_get_a_clear_error_without_the_password(
    auth_server: RedisServer, user: str, password: str
) -> None:
    async with AsyncClient(url(auth_server, user, password)) as client:
        with pytest.raises(RedisUnavailable) as failure:  # at once: a refusal is not retried
            await client.status()
    assert isinstance(failure.value.__cause__, redis.AuthenticationError)
    assert "password" in str(failure.value) and password not in str(failure.value)


def test_worker_refuses_to_start_with_a_wrong_password(auth_server: RedisServer, tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", "llama")
    bad_url = url(auth_server, "app", "not-the-password")
    run = subprocess.run(
        [sys.executable, "-m", "worker", "--redis-url", bad_url, "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "cannot use Redis at redis://app:***@127.0.0.1" in run.stderr and "password" in run.stderr
    assert "not-the-password" not in run.stdout + run.stderr


def test_urls_are_redacted_in_logs() -> None:
    assert (
        redact(f"connecting to rediss://app:{PASSWORD}@host:6380/0 now")
        == "connecting to rediss://app:***@host:6380/0 now"
    )
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make test certificates")
    folder = tmp_path_factory.mktemp("tls")
    ca, cert, key = make_certificates(folder)
    server = RedisServer(
        folder / "redis",
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(ca),
        "--tls-auth-clients",
        "no",
        "--requirepass",
        PASSWORD,
        tls=True,
    )
    try:
        server.start()
    except RuntimeError as error:  # a redis-server built without TLS
        pytest.skip(f"redis-server without TLS support: {error}")
    yield server, ca
    server.stop()


def test_client_over_tls(tls_server: tuple[RedisServer, Path]) -> None:
    server, ca = tls_server
    with Client(url(server, "default", PASSWORD, "rediss"), ssl_ca_certs=str(ca)) as client:
        assert client.status().depth == 0


async def test_worker_connects_over_tls_with_its_ca_file(tls_server: tuple[RedisServer, Path]) -> None:
    server, ca = tls_server
    settings = Settings(_env_file=None, redis_url=url(server, "default", PASSWORD, "rediss"), redis_ca_file=ca)
    connection = connect(settings)
    assert await connection.ping()
    await connection.aclose()
    untrusted = connect(Settings(_env_file=None, redis_url=url(server, "default", PASSWORD, "rediss")))
    with pytest.raises(redis.ConnectionError):
        await untrusted.ping()
    await untrusted.aclose()
