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
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from client.errors import InvalidRequest, LLMQError
from client.openai_format import CHAT, COMPLETIONS, FieldError, completion_body, translate
from client.protocol import Lane
from client.sync import Client


@dataclass
class Line:
    """One input line: its `custom_id` and the keyword arguments of `submit`, or why it cannot run."""

    number: int
    custom_id: str
    request_id: str
    url: str = CHAT
    options: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None


def file_identity(path: Path) -> str:
    """A digest of the input's content: the same file gives the same request ids on every run."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()[:16]


def request_id(identity: str, custom_id: str) -> str:
    return f"batch-{identity}-{hashlib.sha256(custom_id.encode()).hexdigest()[:24]}"


def parse_line(number: int, text: str, identity: str) -> Line:
    """An input line as a request; anything wrong with it becomes the line's `problem`, never an exception."""
    anonymous = f"line-{number}"
    unnamed = Line(number, anonymous, request_id(identity, anonymous))
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
        line.options, line.problem = _options(body, line.url)
    line.options["request_id"] = line.request_id
    return line


def _options(body: dict[str, Any], url: str) -> tuple[dict[str, Any], str | None]:
    try:
        translated = translate(body, url)
    except FieldError as error:
        return {}, str(error)
    if translated.stream:
        return {}, "stream is not supported in a batch"
    return translated.options, None


def output_line(line: Line, model: str, result: Any = None, error: LLMQError | None = None) -> str:
    """One output line in the OpenAI Batch format."""
    request = line.request_id
    if result is None:
        if error is None:  # the line itself is wrong
            failure = {"code": "invalid_request", "message": line.problem}
        else:
            code = getattr(error, "code", "invalid_request" if isinstance(error, InvalidRequest) else "failed")
            failure = {"code": str(code), "message": str(error)}
        return json.dumps(
            {"id": f"batch_req_{request}", "custom_id": line.custom_id, "response": None, "error": failure}
        )
    body = completion_body(
        line.url, request, model, int(time.time()), result.text, result.finish_reason, result.usage, result.logprobs
    )
    response = {"status_code": 200, "request_id": request, "body": body}
    return json.dumps({"id": f"batch_req_{request}", "custom_id": line.custom_id, "response": response, "error": None})


def finished_ids(output: Path) -> set[str]:
    """`custom_id`s already in the output; a last line cut short by a kill is truncated away (it is redone)."""
    if not output.exists():
        return set()
    with output.open("rb+") as stream:
        data = stream.read()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            stream.truncate(keep)
    done = set()
    for raw in data[:keep].splitlines():
        try:
            done.add(json.loads(raw)["custom_id"])
        except (ValueError, KeyError, TypeError):
            continue
    return done


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
    returns how many lines failed in this run."""
    identity = file_identity(source)
    seen = finished_ids(output)  # custom_ids written (and, below, those running): each is one line, once
    with source.open("rb") as stream:
        total = sum(1 for raw in stream if raw.strip())
    progress = Progress(total, done=len(seen))
    running: dict[int, Line] = {}  # by submit_many's index: only the lines in flight are held
    indexes = itertools.count()

    def requests(sink: TextIO) -> Iterator[dict[str, Any]]:
        with source.open(encoding="utf-8", errors="replace") as stream:
            for number, text in enumerate(stream, 1):
                if not text.strip():
                    continue
                line = parse_line(number, text, identity)
                if line.custom_id in seen:
                    continue  # already written, or a duplicate custom_id (the first one is the line)
                seen.add(line.custom_id)
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
