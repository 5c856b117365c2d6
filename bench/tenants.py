"""Fair share between tenants on two worker processes, with the scripted engine (`bench.fabric`'s workers: the
queue's own behaviour, not the model's cost).

    python -m bench.tenants [--quick] [--step-ms 20] [--flood 2000] [--affinity-wait-ms 50] [--idle-tenant-slots 1]

Eight runs, each on a Redis of its own and two fresh workers of 8 slots, `--idle-tenant-slots` of them kept for
tenants with nothing running (`LLMQ_IDLE_TENANT_SLOTS`) unless the run says otherwise:
- `b alone`: tenant B submits 50 requests spread over the run; nobody else has work.
- `a floods`: tenant A submits `--flood` batch requests at once, and once they are queued B submits its 50,
  spread over A's run, in the same lane: B's queue wait (submit to start, the `done` event's `queue_ms`) against
  B alone is `b_wait_p99_ratio`.
- `a floods, no kept slot`: the same with no slot kept. Tenants then share slots, not steps: without preemption
  between them, a request of B waits for one of A's to end, up to one request's running time (`a_running_ms_p50`);
  `b_wait_p99_over_a_running` is B's P99 wait over it.
- `one tenant`: the same, B's requests submitted as A's, as before tenants: first come, first served.
- `a alone`: the flood with no B; `a beside idle b`: the same with B's weight set to 3 and B idle: A gets all the
  fleet's open slots (fair share is work-conserving): `a_throughput_ratio`, beside idle B / alone. `a alone, no
  kept slot`: what the kept slots cost a lone flood (`kept_slot_cost`, the share of its throughput).
- `3:1`: A (weight 3) and B (weight 1) both flood; the token share A's requests got among those that started
  while both had work waiting, against 3/4, is `share_error`.
Usage (`llmq usage`) is compared with what the clients saw in every run (`usage_exact`), and `lost` counts the
requests that got no answer. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from bench.fabric import with_workers
from bench.workload import percentile, print_json
from client import AsyncClient
from client.admin import Admin
from client.tenants import Tenants
from client.usage import read_usage
from worker.embedded_redis import RedisServer

WORKERS, SLOTS, TOKENS = 2, 8, 16
B_REQUESTS = 50


class Run:
    """The answers of one run: per tenant, (submitted at, result) in submission order, and the requests lost."""

    def __init__(self) -> None:
        self.answers: dict[str, list[tuple[float, Any]]] = {}
        self.lost = 0
        self.seconds = 0.0
        self.sent = 0
        self.queued: dict[str, int] = {}  # tenant -> requests submitted and in the queue
        self.tenants: dict[str, str] = {}  # caller -> the tenant it submitted as
        self.submitting = asyncio.Semaphore(32)

    async def one(self, client: AsyncClient, caller: str, tenant: str | None = None) -> None:
        """One batch request of `caller`, submitted as `tenant` (the caller's own by default), its prompt its own
        (cache affinity has no shared start to route by)."""
        sent, self.sent = time.perf_counter(), self.sent + 1
        prompt = [3 + self.sent % 397, 3 + self.sent // 397 % 397, *[7] * 6]  # the scripted vocabulary: 400 ids
        tenant = tenant or caller
        async with self.submitting:  # a flood's submits share a few connections, as a real producer's would
            job = await client.submit(input_ids=prompt, max_new_tokens=TOKENS, tenant=tenant, priority="batch")
        self.queued[tenant] = self.queued.get(tenant, 0) + 1
        try:
            result = await job.result(timeout=900)
        except Exception:  # counted as lost, which the JSON line reports
            self.lost += 1
            return
        self.answers.setdefault(caller, []).append((sent, result))
        self.tenants[caller] = tenant

    def waits_ms(self, tenant: str) -> list[float]:
        return [result.timings.queue_ms or 0.0 for _, result in self.answers.get(tenant, [])]

    def running_ms(self, tenant: str) -> list[float]:
        """Each request's time from its start to its end: how long a slot it holds stays taken."""
        return [(r.timings.total_ms or 0.0) - (r.timings.queue_ms or 0.0) for _, r in self.answers.get(tenant, [])]

    def tokens_per_s(self, tenant: str) -> float:
        return sum(r.usage.completion_tokens for _, r in self.answers.get(tenant, [])) / self.seconds


async def trickle(run: Run, client: AsyncClient, caller: str, count: int, over_s: float, tenant: str = "") -> None:
    """`count` requests of `caller`, one every `over_s / count` seconds."""
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(run.one(client, caller, tenant)))
        await asyncio.sleep(over_s / count)
    await asyncio.gather(*tasks)


async def flood(run: Run, client: AsyncClient, tenant: str, count: int) -> None:
    await asyncio.gather(*(run.one(client, tenant) for _ in range(count)))


async def behind(run: Run, tenant: str, count: int, then: Any) -> None:
    """`then` once `count` requests of `tenant` are in the queue: B's requests come while A's flood runs, not while
    A's client is still writing it (2,000 submits at once load this machine's two cores, Redis's among them)."""
    while run.queued.get(tenant, 0) < count:
        await asyncio.sleep(0.05)
    await then


def usage_matches(url: str, run: Run) -> bool:
    """Whether `llmq usage` counts, per tenant, the requests and tokens the callers saw."""
    with closing(Admin(url)) as admin:
        counted = {one.tenant: one for one in read_usage(admin, "default", 3600)}
    seen: dict[str, list[int]] = {}
    for caller, answers in run.answers.items():
        totals = seen.setdefault(run.tenants[caller], [0, 0, 0])
        for _, result in answers:
            totals[0] += 1
            totals[1] += result.usage.completion_tokens
            totals[2] += result.usage.prompt_tokens
    return {t: [u.total_requests, u.generated_tokens, u.prompt_tokens] for t, u in counted.items()} == seen


async def scenario(
    root: Path, name: str, step_s: float, work: Any, weights: dict[str, float], affinity_wait_ms: int, kept: int
) -> tuple[Run, bool]:
    """One run on a fresh Redis and two fresh workers: `work(run, client)` submits and awaits."""
    server = RedisServer(root / f"redis-{name}").start()
    run = Run()
    try:
        with closing(Admin(server.url)) as admin:
            for tenant, weight in weights.items():
                Tenants(admin, "default").set_weight(tenant, weight)

        async def go() -> None:
            async with AsyncClient(server.url, max_queue_len=0, max_connections=64) as client:
                await asyncio.sleep(1.0)  # the workers' first reads mark the queue: clients hold from then on
                start = time.perf_counter()
                await work(run, client)
                run.seconds = time.perf_counter() - start

        await with_workers(server.url, WORKERS, step_s, SLOTS, root, go, affinity_wait_ms, kept)
        exact = usage_matches(server.url, run)
    finally:
        server.stop()
    return run, exact


def share_while_both_wait(run: Run, tenant: str) -> float:
    """`tenant`'s share of the tokens of the requests that started while both tenants still had requests waiting:
    until the first tenant's last request started."""
    starts = {
        name: sorted((sent + (result.timings.queue_ms or 0.0) / 1000, result) for sent, result in answers)
        for name, answers in run.answers.items()
    }
    until = min(entries[-1][0] for entries in starts.values())
    tokens = {name: sum(r.usage.completion_tokens for at, r in got if at < until) for name, got in starts.items()}
    return tokens[tenant] / max(1, sum(tokens.values()))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="llmq-bench-tenants-"))
    step_s, flood_size = args.step_ms / 1000, args.flood // (4 if args.quick else 1)
    # a flood's length at full speed: the B requests spread over most of it
    flood_s = flood_size * TOKENS * step_s / (WORKERS * SLOTS)

    async def b_alone(run: Run, client: AsyncClient) -> None:
        await trickle(run, client, "b", B_REQUESTS, 0.7 * flood_s)

    async def a_floods(run: Run, client: AsyncClient) -> None:
        b = trickle(run, client, "b", B_REQUESTS, 0.7 * flood_s)
        await asyncio.gather(flood(run, client, "a", flood_size), behind(run, "a", flood_size, b))

    async def one_tenant(run: Run, client: AsyncClient) -> None:  # as before tenants: B's requests are A's too
        b = trickle(run, client, "b", B_REQUESTS, 0.7 * flood_s, tenant="a")
        await asyncio.gather(flood(run, client, "a", flood_size), behind(run, "a", flood_size, b))

    async def a_alone(run: Run, client: AsyncClient) -> None:
        await flood(run, client, "a", flood_size)

    async def both_flood(run: Run, client: AsyncClient) -> None:
        await asyncio.gather(flood(run, client, "a", flood_size // 2), flood(run, client, "b", flood_size // 2))

    kept = args.idle_tenant_slots
    runs: dict[str, tuple[Run, bool]] = {}
    for name, work, weights, slots_kept in (
        ("b alone", b_alone, {}, kept),
        ("a floods", a_floods, {}, kept),
        ("a floods, no kept slot", a_floods, {}, 0),
        ("one tenant", one_tenant, {}, kept),
        ("a alone", a_alone, {}, kept),
        ("a alone, no kept slot", a_alone, {}, 0),
        ("a beside idle b", a_alone, {"b": 3.0}, kept),
        ("3:1", both_flood, {"a": 3.0, "b": 1.0}, kept),
    ):
        label = name.replace(",", "").replace(" ", "-").replace(":", "to")
        runs[name] = await scenario(root, label, step_s, work, weights, args.affinity_wait_ms, slots_kept)
        run, exact = runs[name]
        waits = {t: run.waits_ms(t) for t in sorted(run.answers)}
        print(
            f"{name}: {run.seconds:.1f} s, "
            + ", ".join(
                f"{t}: {len(w)} requests, queue wait P50 {percentile(w, 0.5):.0f} ms P99 {percentile(w, 0.99):.0f} ms, "
                f"{run.tokens_per_s(t):.0f} tok/s"
                for t, w in waits.items()
            )
            + f"; usage exact {exact}, lost {run.lost}",
            flush=True,
        )
    alone, flooded = runs["b alone"][0].waits_ms("b"), runs["a floods"][0].waits_ms("b")
    unkept, fifo = runs["a floods, no kept slot"][0].waits_ms("b"), runs["one tenant"][0].waits_ms("b")
    share = share_while_both_wait(runs["3:1"][0], "a")
    print(f"3:1: A's token share while both waited {share:.3f} (weights: 0.750)")
    # Without preemption between tenants, B waits for a slot to free: up to one of A's requests' running time.
    a_running = percentile(runs["a floods, no kept slot"][0].running_ms("a"), 0.5)
    over = percentile(unkept, 0.99) / max(1.0, a_running)
    print(f"a's requests ran {a_running:.0f} ms each (P50): with no kept slot, B's P99 wait is {over:.2f} of that")
    a_alone_tok_s = runs["a alone"][0].tokens_per_s("a")
    unkept_tok_s = runs["a alone, no kept slot"][0].tokens_per_s("a")
    cost = 1 - a_alone_tok_s / max(1e-9, unkept_tok_s)
    print(f"{kept} kept slot(s) of {SLOTS} per worker cost a lone flood {100 * cost:.1f}% of its throughput")
    return {
        "step_ms": args.step_ms,
        "affinity_wait_ms": args.affinity_wait_ms,
        "idle_tenant_slots": kept,
        "slots_per_worker": SLOTS,
        "flood": flood_size,
        "b_requests": B_REQUESTS,
        "b_wait_p50_ms_alone": round(percentile(alone, 0.5), 1),
        "b_wait_p99_ms_alone": round(percentile(alone, 0.99), 1),
        "b_wait_p50_ms_flooded": round(percentile(flooded, 0.5), 1),
        "b_wait_p99_ms_flooded": round(percentile(flooded, 0.99), 1),
        "b_wait_p99_ratio": round(percentile(flooded, 0.99) / max(1.0, percentile(alone, 0.99)), 3),
        "b_wait_p50_ms_no_kept_slot": round(percentile(unkept, 0.5), 1),
        "b_wait_p99_ms_no_kept_slot": round(percentile(unkept, 0.99), 1),
        "b_wait_p99_ratio_no_kept_slot": round(percentile(unkept, 0.99) / max(1.0, percentile(alone, 0.99)), 3),
        "b_wait_p50_ms_one_tenant": round(percentile(fifo, 0.5), 1),
        "b_wait_p99_ms_one_tenant": round(percentile(fifo, 0.99), 1),
        "b_wait_p99_ratio_one_tenant": round(percentile(flooded, 0.99) / max(1.0, percentile(fifo, 0.99)), 3),
        "a_running_ms_p50": round(a_running, 1),
        "b_wait_p99_over_a_running": round(over, 3),
        "a_share_3to1": round(share, 3),
        "share_error": round(abs(share - 0.75), 3),
        "a_tok_s_alone": round(a_alone_tok_s),
        "a_tok_s_alone_no_kept_slot": round(unkept_tok_s),
        "kept_slot_cost": round(cost, 3),
        "a_tok_s_beside_idle_b": round(runs["a beside idle b"][0].tokens_per_s("a")),
        "a_tok_s_beside_busy_b": round(runs["a floods"][0].tokens_per_s("a")),
        "a_throughput_ratio": round(runs["a beside idle b"][0].tokens_per_s("a") / max(1e-9, a_alone_tok_s), 3),
        "usage_exact": all(exact for _, exact in runs.values()),
        "lost": sum(run.lost for run, _ in runs.values()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a quarter of the flood")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the scripted engine's step time")
    parser.add_argument("--flood", type=int, default=2000, help="tenant A's batch requests")
    parser.add_argument(
        "--affinity-wait-ms", type=int, default=50, help="the workers' LLMQ_AFFINITY_WAIT_MS (0: cache affinity off)"
    )
    parser.add_argument(
        "--idle-tenant-slots", type=int, default=1, help="the workers' LLMQ_IDLE_TENANT_SLOTS (0: none kept)"
    )
    print_json(asyncio.run(main_async(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
