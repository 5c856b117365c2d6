"""`llmq batch`: a JSONL file of requests in the OpenAI Batch API format through the queue, resumable and
exactly once per line.

Input lines: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}`
with `messages` or `prompt`, `max_tokens` (or `max_completion_tokens`), `temperature`, `top_p`, `stop`, `seed`.
Output lines, in completion order: `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}` or `{"id", "custom_id", "response": null, "error": {"code", "message"}}`.

Exactly once: a line's request id is derived from the input file's content and its `custom_id`, so a rerun
(after Ctrl-C, `kill -9` of the CLI or a worker crash) skips the lines already in the output, re-attaches to
the ones still running (submitting an id again only follows the first submission) and never generates a line
twice. A line cut short by a kill is dropped from the output and redone.

A line that cannot name itself (not JSON, no `custom_id`) or repeats an earlier line's `custom_id` is answered
with an error line that also carries its `line` number (`custom_id` null when it has none): such lines are
known by their number, the others by their `custom_id`, so neither can stand for the other on a rerun.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from client.errors import Cancelled, InvalidRequest, LLMQError, ResultTimeout
from client.openai_format import CHAT, COMPLETIONS, FieldError, Translated, choice_body, choices_body, translate
from client.protocol import Lane, choice_ids
from client.sync import Client


@dataclass
class Line:
    """One input line: its `custom_id` and the keyword arguments of `submit`, or why it cannot run."""

    number: int
    custom_id: str | None  # None: the line has no usable one
    request_id: str
    url: str = CHAT
    options: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    repeats: int | None = None  # the earlier line whose custom_id this one repeats
    model: str | None = None  # the body's `model` (the HTTP Batch API picks the queue by it)
    body_problem: bool = False  # the problem is in the body's fields, not in the line's shape

    @property
    def request_ids(self) -> list[str]:
        """The ids its answers are generated under: its own, or its `n` choices'."""
        return choice_ids(self.request_id, self.options.get("n", 1))

    @property
    def by_number(self) -> bool:
        """Known in the output by its line number: its custom_id is missing or belongs to an earlier line."""
        return self.custom_id is None or self.repeats is not None

    def repeating(self, earlier: int) -> Line:
        problem = f"line {self.number}: custom_id {self.custom_id!r} is already line {earlier}'s"
        request = line_request_id(self.request_id, self.number)
        return Line(self.number, self.custom_id, request, problem=problem, repeats=earlier)


def file_identity(path: Path) -> str:
    """A digest of the input's content: the same file gives the same request ids on every run."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()[:16]


def request_id(identity: str, custom_id: str) -> str:
    return f"batch-{identity}-{hashlib.sha256(custom_id.encode()).hexdigest()[:24]}"


def line_request_id(base: str, number: int) -> str:
    """The id of an answer known by its line number (never submitted): apart from every custom_id's."""
    return f"{base}-line-{number}"


def parse_line(number: int, text: str, identity: str) -> Line:
    """An input line as a request; anything wrong with it becomes the line's `problem`, never an exception."""
    unnamed = Line(number, None, line_request_id(f"batch-{identity}", number))
    try:
        item = json.loads(text)
    except json.JSONDecodeError as error:
        unnamed.problem = f"line {number} is not JSON: {error.msg}"
        return unnamed
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    if not isinstance(custom_id, str) or not custom_id:
        unnamed.problem = f"line {number}: custom_id must be a non-empty string in a JSON object"
        return unnamed
    line = Line(number, custom_id, request_id(identity, custom_id), url=item.get("url", CHAT))
    body = item.get("body")
    if item.get("method", "POST") != "POST" or line.url not in (CHAT, COMPLETIONS):
        line.problem = f"only POST {CHAT} and {COMPLETIONS} are supported, not {item.get('method')} {line.url}"
    elif not isinstance(body, dict):
        line.problem = "body must be a JSON object"
    else:
        translated, line.problem = _translated(body, line.url)
        line.options, line.model, line.body_problem = translated.options, translated.model, line.problem is not None
        if translated.n > 1:
            line.options["n"] = translated.n
    line.options["request_id"] = line.request_id
    return line


def parse_lines(texts: Iterable[str], identity: str) -> Iterator[Line]:
    """Every non-blank line of an input (numbered from 1), parsed; a line that repeats an earlier line's
    `custom_id` comes as `Line.repeating` that earlier line."""
    first_lines: dict[str, int] = {}  # custom_id -> the line that owns it, the first with it in the input
    for number, text in enumerate(texts, 1):
        if not text.strip():
            continue
        line = parse_line(number, text, identity)
        if line.custom_id is not None and first_lines.setdefault(line.custom_id, number) != number:
            line = line.repeating(first_lines[line.custom_id])
        yield line


def _translated(body: dict[str, Any], url: str) -> tuple[Translated, str | None]:
    try:
        translated = translate(body, url, n_allowed=True)
    except FieldError as error:
        return Translated(), str(error)
    if translated.stream:
        return Translated(), "stream is not supported in a batch"
    return translated, None


_CODES = ((InvalidRequest, "invalid_request"), (Cancelled, "cancelled"), (ResultTimeout, "timeout"))  # as the gateway


def output_line(
    line: Line, model: str, result: Any = None, error: LLMQError | None = None, *, code: str = "invalid_request"
) -> str:
    """One output line in the OpenAI Batch format (plus `line` for a line known by its number). Without `result`
    and `error`, the line is answered without running: its `problem`, under `code`."""
    request = line.request_id
    row: dict[str, Any] = {"id": f"batch_req_{request}", "custom_id": line.custom_id}
    if line.by_number:
        row["line"] = line.number
    if result is None:
        if error is None:  # the line itself is wrong (or, with another `code`, could not run)
            failure = {"code": code, "message": line.problem}
        else:
            fallback = next((code for kind, code in _CODES if isinstance(error, kind)), "failed")
            code = getattr(error, "code", fallback)
            failure = {"code": str(code), "message": str(error)}
        return json.dumps({**row, "response": None, "error": failure})
    choices = [  # `n` choices (`Result.choices`), or the one
        choice_body(line.url, index, choice.text, choice.finish_reason, choice.logprobs, tool_calls=choice.tool_calls)
        for index, choice in enumerate(result.choices or [result])
    ]
    body = choices_body(line.url, request, model, int(time.time()), choices, result.usage)
    return json.dumps({**row, "response": {"status_code": 200, "request_id": request, "body": body}, "error": None})


@dataclass
class Written:
    """What the output already holds: lines known by custom_id, lines known by number, and how many failed."""

    custom_ids: set[str] = field(default_factory=set)
    numbers: set[int] = field(default_factory=set)
    failed: int = 0

    def holds(self, line: Line) -> bool:
        return line.number in self.numbers if line.by_number else line.custom_id in self.custom_ids


def written(output: Path) -> Written:
    """The output's lines so far; a last line cut short by a kill is truncated away (it is redone)."""
    found = Written()
    if not output.exists():
        return found
    with output.open("rb+") as stream:
        data = stream.read()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            stream.truncate(keep)
    for raw in data[:keep].splitlines():
        try:
            row = json.loads(raw)
            if isinstance(row.get("line"), int):
                found.numbers.add(row["line"])
            else:
                found.custom_ids.add(row["custom_id"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        found.failed += row.get("error") is not None
    return found


@dataclass
class Progress:
    """Done, failed, tokens/s and ETA: redrawn in place on a terminal, one summary line otherwise."""

    total: int
    stream: TextIO = sys.stderr
    done: int = 0
    failed: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    _drawn: float = 0.0

    def add(self, tokens: int, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        self.tokens += tokens
        if self.stream.isatty() and time.monotonic() - self._drawn > 0.2:
            self._drawn = time.monotonic()
            self.stream.write(f"\r{self.line()}\x1b[K")
            self.stream.flush()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else float("inf")
        return (
            f"{self.done}/{self.total} done, {self.failed} failed, {self.tokens / elapsed:,.0f} tok/s, ETA {eta:,.0f} s"
        )

    def close(self) -> None:
        summary = f"{self.line()} in {time.monotonic() - self.started:,.1f} s"
        self.stream.write(f"\r{summary}\x1b[K\n" if self.stream.isatty() else f"llmq batch: {summary}\n")


def run_batch(
    client: Client, source: Path, output: Path, *, window: int, timeout: float | None, priority: Lane = "batch"
) -> int:
    """Runs every line of `source` not yet in `output` in lane `priority` (a line's `service_tier` wins);
    returns how many lines of the output failed, in this run or an earlier one."""
    identity = file_identity(source)
    done = written(output)
    with source.open("rb") as stream:
        total = sum(1 for raw in stream if raw.strip())
    progress = Progress(total, done=len(done.custom_ids) + len(done.numbers), failed=done.failed)
    running: dict[int, Line] = {}  # by submit_many's index: only the lines in flight are held
    indexes = itertools.count()

    def requests(sink: TextIO) -> Iterator[dict[str, Any]]:
        with source.open(encoding="utf-8-sig", errors="replace") as stream:
            for line in parse_lines(stream, identity):
                if done.holds(line):
                    continue
                if line.problem is not None:
                    write(sink, output_line(line, client.queue))
                    progress.add(0, failed=True)
                    continue
                running[next(indexes)] = line  # submit_many numbers the requests in the order they are read
                yield {"priority": priority, **line.options}

    with output.open("a", encoding="utf-8") as sink:
        for outcome in client.submit_many(requests(sink), window=window, timeout=timeout):
            line = running.pop(outcome.index)
            write(sink, output_line(line, client.queue, outcome.result, outcome.error))
            tokens = outcome.result.usage.completion_tokens if outcome.result is not None else 0
            progress.add(tokens, failed=outcome.error is not None)
    progress.close()
    return progress.failed


def write(sink: TextIO, text: str) -> None:
    """One whole line per write, flushed: a kill leaves at most the last line cut short."""
    sink.write(text + "\n")
    sink.flush()
