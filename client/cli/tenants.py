"""`llmq tenants list | set | unset` and `llmq usage`: the queue's tenants, their weights in fair share, quotas and
usage, for an operator. Reading and writing them is `client.tenants` and `client.usage`; this module only says
what happened."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

from client.cli.context import Context
from client.cli.exits import Exit
from client.cli.output import note
from client.cli.parser import QUOTA_OPTIONS
from client.protocol import LANES
from client.tenants import DEFAULT_WEIGHT, TenantInfo, TenantLimits, Tenants
from client.usage import read_usage


def listing(context: Context) -> Exit:
    tenants = Tenants(context.admin, context.queue).listing()
    if context.args.json:
        print(json.dumps({"queue": context.queue, "tenants": [asdict(tenant) for tenant in tenants]}))
        return Exit.OK
    if not tenants:
        print(f"queue {context.queue}: no tenant has a weight or quotas set, or requests held")
        return Exit.OK
    print(f"queue {context.queue}: {len(tenants)} tenant{'s' * (len(tenants) != 1)}")
    width = max(len(tenant.tenant) for tenant in tenants)
    lanes = "  ".join(f"{lane + ' held':>16}" for lane in LANES)
    print(f"  {'tenant':<{width}}  {'weight':>8}  {lanes}  {'running':>8}  quotas")
    for tenant in tenants:
        held = "  ".join(f"{tenant.held[lane]:>16}" for lane in LANES)
        quotas = _quotas(tenant.limits)
        print(f"  {tenant.tenant:<{width}}  {tenant.weight:>8g}  {held}  {tenant.running:>8}  {quotas}")
    return Exit.OK


def _quotas(limits: TenantLimits) -> str:
    given = {name.replace("_", " "): value for name, value in asdict(limits).items() if value is not None}
    return ", ".join(f"{name} {value}" for name, value in given.items()) or "none"


def set_tenant(context: Context) -> Exit:
    args, tenants = context.args, Tenants(context.admin, context.queue)
    changes = {name: getattr(args, name) for name in QUOTA_OPTIONS if getattr(args, name) is not None}
    if args.weight is None and not changes:
        raise ValueError("give --weight or a quota (--max-queued, --max-queued-tokens, ...)")  # a usage error
    if args.weight is not None:
        tenants.set_weight(args.tenant, args.weight)
    if changes:
        limits = replace(tenants.limits(args.tenant), **{name: value or None for name, value in changes.items()})
        tenants.set_limits(args.tenant, limits)
    listed = (one for one in tenants.listing() if one.tenant == args.tenant)
    info = next(listed, TenantInfo(args.tenant, DEFAULT_WEIGHT))  # not listed: every quota given was 0
    print(f"tenant {args.tenant} of queue {context.queue}: weight {info.weight:g}, quotas: {_quotas(info.limits)}")
    return Exit.OK


def unset_tenant(context: Context) -> Exit:
    args, tenants = context.args, Tenants(context.admin, context.queue)
    had_limits = not tenants.limits(args.tenant).unlimited
    tenants.set_limits(args.tenant, TenantLimits())
    if not tenants.unset_weight(args.tenant) and not had_limits:
        note(f"tenant {args.tenant} had no weight or quotas set")
    print(f"tenant {args.tenant} of queue {context.queue}: weight 1 (the default), no quotas")
    return Exit.OK


def usage(context: Context) -> Exit:
    args = context.args
    found = read_usage(context.admin, context.queue, args.since, args.tenant)
    hours = f"the last {args.since / 3600:g} h (whole hours)"
    if args.json:
        rows = [{**asdict(one), "total_requests": one.total_requests} for one in found]
        print(json.dumps({"queue": context.queue, "since_s": args.since, "tenants": rows}))
        return Exit.OK
    if not found:
        print(f"queue {context.queue}: no usage in {hours}")
        return Exit.OK
    print(f"queue {context.queue}, {hours}:")
    width = max(len(one.tenant) for one in found)
    print(f"  {'tenant':<{width}}  {'requests':>9}  {'prompt tok':>11}  {'generated':>11}  {'wait s':>9}  {'gen s':>9}")
    for one in found:
        print(
            f"  {one.tenant:<{width}}  {one.total_requests:>9}  {one.prompt_tokens:>11}  {one.generated_tokens:>11}"
            f"  {one.queue_wait_s:>9.1f}  {one.generation_s:>9.1f}"
        )
        outcomes = ", ".join(f"{outcome} {count}" for outcome, count in sorted(one.requests.items()))
        print(f"  {'':<{width}}  {outcomes}")
    return Exit.OK
