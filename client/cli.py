"""`llmq`: submit a prompt, look at a queue, cancel a request. Plain argparse, no extra dependencies."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from redis.exceptions import RedisClusterException, RedisError

from client._core import DEFAULT_URL
from client.batch import run_batch
from client.connection import explain, redact_url, secrets_of
from client.errors import Cancelled, LLMQError
from client.protocol import DEFAULT_PREFIX, LANES, SamplingParams, ms_now
from client.store import QueueStatus
from client.sync import Client, Job


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text!r}")
    return seconds


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("LLMQ_REDIS_URL", DEFAULT_URL),
        help="Redis URL (default: $LLMQ_REDIS_URL, else %(default)s)",
    )
    common.add_argument("--queue", default="default", help="queue name (default: %(default)s)")
    common.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix (default: %(default)s)")
    parser = argparse.ArgumentParser(prog="llmq", description="Queue-fed LLM generation: the client side.")
    commands = parser.add_subparsers(dest="command", required=True)

    submit = commands.add_parser("submit", parents=[common], help="generate from a prompt")
    submit.add_argument("prompt")
    defaults = SamplingParams()
    submit.add_argument("--max-new-tokens", type=int, help=f"default {defaults.max_new_tokens}")
    submit.add_argument("--temperature", type=float, help=f"0 = greedy (default {defaults.temperature})")
    submit.add_argument("--top-p", type=float, help=f"default {defaults.top_p}")
    submit.add_argument("--top-k", type=int, help=f"0 = off (default {defaults.top_k})")
    submit.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--deadline", type=float, default=None, help="seconds from now")
    submit.add_argument("--priority", choices=LANES, default="default", help="lane (default: %(default)s)")
    submit.add_argument("--timeout", type=_seconds, default=None, help="seconds to wait for the result")
    submit.add_argument("--no-stream", action="store_true", help="print the text once it is complete")
    submit.add_argument("--json", action="store_true", help="print the final result as one JSON object")

    status = commands.add_parser("status", parents=[common], help="queue depth, lag, dead letters, workers")
    status.add_argument("--stale-after", type=_seconds, default=15.0, help="seconds without heartbeat = gone")
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    status.add_argument("--watch", type=_seconds, nargs="?", const=2.0, metavar="SECONDS", help="refresh in place")

    cancel = commands.add_parser("cancel", parents=[common], help="cancel a request by id")
    cancel.add_argument("request_id")

    batch = commands.add_parser(
        "batch",
        parents=[common],
        help="run a JSONL file of OpenAI Batch API requests; rerun the same command to resume",
        description="Runs each line of INPUT (OpenAI Batch API format: custom_id, method, url = "
        "/v1/chat/completions or /v1/completions, body) through the queue and appends one OpenAI Batch output "
        "line per input line to OUTPUT, as lines complete. Resumable and exactly once: rerunning the same "
        "command skips the lines already in OUTPUT and re-attaches to those still running.",
    )
    batch.add_argument("input", type=Path, metavar="INPUT.jsonl")
    batch.add_argument("-o", "--output", type=Path, required=True, metavar="OUTPUT.jsonl")
    batch.add_argument("--window", type=int, default=256, help="requests in flight at once (default: %(default)s)")
    batch.add_argument("--timeout", type=_seconds, default=None, help="seconds to wait for each result")
    batch.add_argument(
        "--priority", choices=LANES, default="batch", help="lane, unless a line names a service_tier (%(default)s)"
    )
    return parser


def _submit(client: Client, args: argparse.Namespace) -> int:
    job = client.submit(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        seed=args.seed,
        deadline=args.deadline,
        priority=args.priority,
    )
    print(f"llmq: request {job.id}", file=sys.stderr)
    try:
        if args.json or args.no_stream:
            return _print_result(job, args)
        for delta in job.stream(args.timeout):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except KeyboardInterrupt:
        job.cancel()
        print(f"llmq: cancelled {job.id}", file=sys.stderr)
        return 130
    if job.finish_reason == "cancelled":
        print(f"llmq: request {job.id} was cancelled", file=sys.stderr)
        return 1
    return 0


def _print_result(job: Job, args: argparse.Namespace) -> int:
    try:
        result, code = job.result(args.timeout), 0
    except Cancelled as exc:
        result, code = exc.result, 1
        print(f"llmq: {exc}", file=sys.stderr)
    print(json.dumps(result.as_dict()) if args.json else result.text)
    return code


def _format_status(status: QueueStatus, previous: QueueStatus | None = None) -> str:
    """The status as text; with the previous reading, tokens/s is the rate since then, else since start."""

    def unknown(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:.0f}{unit}" if isinstance(value, float) else f"{value}{unit}"

    lines = [
        f"queue {status.queue}: depth {status.depth}, pending {unknown(status.pending)}, "
        f"lag {unknown(status.lag)}, oldest pending {unknown(status.oldest_pending_age_s, ' s')}, "
        f"dead letters {status.dead}",
        *(
            f"  lane {lane.lane}: depth {lane.depth}, pending {unknown(lane.pending)}, lag {unknown(lane.lag)}, "
            f"oldest pending {unknown(lane.oldest_pending_age_s, ' s')}, backlog ~{lane.backlog_tokens} tokens"
            + ("" if lane.backlog_seconds is None else f" (~{lane.backlog_seconds:.0f} s at the fleet's rate)")
            for lane in status.lanes
        ),
        f"live workers: {len(status.workers)}",
    ]
    now = ms_now()
    before = {w.id: w for w in previous.workers} if previous else {}
    for w in status.workers:
        kv = f"{w.kv_used_blocks}/{w.kv_total_blocks}" + (
            f" ({100 * w.kv_used_blocks / w.kv_total_blocks:.0f}%)" if w.kv_total_blocks else ""
        )
        last = before.get(w.id)
        since = last if last is not None and last.heartbeat < w.heartbeat else None
        tokens = w.tokens_generated - (since.tokens_generated if since else 0)
        seconds = (w.heartbeat - (since.heartbeat if since else w.started)) / 1000
        rate = tokens / seconds if seconds > 0 else 0.0
        lines.append(
            f"  {w.id}  running {w.running}  waiting {w.waiting}  kv {kv}  {rate:.1f} tok/s  "
            f"heartbeat {(now - w.heartbeat) / 1000:.1f} s ago  ({w.model} on {w.host})"
        )
    return "\n".join(lines)


def _status(client: Client, args: argparse.Namespace) -> int:
    if args.watch is None:
        status = client.status(stale_after_s=args.stale_after)
        print(json.dumps(status.as_dict()) if args.json else _format_status(status))
        return 0
    previous = None
    try:
        while True:  # Ctrl-C ends it
            status = client.status(stale_after_s=args.stale_after)
            text = json.dumps(status.as_dict()) if args.json else _format_status(status, previous)
            print(text if args.json else f"\x1b[H\x1b[2J{text}", flush=True)  # clear and redraw in place
            previous = status
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _cancel(client: Client, args: argparse.Namespace) -> int:
    Job.attach(client, args.request_id).cancel()
    print(f"cancel sent for {args.request_id}")
    return 0


def _batch(client: Client, args: argparse.Namespace) -> int:
    problem = _batch_paths_problem(args.input, args.output)
    if problem is not None:
        print(f"llmq: error: {problem}", file=sys.stderr)
        return 2
    failed = run_batch(
        client, args.input, args.output, window=args.window, timeout=args.timeout, priority=args.priority
    )
    return 1 if failed else 0


def _batch_paths_problem(source: Path, output: Path) -> str | None:
    if not source.is_file():
        return f"no such input file: {source}"
    if output.is_dir():
        return f"the output {output} is a directory; name a file"
    if output.exists() and output.samefile(source):
        return f"the output {output} is the input file; name another file"
    return None


def _scrub(message: str, url: str) -> str:
    """Never print a password, even if a library echoes the URL."""
    for secret in secrets_of(url):
        message = message.replace(secret, "***")
    return message


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run = {"submit": _submit, "status": _status, "cancel": _cancel, "batch": _batch}[args.command]
    try:
        with Client(args.url, queue=args.queue, prefix=args.prefix) as client:
            return run(client, args)
    except (RedisError, RedisClusterException) as exc:  # the latter: a cluster URL that reaches no node
        print(f"llmq: error: {_scrub(explain(exc, args.url), args.url)} ({redact_url(args.url)})", file=sys.stderr)
    except (LLMQError, ValueError, TypeError) as exc:
        print(f"llmq: error: {_scrub(str(exc), args.url)}", file=sys.stderr)
    except BrokenPipeError:  # whoever read our output left (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor fail again flushing at exit
    return 1


if __name__ == "__main__":
    sys.exit(main())
