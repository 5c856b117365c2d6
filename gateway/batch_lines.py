"""A batch's input file read as `llmq batch` reads one (`client.batch`: the same parsing, the same derived request
ids, the same output lines), and checked as OpenAI checks one at the `validating` step. Pure, no I/O.

A line's shape (JSON, `custom_id`, `method`, `url`, `body`, `model`) is checked for the whole file first: one
wrong line fails the batch, with up to `MAX_ERRORS` errors listed. A line whose body asks for something llmq
cannot do (an unsupported field) is answered in the error file instead, and the other lines still run."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from client.batch import Line, output_line, parse_lines

MAX_ERRORS = 20
EXPIRED = "This request could not be executed before the completion window expired."


def identity_of(batch_id: str) -> str:
    """What the request ids of a batch's lines derive from: its id, so two batches of one file both run."""
    return batch_id.removeprefix("batch_")


def lines(data: bytes, identity: str) -> Iterator[Line]:
    """The file's lines, split and decoded as `llmq batch` reads a file (a BOM dropped, bad UTF-8 replaced)."""
    return parse_lines(io.TextIOWrapper(io.BytesIO(data), encoding="utf-8-sig", errors="replace"), identity)


@dataclass
class Checked:
    """The verdict on an input file: its lines, its model, and why it is refused (`errors`, empty if it is not)."""

    total: int = 0
    model: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    refused: list[tuple[str, str, bool]] = field(default_factory=list)  # answers of lines whose body cannot run

    def refuse(self, line: Line, code: str, message: str, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "message": message, "param": param, "line": line.number})


def check(data: bytes, identity: str, endpoint: str, max_lines: int) -> Checked:
    """Checks every line against the batch's `endpoint` and the limit of `max_lines` lines."""
    checked = Checked()
    for line in lines(data, identity):
        checked.total += 1
        if line.problem is not None and not line.body_problem:
            code = "duplicate_custom_id" if line.repeats is not None else "invalid_request"
            checked.refuse(line, code, line.problem)
        elif line.url != endpoint:
            message = f"line {line.number}: url {line.url} is not the batch's endpoint {endpoint}"
            checked.refuse(line, "mismatched_endpoint", message, "url")
        elif line.body_problem:
            assert line.custom_id is not None  # a line with a body has a custom_id
            checked.refused.append((line.custom_id, output_line(line, ""), False))
        elif not line.model:
            checked.refuse(line, "missing_required_parameter", f"line {line.number}: body.model is required", "model")
        elif checked.model is not None and line.model != checked.model:
            message = f"line {line.number}: model {line.model!r} is not {checked.model!r}, the batch's model"
            checked.refuse(line, "mismatched_model", message, "model")
        else:
            checked.model = line.model
    if checked.total == 0:
        checked.errors.append({"code": "empty_file", "message": "The input file has no line.", "param": None})
    elif checked.total > max_lines:
        message = f"The input file has {checked.total} lines; a batch holds at most {max_lines}."
        checked.errors.append({"code": "too_many_requests", "message": message, "param": None})
    return checked


def runnable(data: bytes, identity: str, answered: set[str]) -> Iterator[Line]:
    """The lines still to run: checked, not refused, and not answered yet."""
    for line in lines(data, identity):
        if line.problem is None and line.custom_id not in answered:
            yield line


def expired(data: bytes, identity: str, model: str, answered: set[str]) -> list[tuple[str, str, bool]]:
    """The error-file answers of the lines that did not run in time."""
    found = []
    for line in runnable(data, identity, answered):
        line.problem = EXPIRED
        found.append((line.custom_id or "", output_line(line, model, code="batch_expired"), False))
    return found
