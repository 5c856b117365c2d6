"""The fault suite's long version: kill -9 workers at random moments, pause one past its lease, SIGTERM
others, restart Redis (AOF on), and interleave malformed entries with valid requests; then count what was
lost, gapped or duplicated, and which keys of ours have no bound.

    python -m bench.faults [--quick] [--requests N] [--kills K] [--malformed M] [--hostile H]

Workers run with the test-only engine killer (`testing.poison`), and H hostile requests of different kinds
(values past the bounds, broken versions and encodings, and requests that kill the engine thread) are mixed
into the load.

Goal: lost == gaps == duplicates == wrong_outputs == unbounded_keys == 0; poison_answered == poison_sent,
stuck_workers == 0, engine_restarts <= max_engine_failures * engine killers sent.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.workload import print_json
from testing import poison
from testing.fault_cluster import Cluster, hostile_entries, run_faults
from testing.tiny_models import save_tiny_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 kills, 1,000 malformed entries")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--malformed", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--hostile", type=int, default=34, help="hostile requests (every 17th kills engines)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.kills, args.malformed, args.hostile = 60, 3, 1000, 17

    root = Path(tempfile.mkdtemp(prefix="llmq-faults-"))
    model_dir = save_tiny_model(root / "model", "llama", max_positions=512)
    faults = ["kill"] * args.kills + ["stop", "term", "redis"]
    random.Random(7).shuffle(faults)
    cluster = Cluster(root, model_dir, module="testing.poison")
    hostile = hostile_entries(args.hostile, killer_top_p=poison.POISON_TOP_P)
    killers = sum("engine-killer" in request_id for request_id, _ in hostile)
    for index in range(args.workers):
        cluster.start_worker(f"w{index}")
    started = time.perf_counter()
    try:
        report = asyncio.run(
            run_faults(
                cluster, requests=args.requests, faults=faults, malformed=args.malformed, seed=11, hostile=hostile
            )
        )
    finally:
        cluster.close()
    elapsed = time.perf_counter() - started
    figures = asdict(report)
    figures["seconds"] = round(elapsed, 1)
    figures["clean_exits"] = sum(code == 0 for code in report.exit_codes.values())
    figures["exits"] = len(report.exit_codes)
    figures["engine_killers_sent"] = killers
    figures["good_lost"] = report.lost
    figures["good_mismatched"] = report.wrong_outputs
    del figures["exit_codes"]
    print(f"{report.requests} requests through {args.workers} workers in {elapsed:.0f} s, logs in {root}")
    print(
        f"faults: {report.kills} kill -9, {report.stops} SIGSTOP past the lease, {report.terms} SIGTERM, "
        f"{report.redis_restarts} Redis restart; {report.malformed} malformed entries"
    )
    print(
        f"completed {report.completed}, lost {report.lost}, gaps {report.gaps}, duplicates {report.duplicates}, "
        f"wrong outputs {report.wrong_outputs}, dead letters {report.dead_letters}, unbounded keys "
        f"{report.unbounded_keys}, requests left {report.requests_left}, "
        f"clean exits {figures['clean_exits']}/{figures['exits']}"
    )
    print(
        f"hostile: {report.poison_answered}/{report.poison_sent} answered with a typed error within 30 s "
        f"({killers} engine killers), engine restarts {report.engine_restarts}, stuck workers {report.stuck_workers}"
    )
    print_json(figures)


if __name__ == "__main__":
    main()
