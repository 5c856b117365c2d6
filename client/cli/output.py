"""How `llmq` writes: the generated text on stdout, as it arrives, and everything about it on stderr, so a pipe
(`llmq submit ... > answer.txt`) gets only the answer."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from client._core import Result
from client.cli.exits import Exit
from client.errors import Cancelled
from client.sync import Job


def note(message: str) -> None:
    print(f"llmq: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    print(f"llmq: warning: {message}", file=sys.stderr, flush=True)


@contextmanager
def cancel_on_interrupt(job: Job) -> Iterator[None]:
    """Ctrl-C while following `job` cancels it, then ends the command (`Exit.INTERRUPTED`, from `main`)."""
    try:
        yield
    except KeyboardInterrupt:
        job.cancel()
        note(f"cancelled {job.id}")
        raise


def stream(job: Job, timeout: float | None) -> Result:
    """Writes the output as it arrives, then a newline (after partial output too, if the stream fails); returns
    the result, a cancelled one included."""
    wrote = False
    try:
        for delta in job.stream(timeout):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            wrote = wrote or bool(delta.text)
    except Exception:
        if wrote:
            sys.stdout.write("\n")
        raise
    sys.stdout.write("\n")
    sys.stdout.flush()
    return whole(job, timeout)


def whole(job: Job, timeout: float | None) -> Result:
    """The complete result (read to its end if not yet), a cancelled one included."""
    try:
        return job.result(timeout)
    except Cancelled as cancelled:
        result: Result = cancelled.result
        return result


def ended(result: Result) -> Exit:
    """`Exit.CANCELLED`, said on stderr, for a cancelled result; else `Exit.OK`."""
    if result.finish_reason == "cancelled":
        note(f"request {result.request_id} was cancelled after {len(result.token_ids)} tokens")
        return Exit.CANCELLED
    return Exit.OK


def follow(job: Job, timeout: float | None, *, as_json: bool, at_end: bool) -> Exit:
    """A job's output: streamed, or once complete (`at_end`), as text or one JSON object (`as_json`)."""
    with cancel_on_interrupt(job):
        if not (as_json or at_end):
            return ended(stream(job, timeout))
        result = whole(job, timeout)
    print(json.dumps(result.as_dict()) if as_json else result.text)
    return ended(result)
