"""`llmq`'s command line: plain argparse, no extra dependencies.

The connection options (`--url`, `--queue`, `--prefix`, `--partitions`) are accepted before the subcommand and
after it: the top parser holds their defaults, and each subcommand's copy defaults to `SUPPRESS`, so it sets them
only when given there (otherwise a subcommand would overwrite with its default what was given before it).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client import __version__
from client._core import DEFAULT_URL, MAX_FAILOVER_TIMEOUT_S
from client.admin import MAX_SCANNED_KEYS
from client.failover import FAILOVER_TIMEOUT_S
from client.protocol import DEFAULT_PREFIX, DEFAULT_TENANT, LANES, SamplingParams

DEFAULT_TIMEOUT_S = 600.0  # how long submit, attach and each chat answer wait for a result, unless told
STALE_AFTER_S = 15.0  # seconds without a heartbeat after which a worker counts as gone


def seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return value


SPAN_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def span(text: str) -> float:
    """A span of time: seconds, or a number with a unit, `90m`, `24h`, `7d` (argparse type)."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in SPAN_UNITS else (text, "s")
    try:
        return seconds(number) * SPAN_UNITS[unit]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a span such as 3600, 90m, 24h or 7d, not {text!r}") from None


def window(text: str) -> float:
    """Seconds a call rides out a Redis failover: 0 (fail at once) up to `MAX_FAILOVER_TIMEOUT_S` (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_FAILOVER_TIMEOUT_S:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"must be seconds in [0, {MAX_FAILOVER_TIMEOUT_S:g}], not {text!r}")
    return value


def timeout(text: str) -> float | None:
    """Seconds to wait for a result; 0 waits as long as it takes (None)."""
    try:
        if float(text) == 0:
            return None
    except ValueError:
        pass
    return seconds(text)


MAX_COUNT = 2**63 - 1  # Redis's largest COUNT: anything beyond is no count it could serve


def quota(text: str) -> int:
    """A tenant's quota: a whole number in [0, 2**53], 0 for none (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 2**53:
        raise argparse.ArgumentTypeError(f"must be a whole number in [0, 2**53] (0: none), not {text!r}")
    return value


def count(text: str) -> int:
    """A whole number in [1, 2**63 - 1] (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be a whole number in [1, {MAX_COUNT}], not {text!r}")
    return value


def submitting_tenant(args: argparse.Namespace) -> str:
    """The tenant of the requests a command submits: `--tenant`, else $LLMQ_TENANT, else the default tenant."""
    tenant: str = args.tenant if args.tenant is not None else os.environ.get("LLMQ_TENANT", DEFAULT_TENANT)
    return tenant


def _connection(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The connection options, on the top parser (`defaults`) or on a subcommand (unset unless given)."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    group = parser.add_argument_group("connection (before or after the subcommand)")
    group.add_argument(
        "--url",
        default=default(os.environ.get("LLMQ_REDIS_URL", DEFAULT_URL)),
        help=f"Redis URL (default: $LLMQ_REDIS_URL, else {DEFAULT_URL})",
    )
    group.add_argument("--queue", default=default("default"), help="queue name (default: default)")
    group.add_argument("--prefix", default=default(DEFAULT_PREFIX), help=f"key prefix (default: {DEFAULT_PREFIX})")
    group.add_argument(
        "--partitions",
        type=int,
        default=default(os.environ.get("LLMQ_QUEUE_PARTITIONS", "1")),  # a string default goes through `type` too
        help="the queue's partitions, as the workers' LLMQ_QUEUE_PARTITIONS (default: $LLMQ_QUEUE_PARTITIONS, else 1)",
    )
    group.add_argument(
        "--failover-timeout",
        type=window,
        default=default(os.environ.get("LLMQ_FAILOVER_TIMEOUT_S", str(FAILOVER_TIMEOUT_S))),
        help="seconds a command rides out a Redis failover or outage before it exits 4 (default:"
        f" $LLMQ_FAILOVER_TIMEOUT_S, else {FAILOVER_TIMEOUT_S:g}; 0: fail at once)",
    )
    group.add_argument(
        "--tenant",
        default=default(None),
        help=f"who the requests submitted belong to, for fair share (default: $LLMQ_TENANT, else {DEFAULT_TENANT});"
        " for `usage`, the tenant to show (default: all)",
    )


def _sampling(parser: argparse.ArgumentParser) -> None:
    defaults = SamplingParams()
    parser.add_argument("--max-new-tokens", type=int, help=f"default {defaults.max_new_tokens}")
    parser.add_argument("--temperature", type=float, help=f"0 = greedy (default {defaults.temperature})")
    parser.add_argument("--top-p", type=float, help=f"default {defaults.top_p}")
    parser.add_argument("--top-k", type=int, help=f"0 = off (default {defaults.top_k})")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=None)


def _waiting(parser: argparse.ArgumentParser, *, whole: bool = True) -> None:
    parser.add_argument(
        "--timeout",
        type=timeout,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for the result, 0 = no limit (default {DEFAULT_TIMEOUT_S:.0f}); then exit 3",
    )
    if whole:
        parser.add_argument("--no-stream", action="store_true", help="print the text once it is complete")
        parser.add_argument("--json", action="store_true", help="print the final result as one JSON object")


class _Commands:
    """Adds subcommands that share the connection options; `run` is the function each one calls."""

    def __init__(self, parser: argparse.ArgumentParser, dest: str) -> None:
        self._sub = parser.add_subparsers(dest=dest, required=True, metavar="COMMAND")

    def add(self, name: str, run: Callable[..., Any] | None, help: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A subcommand; `run` None for one whose own subcommands set it."""
        command = self._sub.add_parser(name, help=help, description=kwargs.pop("description", help), **kwargs)
        _connection(command, defaults=False)
        if run is not None:
            command.set_defaults(run=run)
        return command


def build(handlers: dict[str, Callable[..., Any]]) -> argparse.ArgumentParser:
    """The parser; `handlers` maps each command (`dead list` for the nested ones) to the function it runs."""
    parser = argparse.ArgumentParser(prog="llmq", description="Queue-fed LLM generation: the client side.")
    parser.add_argument("--version", action="version", version=f"llmq-redis {__version__}")
    _connection(parser, defaults=True)
    commands = _Commands(parser, "command")

    submit = commands.add("submit", handlers["submit"], "generate from a prompt")
    submit.add_argument("prompt")
    _sampling(submit)
    submit.add_argument("--deadline", type=float, default=None, help="seconds from now")
    submit.add_argument("--priority", choices=LANES, default="default", help="lane (default: default)")
    _waiting(submit)

    attach = commands.add("attach", handlers["attach"], "stream an existing request's output, by id")
    attach.add_argument("request_id")
    _waiting(attach)

    chat = commands.add(
        "chat",
        handlers["chat"],
        "a conversation: one line of stdin per turn, answers streamed, history kept",
        description="Reads a line from stdin, sends the conversation so far as chat messages (the worker applies "
        "the model's chat template, as for the gateway's /v1/chat/completions), streams the answer and keeps it "
        "in the history. Ends at end of input (Ctrl-D).",
    )
    chat.add_argument("--system", default=None, help="a system message to open the conversation")
    _sampling(chat)
    chat.add_argument("--priority", choices=LANES, default="interactive", help="lane (default: interactive)")
    _waiting(chat, whole=False)

    status = commands.add("status", handlers["status"], "queue depth, lag, dead letters, workers")
    status.add_argument("--stale-after", type=seconds, default=STALE_AFTER_S, help="seconds without heartbeat = gone")
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    status.add_argument("--watch", type=seconds, nargs="?", const=2.0, metavar="SECONDS", help="refresh in place")

    queues = commands.add("queues", handlers["queues"], "every queue on the Redis: depth, dead letters, live workers")
    queues.add_argument("--stale-after", type=seconds, default=STALE_AFTER_S, help="seconds without heartbeat = gone")
    queues.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    queues.add_argument(
        "--max-keys", type=count, default=MAX_SCANNED_KEYS, help="stop scanning after this many queue keys"
    )

    cancel = commands.add("cancel", handlers["cancel"], "cancel a request by id")
    cancel.add_argument("request_id")

    _dead(commands.add("dead", None, "list, show, replay or drop the queue's dead letters"), handlers)
    _tenants(
        commands.add("tenants", None, "list the queue's tenants, or set or unset their weights and quotas"), handlers
    )

    usage = commands.add("usage", handlers["usage"], "each tenant's requests, tokens and seconds, hour by hour summed")
    usage.add_argument("--since", type=span, default=86400.0, help="how far back: 3600, 90m, 24h, 7d (default 24h)")
    usage.add_argument("--json", action="store_true", help="one JSON object, for scripts")

    batch = commands.add(
        "batch",
        handlers["batch"],
        "run a JSONL file of OpenAI Batch API requests; rerun the same command to resume",
        description="Runs each line of INPUT (OpenAI Batch API format: custom_id, method, url = "
        "/v1/chat/completions or /v1/completions, body) through the queue and appends one OpenAI Batch output "
        "line per input line to OUTPUT, as lines complete. Resumable and exactly once: rerunning the same "
        "command skips the lines already in OUTPUT and re-attaches to those still running.",
    )
    batch.add_argument("input", type=Path, metavar="INPUT.jsonl")
    batch.add_argument("-o", "--output", type=Path, required=True, metavar="OUTPUT.jsonl")
    batch.add_argument("--window", type=int, default=256, help="requests in flight at once (default: 256)")
    batch.add_argument("--timeout", type=seconds, default=None, help="seconds to wait for each result")
    batch.add_argument("--priority", choices=LANES, default="batch", help="lane, unless a line names a service_tier")
    return parser


def _tenants(tenants: argparse.ArgumentParser, handlers: dict[str, Callable[..., Any]]) -> None:
    commands = _Commands(tenants, "action")
    listing = commands.add("list", handlers["tenants list"], "each tenant's weight, quotas, requests held and running")
    listing.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    given = commands.add(
        "set",
        handlers["tenants set"],
        "set a tenant's weight in fair share (default 1) or quotas (default none); what is not given is kept",
    )
    given.add_argument("tenant", metavar="TENANT")
    given.add_argument("--weight", type=float, help="its share against others' while both have work (> 0)")
    for name, meaning in QUOTA_OPTIONS.items():
        given.add_argument(
            f"--{name.replace('_', '-')}", dest=name, type=quota, metavar="N", help=f"{meaning}; 0: none"
        )
    unset = commands.add("unset", handlers["tenants unset"], "give a tenant the default weight again, and no quotas")
    unset.add_argument("tenant", metavar="TENANT")


QUOTA_OPTIONS = {  # `client.tenants.TenantLimits`' fields
    "max_queued": "requests held for fair share at most (more: TenantQuotaExceeded)",
    "max_queued_tokens": "their estimated tokens at most (prompt + max_new_tokens)",
    "max_running": "requests running at once at most",
    "tokens_per_minute": "a rate reserved ahead of other tenants; past it, only idle capacity",
}


def _dead(dead: argparse.ArgumentParser, handlers: dict[str, Callable[..., Any]]) -> None:
    commands = _Commands(dead, "action")
    listing = commands.add("list", handlers["dead list"], "the oldest dead letters, with their reasons")
    listing.add_argument("--limit", type=count, default=20, help="at most this many (default: 20)")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")

    show = commands.add("show", handlers["dead show"], "one dead letter in full, its request included")
    show.add_argument("id", metavar="ID", help="its id in `llmq dead list`, or its request's id")
    show.add_argument("--json", action="store_true", help="one JSON object")

    for name, verb in (("replay", "put back on the queue under its request id"), ("drop", "delete")):
        action = commands.add(name, handlers[f"dead {name}"], f"{verb}: one dead letter, or all of them")
        which = action.add_mutually_exclusive_group(required=True)
        which.add_argument("id", metavar="ID", nargs="?", help="its id in `llmq dead list`, or its request's id")
        which.add_argument("--all", action="store_true", help="every dead letter of the queue, oldest first")
        action.add_argument("--limit", type=count, default=None, help="with --all: at most this many")
        if name == "replay":
            action.add_argument("--priority", choices=LANES, default="default", help="lane (default: default)")
