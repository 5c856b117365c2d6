"""The commands that look at queues: `status` (one queue, once or redrawn) and `queues` (every queue found)."""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import asdict

from client.cli.context import Context
from client.cli.exits import Exit
from client.cli.output import warn
from client.protocol import PrefixCacheInfo, ms_now
from client.store import QueueStatus
from client.tenants import TenantInfo, Tenants


def format_status(status: QueueStatus, previous: QueueStatus | None = None) -> str:
    """The status as text; with the previous reading, tokens/s is the rate since then, else since start."""

    def unknown(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:.0f}{unit}" if isinstance(value, float) else f"{value}{unit}"

    lines = [
        f"queue {status.queue}: depth {status.depth}, pending {unknown(status.pending)}, "
        f"lag {unknown(status.lag)}, oldest pending {unknown(status.oldest_pending_age_s, ' s')}, "
        f"dead letters {status.dead}",
        *(
            f"  partition {part.partition}: depth {part.depth}, pending {unknown(part.pending)}, "
            f"lag {unknown(part.lag)}, dead letters {part.dead}"
            for part in status.partitions
        ),
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
            f"{prefix_cache(status.prefix_caches.get(w.id))}"
            f"heartbeat {(now - w.heartbeat) / 1000:.1f} s ago  ({w.model} on {w.host})"
        )
    return "\n".join(lines)


def prefix_cache(cache: PrefixCacheInfo | None) -> str:
    """A worker's prefix-cache hit rate in prompt tokens since it started, where it caches."""
    if cache is None:
        return ""
    rate = f"{100 * cache.hits / cache.queries:.0f}%" if cache.queries else "-"
    return f"prefix cache {rate} of {cache.queries} prompt tokens  "


def format_tenants(tenants: list[TenantInfo]) -> str:
    """Each tenant's backlog (held for fair share) and share of the requests running, where any has either."""
    busy = [tenant for tenant in tenants if tenant.running or any(tenant.held.values())]
    if not busy:
        return ""
    total = sum(tenant.running for tenant in busy)
    width = max(len(tenant.tenant) for tenant in busy)
    lines = [f"tenants: {len(busy)} with requests held or running"]
    for tenant in busy:
        share = f"{100 * tenant.running / total:.0f}%" if total else "-"
        held = sum(tenant.held.values())
        lines.append(f"  {tenant.tenant:<{width}}  held {held}  running {tenant.running}  share {share}")
    return "\n".join(lines)


def _reading(context: Context, previous: QueueStatus | None) -> tuple[QueueStatus, str]:
    """The status now, and its text (or JSON) with the tenants'."""
    args = context.args
    current = context.client.status(stale_after_s=args.stale_after)
    tenants = Tenants(context.admin, context.queue).listing()
    if args.json:
        return current, json.dumps({**current.as_dict(), "tenants": [asdict(tenant) for tenant in tenants]})
    return current, "\n".join(filter(None, [format_status(current, previous), format_tenants(tenants)]))


def status(context: Context) -> Exit:
    args = context.args
    if args.watch is None:
        print(_reading(context, None)[1])
        return Exit.OK
    previous = None
    # Ctrl-C ends it between two refreshes: a KeyboardInterrupt raised inside redis-py could leave a lock of its
    # connection pool held, and closing the client would then wait on it forever.
    stopped = threading.Event()
    in_main_thread = threading.current_thread() is threading.main_thread()  # the only one that hears signals
    default_handler = signal.signal(signal.SIGINT, lambda *_: stopped.set()) if in_main_thread else None
    try:
        while not stopped.is_set():
            current, text = _reading(context, previous)
            print(text if args.json else f"\x1b[H\x1b[2J{text}", flush=True)  # clear and redraw in place
            previous = current
            pause(stopped, args.watch)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, default_handler)
    return Exit.OK


def pause(stopped: threading.Event, seconds: float) -> None:
    """The wait between two refreshes of `status --watch`; Ctrl-C sets `stopped`, which ends it early."""
    stopped.wait(seconds)


def queues(context: Context) -> Exit:
    """Every queue under the prefix, one line each (or a JSON array), found by a bounded SCAN."""
    args = context.args
    found, truncated, skipped = context.admin.queues(stale_after_s=args.stale_after, max_keys=args.max_keys)
    for problem in skipped:
        warn(problem)
    if truncated:
        warn(f"stopped after {args.max_keys} queue keys (--max-keys): there may be more queues")
    if args.json:
        print(json.dumps([asdict(summary) for summary in found]))
        return Exit.OK
    if not found:
        print(f"no queues under prefix {context.args.prefix!r}")
        return Exit.OK
    width = max(len("QUEUE"), *(len(summary.queue) for summary in found))
    print(f"{'QUEUE':<{width}}  PARTITIONS  DEPTH  DEAD  LIVE WORKERS")
    for s in found:
        print(f"{s.queue:<{width}}  {s.partitions:>10}  {s.depth:>5}  {s.dead:>4}  {s.live_workers:>12}")
    return Exit.OK
