"""The client is what a backend installs: importing it must not pull in the worker's heavy stack."""

from __future__ import annotations

import subprocess
import sys


def test_client_does_not_import_torch_or_transformers() -> None:
    code = (
        "import sys, client, client.cli, client.protocol\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'worker'})\n"
        "print(heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "client.protocol" in imported
    assert not {m for m in imported if m.split(".")[0] in {"torch", "transformers"}}
