"""`llmq chat`: a conversation in the terminal. Each turn sends the whole history as chat messages, the request
shape the gateway's /v1/chat/completions sends (`client.openai_format`), so the worker applies the model's own
chat template; the answer streams to stdout and joins the history."""

from __future__ import annotations

import sys

from client.cli.context import Context
from client.cli.exits import Exit
from client.cli.generate import sampling, warn_without_workers
from client.cli.output import cancel_on_interrupt, ended, stream


def chat(context: Context) -> Exit:
    """Turns until end of input (Ctrl-D); an answer that fails, times out or is cancelled ends the chat with its
    exit code, as the history could not go on without it."""
    args = context.args
    history: list[dict[str, str]] = [] if args.system is None else [{"role": "system", "content": args.system}]
    warn_without_workers(context)
    prompt = sys.stdin.isatty()  # "> " only for a person: piped input gets the answers alone
    while (line := _read_line(prompt)) is not None:
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        job = context.client.submit(messages=list(history), **sampling(args), priority=args.priority)
        with cancel_on_interrupt(job):
            result = stream(job, args.timeout)
        code = ended(result)
        if code != Exit.OK:
            return code
        history.append({"role": "assistant", "content": result.text})
    return Exit.OK


def _read_line(prompt: bool) -> str | None:
    """The next line of stdin without its line ending; None at end of input."""
    if prompt:
        sys.stderr.write("> ")
        sys.stderr.flush()
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\r\n")
