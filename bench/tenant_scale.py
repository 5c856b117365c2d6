"""What the read script costs Redis as tenants grow: with N tenants waiting, each with two requests held, a
worker's reads move them to run, and each read's time is Redis's (a script blocks the server while it runs).

    python -m bench.tenant_scale [--tenants 100 1000 10000] [--reads 200]

Three ways, each on a Redis of its own: `plain` (no quotas: the tenant of least virtual time, one look), `quotas`
(one tenant has a running quota, so every move looks past tenants that may not run), `kept` (a slot of two kept
for tenants with nothing running, `LLMQ_IDLE_TENANT_SLOTS`: each read moves one request in fair order and one for
the kept slot). Prints ms per read and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from bench.workload import print_json
from client import AsyncClient
from client.protocol import RequestLimits
from client.scripts import Scripts
from client.store import Keys
from client.tenants import TenantLimits
from worker.embedded_redis import RedisServer
from worker.intake import Intake

KEYS = Keys("scale")
MODES = ("plain", "quotas", "kept")


async def ms_per_read(root: Path, tenants: int, mode: str, reads: int) -> tuple[float, int]:
    """Milliseconds per read, and the requests the reads moved."""
    server = RedisServer(root / f"redis-{mode}-{tenants}").start()
    try:
        async with aioredis.Redis.from_url(server.url) as conn:
            await Intake(conn, KEYS, "w", RequestLimits(), dead_maxlen=100).ensure_group()
            scripts = Scripts.register(conn)
            await scripts.read.run(KEYS, "w", 1, [("default", 1)], ["default"])  # clients hold tenants' requests
            async with AsyncClient(server.url, queue=KEYS.queue, max_queue_len=0) as client:
                for i in range(tenants):
                    for request in ("r", "s"):
                        await client.submit(
                            input_ids=[5] * 6, max_new_tokens=4, tenant=f"t{i}", request_id=f"{request}{i}"
                        )
            if mode == "quotas":
                await conn.hset(KEYS.tenant_limits, "t0", TenantLimits(max_running=1).pack())
            keep = 1 if mode == "kept" else 0
            moved = 0
            start = time.perf_counter()
            for _ in range(reads):
                reply = await scripts.read.run(KEYS, "w", 1 + keep, [("default", 1 + keep)], ["default"], keep=keep)
                moved += len(reply.entries)
            return 1000 * (time.perf_counter() - start) / reads, moved
    finally:
        server.stop()


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="llmq-bench-tenant-scale-"))
    figures: dict[str, object] = {"reads": args.reads}
    for tenants in args.tenants:
        for mode in MODES:
            ms, moved = await ms_per_read(root, tenants, mode, args.reads)
            print(f"{tenants:>6} tenants waiting, {mode:>6}: {ms:.2f} ms per read ({moved} moved)", flush=True)
            figures[f"{mode}_ms_per_read_{tenants}"] = round(ms, 3)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--reads", type=int, default=200, help="reads timed per way")
    print_json(asyncio.run(main_async(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
