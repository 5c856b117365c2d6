"""A Redis primary killed while requests stream: what reaches the callers, on a real Redis Cluster and on a real
Sentinel set (testing/redis_topologies.py starts both from redis-server on free ports).

    python -m bench.failover [--quick] [--requests 300] [--tokens 200] [--step-ms 10] [--wait-replicas 1]

Two worker processes (the scripted engine of `bench.fabric`: tokens are a pure function of the prompt and the
position, so every output has one right answer) serve `--requests` streamed requests. One second into the run the
primary that holds the queue is killed with SIGKILL: the Cluster promotes its replica, the sentinels promote the
master's. Per topology it reports requests `lost` (accepted, no terminal event within the run's timeout),
`errors` (ended with an error event or a client error), `duplicated` and `gaps` (result-stream entries whose `seq`
repeats or skips tokens, read back raw after the run: the client drops repeats itself), `mismatched` (outputs not
equal to the idle answer), and `recovery_s` (from the kill to the first result entry Redis stamped after it).
`--wait-replicas` (default 1) is `LLMQ_REDIS_WAIT_REPLICAS` of the workers and `wait_replicas` of the client.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from bench.fabric import start_workers
from bench.workload import print_json
from client import AsyncClient
from client.connection import open_async
from client.protocol import ENTRY_FIELD
from client.store import Keys
from testing.redis_topologies import RedisClusterSet, SentinelSet
from testing.scripted_engine import expected_tokens

KILL_AFTER_S = 1.0
KEYS = Keys("default")


async def follow(job: Any, timeout_s: float) -> tuple[str, list[int]]:
    """How the request ended (`ok`, `lost` or the error's class) and its tokens."""
    tokens: list[int] = []
    try:
        async for delta in job.stream(timeout=timeout_s):
            tokens += delta.token_ids
    except TimeoutError:
        return "lost", tokens
    except Exception as error:
        return type(error).__name__, tokens
    return "ok", tokens


async def raw_stream_figures(url: str, ids: list[str], after_ms: int) -> tuple[int, int, float | None]:
    """(duplicated, gaps, recovery_s) from the result streams as Redis holds them."""
    duplicated = gaps = 0
    first_after: int | None = None
    redis = open_async(url)
    try:
        for request_id in ids:
            seen = 0
            for entry_id, fields in await redis.xrange(KEYS.result(request_id)):
                event = msgpack.unpackb(fields[ENTRY_FIELD], raw=False)
                stamped = int(entry_id.split(b"-")[0])
                if stamped > after_ms:
                    first_after = stamped if first_after is None else min(first_after, stamped)
                if event.get("type") != "tokens":
                    continue
                seq, count = event["seq"], len(event["ids"])
                duplicated += max(0, min(seen, seq + count) - seq)
                gaps += int(seq > seen)
                seen = max(seen, seq + count)
    finally:
        await redis.aclose()
    return duplicated, gaps, None if first_after is None else round((first_after - after_ms) / 1000, 2)


async def run(
    url: str,
    kill: Callable[[], Any],
    promoted: Callable[[], Any],
    restore: Callable[[], Any],
    args: argparse.Namespace,
    logs: Path,
) -> dict[str, Any]:
    """`kill()` kills the primary; `promoted()` (in a thread) returns once a replica has taken its place, and
    `restore()` once the killed node, started again as an orchestrator would, is the new primary's replica: with
    one replica per primary, writes that wait for a replica wait for that."""
    os.environ["LLMQ_REDIS_WAIT_REPLICAS"] = str(args.wait_replicas)  # the workers' setting, inherited
    workers = start_workers(url, 2, args.step_ms / 1000, 64, logs)
    try:
        async with AsyncClient(url, max_queue_len=0, wait_replicas=args.wait_replicas) as client:
            while len((await client.status()).workers) < 2:
                await asyncio.sleep(0.2)
            prompts = [[3 + i % 200, 3 + i // 200] for i in range(args.requests)]
            jobs = [await client.submit(input_ids=prompt, max_new_tokens=args.tokens) for prompt in prompts]
            followers = asyncio.gather(*(follow(job, args.timeout_s) for job in jobs))
            await asyncio.sleep(KILL_AFTER_S)
            kill()
            killed_ms = int(time.time() * 1000)
            await asyncio.to_thread(promoted)
            promoted_s = round(time.time() - killed_ms / 1000, 2)
            await asyncio.to_thread(restore)
            restored_s = round(time.time() - killed_ms / 1000, 2)
            outcomes = await followers
            after = await client.submit(input_ids=[5], max_new_tokens=4)
            served_after = (await after.result(timeout=60)).token_ids == expected_tokens([5], 4)
        duplicated, gaps, recovery_s = await raw_stream_figures(url, [job.id for job in jobs], killed_ms)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=60)
    ends = Counter(end for end, _ in outcomes)
    mismatched = sum(
        end == "ok" and tokens != expected_tokens(prompt, args.tokens)
        for (end, tokens), prompt in zip(outcomes, prompts, strict=True)
    )
    errors = sum(count for end, count in ends.items() if end not in ("ok", "lost"))
    return {
        "lost": ends["lost"],
        "errors": errors,
        "error_kinds": {end: count for end, count in ends.items() if end not in ("ok", "lost")},
        "duplicated": duplicated,
        "gaps": gaps,
        "mismatched": mismatched,
        "promotion_s": promoted_s,
        "restored_s": restored_s,
        "recovery_s": recovery_s,
        "served_after": served_after,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="llmq-failover-"))
    figures: dict[str, Any] = {"requests": args.requests, "tokens": args.tokens, "wait_replicas": args.wait_replicas}
    with RedisClusterSet(root / "cluster") as cluster:
        master = cluster.master_for_key(KEYS.requests)
        results = await run(
            cluster.seed_url,
            lambda: cluster.kill_master(master),
            lambda: cluster.wait_for_promotion(master),
            lambda: cluster.restart(master),
            args,
            root,
        )
        figures.update({f"cluster_{key}": value for key, value in results.items()})
        _report("Redis Cluster (3 masters, 3 replicas)", results)
    with SentinelSet(root / "sentinel") as sentinels:
        old = sentinels.master_address()
        results = await run(
            sentinels.url,
            sentinels.kill_master,
            lambda: sentinels.wait_for_new_master(old),
            lambda: sentinels.restart(sentinels.node_at(old[1]), timeout=40),
            args,
            root,
        )
        figures.update({f"sentinel_{key}": value for key, value in results.items()})
        _report("Sentinel (master, replica, 3 sentinels)", results)
    print(f"logs: {root}")
    return figures


def _report(label: str, results: dict[str, Any]) -> None:
    print(
        f"{label}: lost {results['lost']}, errors {results['errors']} {results['error_kinds'] or ''}, "
        f"duplicated {results['duplicated']}, gaps {results['gaps']}, mismatched {results['mismatched']}; "
        f"promoted {results['promotion_s']} s after the kill, its replica back {results['restored_s']} s after it, "
        f"first result entry {results['recovery_s']} s after it; "
        f"new requests served after: {results['served_after']}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 requests of 100 tokens")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the scripted engine's step")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="a request with no end by then is lost")
    parser.add_argument("--wait-replicas", type=int, default=1, help="replicas each submission and end waits for")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.tokens = 60, 100
    print(
        f"{args.requests} requests x {args.tokens} tokens, 2 workers, a primary killed {KILL_AFTER_S} s in, "
        f"wait_replicas {args.wait_replicas}"
    )
    print_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
