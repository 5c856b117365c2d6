"""Throwaway TLS certificates for tests: a CA and a server certificate for 127.0.0.1, made with the openssl CLI."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TLSFiles:
    """What a TLS-only redis-server needs, and what its clients trust (`ca`)."""

    ca: Path
    cert: Path
    key: Path

    def server_conf(self) -> list[str]:
        """redis.conf lines: these files, no client certificates, TLS for replication and the cluster bus too."""
        return [
            f"tls-cert-file {self.cert}",
            f"tls-key-file {self.key}",
            f"tls-ca-cert-file {self.ca}",
            "tls-auth-clients no",
            "tls-replication yes",
            "tls-cluster yes",
        ]


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for command in (
        [
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            ca_key,
            "-out",
            ca,
            "-days",
            "1",
            "-subj",
            "/CN=llmq-test-ca",
        ],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        [
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            "1",
            "-extfile",
            ext,
        ],
    ):
        subprocess.run(["openssl", *map(str, command)], check=True, capture_output=True)
    return ca, cert, key


def tls_files(folder: Path) -> TLSFiles:
    return TLSFiles(*make_certificates(folder))
