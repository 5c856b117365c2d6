"""The commands about requests: `submit`, `attach`, `cancel` and `batch`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from client.batch import run_batch
from client.cli.context import Context
from client.cli.exits import Exit, NotFound
from client.cli.output import cancel_on_interrupt, follow, note, warn
from client.cli.parser import STALE_AFTER_S
from client.sync import Job


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """`submit`'s sampling arguments from the flags (None: the wire default)."""
    names = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed")
    return {name: getattr(args, name) for name in names}


def warn_without_workers(context: Context) -> None:
    """Says at once that nothing will answer, instead of a silent wait until the timeout."""
    if context.admin.live_workers(context.queue, STALE_AFTER_S):
        return
    waits = "as long as it takes" if context.args.timeout is None else f"--timeout ({context.args.timeout:g} s)"
    warn(
        f"no live worker on queue {context.queue!r} (no heartbeat in the last {STALE_AFTER_S:g} s): the request "
        f"stays queued until one starts; this command waits {waits}"
    )


def unknown(context: Context, request_id: str) -> NotFound:
    return NotFound(
        f"no request {request_id!r} on queue {context.queue!r}: never submitted there (--queue names another), "
        "or its results expired"
    )


def submit(context: Context) -> Exit:
    args = context.args
    job = context.client.submit(args.prompt, **sampling(args), deadline=args.deadline, priority=args.priority)
    with cancel_on_interrupt(job):  # Ctrl-C from here on cancels it, as it does while following it
        note(f"request {job.id}")
        warn_without_workers(context)
    return follow(job, args.timeout, as_json=args.json, at_end=args.no_stream)


def attach(context: Context) -> Exit:
    """Follows a request submitted elsewhere from its first token; an id the queue never saw fails at once."""
    args = context.args
    if not context.admin.request_state(context.queue, args.request_id).known:
        raise unknown(context, args.request_id)
    job = Job.attach(context.client, args.request_id)
    return follow(job, args.timeout, as_json=args.json, at_end=args.no_stream)


def cancel(context: Context) -> Exit:
    request_id = context.args.request_id
    state = context.admin.request_state(context.queue, request_id)
    if not state.known:
        raise unknown(context, request_id)
    if state.ended is not None:
        print(f"request {request_id} already ended ({state.ended}): nothing to cancel")
        return Exit.OK
    Job.attach(context.client, request_id).cancel()
    print(f"cancel sent for {request_id}")
    return Exit.OK


def batch(context: Context) -> Exit:
    args = context.args
    problem = _batch_paths_problem(args.input, args.output)
    if problem is not None:
        raise ValueError(problem)  # a usage error (`Exit.USAGE`)
    failed = run_batch(
        context.client, args.input, args.output, window=args.window, timeout=args.timeout, priority=args.priority
    )
    return Exit.FAILED if failed else Exit.OK


def _batch_paths_problem(source: Path, output: Path) -> str | None:
    if not source.is_file():
        return f"no such input file: {source}"
    if output.is_dir():
        return f"the output {output} is a directory; name a file"
    if output.exists() and output.samefile(source):
        return f"the output {output} is the input file; name another file"
    return None
