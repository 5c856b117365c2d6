"""What every command runs with, built once by `client.cli.app.main`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from client.admin import Admin
from client.sync import Client


@dataclass(frozen=True)
class Context:
    """A command's arguments, a client (requests) and an admin (operator reads and writes), both on one Redis."""

    args: argparse.Namespace
    client: Client
    admin: Admin

    @property
    def queue(self) -> str:
        queue: str = self.args.queue
        return queue
