"""`llmq tenants list | set | unset` and `llmq usage`: the queue's tenants, their weights in fair share and their
usage, for an operator. Reading and writing them is `client.tenants` and `client.usage`; this module only says
what happened."""

from __future__ import annotations

import json
from dataclasses import asdict

from client.cli.context import Context
from client.cli.exits import Exit
from client.cli.output import note
from client.protocol import LANES
from client.tenants import Tenants
from client.usage import read_usage


def listing(context: Context) -> Exit:
    tenants = Tenants(context.admin, context.queue).listing()
    if context.args.json:
        print(json.dumps({"queue": context.queue, "tenants": [asdict(tenant) for tenant in tenants]}))
        return Exit.OK
    if not tenants:
        print(f"queue {context.queue}: no tenant has a weight set or requests held")
        return Exit.OK
    print(f"queue {context.queue}: {len(tenants)} tenant{'s' * (len(tenants) != 1)}")
    width = max(len(tenant.tenant) for tenant in tenants)
    print(f"  {'tenant':<{width}}  {'weight':>8}  " + "  ".join(f"{lane + ' held':>16}" for lane in LANES))
    for tenant in tenants:
        held = "  ".join(f"{tenant.held[lane]:>16}" for lane in LANES)
        print(f"  {tenant.tenant:<{width}}  {tenant.weight:>8g}  {held}")
    return Exit.OK


def set_weight(context: Context) -> Exit:
    args = context.args
    Tenants(context.admin, context.queue).set_weight(args.tenant, args.weight)
    print(f"tenant {args.tenant} of queue {context.queue}: weight {args.weight:g}")
    return Exit.OK


def unset_weight(context: Context) -> Exit:
    args = context.args
    if not Tenants(context.admin, context.queue).unset_weight(args.tenant):
        note(f"tenant {args.tenant} had no weight set")
    print(f"tenant {args.tenant} of queue {context.queue}: weight 1 (the default)")
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
