"""`llmq`'s entry point: parse, connect, run one command, and turn whatever ended it into an exit code and one
line on stderr (`client.cli.exits`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import closing
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from client.admin import Admin
from client.cli import dead, tenants
from client.cli.chat import chat
from client.cli.context import Context
from client.cli.exits import Exit, failure
from client.cli.generate import attach, batch, cancel, submit
from client.cli.parser import build, submitting_tenant
from client.cli.status import queues, status
from client.errors import LLMQError
from client.sync import Client

HANDLERS: dict[str, Callable[[Context], Exit]] = {
    "submit": submit,
    "attach": attach,
    "chat": chat,
    "status": status,
    "queues": queues,
    "cancel": cancel,
    "dead list": dead.listing,
    "dead show": dead.show,
    "dead replay": dead.replay,
    "dead drop": dead.drop,
    "batch": batch,
    "tenants list": tenants.listing,
    "tenants set": tenants.set_tenant,
    "tenants unset": tenants.unset_tenant,
    "usage": tenants.usage,
}


def main(argv: list[str] | None = None) -> int:
    args = build(HANDLERS).parse_args(argv)
    options: dict[str, Any] = {
        "prefix": args.prefix,
        "partitions": args.partitions,
        "failover_timeout": args.failover_timeout,
    }
    try:
        with (
            Client(args.url, queue=args.queue, tenant=submitting_tenant(args), **options) as client,
            closing(Admin(args.url, **options)) as admin,
        ):
            return int(args.run(Context(args, client, admin)))
    except KeyboardInterrupt:  # the job followed, if any, was cancelled on the way out
        return Exit.INTERRUPTED
    except (LLMQError, RedisError, RedisClusterException, ValueError, TypeError) as exc:
        code, message = failure(exc, args.url)  # the cluster one: a cluster URL that reaches no node
        print(f"llmq: error: {message}", file=sys.stderr)
        return code
    except BrokenPipeError:  # whoever read our output left (`| head`): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor fail again flushing at exit
        return Exit.FAILED
