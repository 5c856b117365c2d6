"""What a `--model` value names, told without importing torch: the worker refuses a local path that is not there as
soon as Redis answers, before it imports the engine (seconds), and the loader refuses it the same way."""

from __future__ import annotations

from pathlib import Path


def missing_path(spec: str) -> Path | None:
    """`spec` as a local path that is not there, else None. A path starts with `/`, `.` or `~`, or names a `.gguf`
    file; anything else is a hub id (or the default alias), which only loading tells apart."""
    path = Path(spec).expanduser()
    if (spec.startswith(("/", ".", "~")) or path.suffix == ".gguf") and not path.exists():
        return path
    return None
