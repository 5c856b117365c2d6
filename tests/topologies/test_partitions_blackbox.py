"""Black-box: one queue over several partitions (`LLMQ_QUEUE_PARTITIONS`), used heavily, carelessly and under
faults, written from the README ("One queue over several shards") and the documented parameters only.

The promise under test:

- P partitions are the hash tags `{llmq:<queue>}` (the queue's keys as with one partition) and
  `{llmq:<queue>#1}` ... `{llmq:<queue>#P-1}`; the same P is set on every process;
- a request lives in the partition of its id, so any process finds it from the id alone (`Job.attach`,
  `llmq cancel`), and an id submitted again is the same request;
- a lane's `max_queue_len` is shared out over the partitions;
- a worker reads every partition, lanes first as with one (interactive, default, batch); claims of dead
  workers' requests, preemption, cancels and publishing work per partition;
- `status()` adds the partitions up and lists each in `.partitions`; `llmq status` shows a line per partition;
- on a Cluster the partitions spread over the shards.

Workers run in-process on the scripted engine (testing/scripted_engine.py), whose tokens are a pure function of the
prompt and the position, so every output is checked token for token. Cases already in
tests/worker/test_partitions.py and tests/topologies/test_cluster_and_sentinel.py are not repeated; these go for volume,
mixed lanes, other clients, wrong settings and a killed shard. Bugs found are pinned as `xfail` (strict, but for
the one whose symptom depends on a failover's timing).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from redis.asyncio import Redis

from client import AsyncClient, AsyncJob, Client, Job, QueueFull
from client.cli import main as cli
from client.store import Keys, partition_of
from gateway.settings import GatewaySettings
from testing.redis_topologies import RedisClusterSet
from testing.scripted_engine import expected_tokens
from tests.gateway.conftest import gateway  # noqa: F401 - gateways on free ports
from tests.polling import wait_until
from tests.topologies.partitions_support import (
    follow,
    ids_in,
    running_worker,
    spread_over_three_masters,
    stream_lengths,
    terminal_counts,
)
from worker.config import Settings

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


async def in_order(done: list[str], label: str, job: AsyncJob) -> None:
    """Appends `label` to `done` once `job` has its result."""
    await job.result(timeout=30)
    done.append(label)


async def pending_reaches(client: AsyncClient, count: int) -> bool:
    return (await client.status()).pending == count


async def drained(client: AsyncClient) -> bool:
    status = await client.status()
    return status.depth == 0 and status.pending in (0, None)


# -- settings ---------------------------------------------------------------------------------------------------


async def test_one_partition_is_todays_queue_and_a_process_without_the_setting_interoperates(
    redis_url: str, tmp_path: Path
) -> None:
    """P = 1 (the default) writes exactly the keys of a queue before partitions; a request that lands in partition 0
    of a partitioned queue uses them too, so a worker that never heard of partitions serves it."""
    queue = "bb-one"
    assert Keys(queue).partitioned(1) == [Keys(queue)]
    async with AsyncClient(redis_url, queue=queue) as plain, AsyncClient(redis_url, queue=queue, partitions=1) as one:
        waiting = [
            await plain.submit(input_ids=[4, 1], max_new_tokens=5),
            await one.submit(input_ids=[4, 2], max_new_tokens=5),
        ]
        async with Redis.from_url(redis_url) as raw:
            assert await raw.xlen(f"{{llmq:{queue}}}:requests") == 2  # the literal key of one partition
            assert await raw.keys(f"{{llmq:{queue}#*") == []
        assert (await plain.status()).partitions == []  # one partition: no breakdown
        async with running_worker(redis_url, queue, tmp_path, queue_partitions=1):
            assert (await waiting[0].result(timeout=20)).token_ids == expected_tokens([4, 1], 5)
            assert (await waiting[1].result(timeout=20)).finish_reason == "length"
        async with (
            AsyncClient(redis_url, queue=queue, partitions=4) as four,
            running_worker(redis_url, queue, tmp_path),
        ):
            [rid] = ids_in(0, 4)
            job = await four.submit(input_ids=[7], max_new_tokens=4, request_id=rid)
            assert job.keys == Keys(queue)
            assert (await job.result(timeout=20)).token_ids == expected_tokens([7], 4)
            assert (await plain.generate(input_ids=[8], max_new_tokens=3, timeout=20)).token_ids == expected_tokens(
                [8], 3
            )


def test_partition_counts_out_of_range_are_refused_by_every_component(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    unreachable = "redis://127.0.0.1:1/0"  # nothing is sent: the count is refused first
    for bad in (0, -1, 1025):
        for kind in (AsyncClient, Client):
            with pytest.raises(ValueError, match="partitions must be in"):
                kind(unreachable, partitions=bad)
        with pytest.raises(ValidationError):
            Settings(_env_file=None, queue_partitions=bad)  # type: ignore[call-arg]
        with pytest.raises(ValidationError):
            GatewaySettings(_env_file=None, queue_partitions=bad)  # type: ignore[call-arg]
        assert cli(["status", "--url", unreachable, "--partitions", str(bad)]) == 2  # Exit.USAGE
        err = capsys.readouterr().err
        assert "partitions must be in [1, 1024]" in err and "Traceback" not in err
    monkeypatch.setenv("LLMQ_QUEUE_PARTITIONS", "4")
    monkeypatch.setenv("LLMQ_GATEWAY_QUEUE_PARTITIONS", "3")
    assert Settings(_env_file=None).queue_partitions == 4  # type: ignore[call-arg]
    assert GatewaySettings(_env_file=None).queue_partitions == 3  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="queue"):
        Keys("q#1")  # no queue's name can alias another queue's partition
    assert Keys("q").partitioned(1024)[-1].tag == "{llmq:q#1023}"


# -- volume and status ----------------------------------------------------------------------------------------------


async def test_240_requests_over_four_partitions_and_two_workers_each_end_once_with_the_scripted_answer(
    redis_url: str, tmp_path: Path
) -> None:
    queue, count = "bb-volume", 240
    parts = Keys(queue).partitioned(4)
    async with AsyncClient(redis_url, queue=queue, partitions=4) as client:
        jobs = [await client.submit(input_ids=[5, i], max_new_tokens=6, temperature=0) for i in range(count)]
        assert [job.keys for job in jobs] == [parts[partition_of(job.id, 4)] for job in jobs]
        depths = await stream_lengths(redis_url, parts)
        assert sum(depths) == count and min(depths) >= 35  # random ids spread evenly
        status = await client.status()
        assert status.depth == count and status.lag is None  # no worker has created a group yet
        assert [(p.partition, p.depth) for p in status.partitions] == list(enumerate(depths))
        async with (
            running_worker(redis_url, queue, tmp_path, queue_partitions=4) as first,
            running_worker(redis_url, queue, tmp_path, queue_partitions=4) as second,
        ):
            results = await asyncio.gather(*(job.result(timeout=60) for job in jobs))
            await wait_until(lambda: drained(client))
            status = await client.status()
            assert {w.id for w in status.workers} == {first.worker.settings.worker_id, second.worker.settings.worker_id}
            assert all(w.tokens_generated > 0 for w in status.workers)  # both served
            assert [(p.depth, p.pending, p.lag) for p in status.partitions] == [(0, 0, 0)] * 4
    assert [r.token_ids for r in results] == [expected_tokens([5, i], 6) for i in range(count)]
    assert set((await terminal_counts(redis_url, jobs)).values()) == {1}


async def test_status_and_llmq_status_show_each_partition_while_work_runs(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = "bb-status"
    async with (
        running_worker(redis_url, queue, tmp_path, step_s=0.02, queue_partitions=4, max_running=6),
        AsyncClient(redis_url, queue=queue, partitions=4) as client,
    ):
        jobs = [
            await client.submit(input_ids=[6, n], max_new_tokens=400, request_id=rid)
            for p in range(4)
            for n, rid in enumerate(ids_in(p, 4, 3, "status"))
        ]
        await wait_until(lambda: pending_reaches(client, 6))  # the worker runs 6, 6 wait
        status = await client.status()
        assert status.depth == 12 and [p.depth for p in status.partitions] == [3, 3, 3, 3]
        assert sum(p.pending or 0 for p in status.partitions) == status.pending == 6
        assert sum(p.lag or 0 for p in status.partitions) == status.lag == 6
        args = ["status", "--url", redis_url, "--queue", queue]
        assert await asyncio.to_thread(cli, [*args, "--partitions", "4"]) == 0
        text = capsys.readouterr().out
        assert f"queue {queue}: depth 12, pending 6, lag 6" in text
        for p in range(4):
            assert f"partition {p}: depth 3, pending " in text
        monkeypatch.setenv("LLMQ_QUEUE_PARTITIONS", "4")  # the documented default of --partitions
        assert await asyncio.to_thread(cli, [*args, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert [(p["partition"], p["depth"]) for p in shown["partitions"]] == [(p, 3) for p in range(4)]
        assert sum(p["pending"] for p in shown["partitions"]) == shown["pending"] == 6
        for job in jobs:
            await job.cancel()
        await wait_until(lambda: drained(client))


# -- lanes ----------------------------------------------------------------------------------------------------


async def finish_order(redis_url: str, tmp_path: Path, partitions: int) -> list[str]:
    """One slot, no lane share, no preemption: while a default request runs, six batch requests wait in
    partitions 0-2 and three interactive ones in partition 3 (of four). The lanes in the order they finish."""
    queue = f"bb-lanes-{partitions}"
    done: list[str] = []
    async with (
        running_worker(
            redis_url,
            queue,
            tmp_path,
            step_s=0.01,
            queue_partitions=partitions,
            max_running=1,
            lane_share=0,
            preemption=False,
        ),
        AsyncClient(redis_url, queue=queue, partitions=partitions) as client,
    ):
        blocker = await client.submit(input_ids=[9], max_new_tokens=30)
        async for _ in blocker.stream(timeout=20):
            break
        waiting = []
        for p in range(3):
            for rid in ids_in(p, 4, 2, f"batch{partitions}"):
                job = await client.submit(input_ids=[2], max_new_tokens=3, priority="batch", request_id=rid)
                waiting.append(in_order(done, "batch", job))
        for rid in ids_in(3, 4, 3, f"urgent{partitions}"):
            job = await client.submit(input_ids=[3], max_new_tokens=3, priority="interactive", request_id=rid)
            waiting.append(in_order(done, "interactive", job))
        await asyncio.gather(*waiting)
    return done


async def test_with_one_partition_waiting_interactive_work_starts_before_batch_work(
    redis_url: str, tmp_path: Path
) -> None:
    """The baseline of the next test: the same traffic on one partition."""
    assert await finish_order(redis_url, tmp_path, 1) == ["interactive"] * 3 + ["batch"] * 6


async def test_lanes_are_kept_across_partitions(redis_url: str, tmp_path: Path) -> None:
    assert await finish_order(redis_url, tmp_path, 4) == ["interactive"] * 3 + ["batch"] * 6


async def test_interactive_requests_of_every_partition_preempt_batch_work_which_resumes_whole(
    redis_url: str, tmp_path: Path
) -> None:
    queue = "bb-preempt"
    async with (
        running_worker(redis_url, queue, tmp_path, step_s=0.01, queue_partitions=4, max_running=4, lane_share=0),
        AsyncClient(redis_url, queue=queue, partitions=4) as client,
    ):
        batch = [
            await client.submit(input_ids=[12, p], max_new_tokens=200, priority="batch", request_id=ids_in(p, 4)[0])
            for p in range(4)
        ]
        done: list[str] = []

        async def follow_batch(job: AsyncJob) -> list[int]:
            tokens = await follow(job)
            done.append(f"batch {job.keys.partition}")
            return tokens

        following = [asyncio.ensure_future(follow_batch(job)) for job in batch]
        await wait_until(lambda: pending_reaches(client, 4))  # the worker is full of batch work
        urgent = [
            await client.submit(input_ids=[13, p], max_new_tokens=3, priority="interactive", request_id=rid)
            for p in range(4)
            for rid in ids_in(p, 4, 1, "urgent")
        ]
        await asyncio.gather(*(in_order(done, f"interactive {job.keys.partition}", job) for job in urgent))
        outputs = await asyncio.gather(*following)
        assert sorted(done[:4]) == [f"interactive {p}" for p in range(4)], done  # none waited for batch to end
    assert outputs == [expected_tokens([12, p], 200) for p in range(4)]  # no gap, no duplicate
    assert [(await job.result(timeout=5)).token_ids for job in urgent] == [
        expected_tokens([13, p], 3) for p in range(4)
    ]
    assert set((await terminal_counts(redis_url, [*batch, *urgent])).values()) == {1}


# -- by id, from anywhere -------------------------------------------------------------------------------------------


async def test_attach_and_cancel_by_id_alone_from_other_clients_and_llmq_in_every_partition(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = "bb-by-id"

    async def submit_one(client: AsyncClient, p: int, name: str, tokens: int) -> AsyncJob:
        return await client.submit(input_ids=[14, p], max_new_tokens=tokens, request_id=ids_in(p, 4, 1, name)[0])

    async with (
        running_worker(redis_url, queue, tmp_path, step_s=0.01, queue_partitions=4, max_running=16),
        AsyncClient(redis_url, queue=queue, partitions=4) as submitter,
    ):
        short = [await submit_one(submitter, p, "short", 5) for p in range(4)]
        by_async = [await submit_one(submitter, p, "async", 400) for p in range(4)]
        by_llmq = [await submit_one(submitter, p, "llmq", 400) for p in range(4)]
        by_sync = [await submit_one(submitter, p, "sync", 400) for p in range(4)]
        long = [*by_async, *by_llmq, *by_sync]
        for job in long:
            async for _ in job.stream(timeout=20):
                break
        async with AsyncClient(redis_url, queue=queue, partitions=4) as other:
            for p, job in enumerate(short):
                attached = AsyncJob.attach(other, job.id)
                assert attached.keys.partition == p
                assert (await attached.result(timeout=20)).token_ids == expected_tokens([14, p], 5)
            for job in by_async:
                await AsyncJob.attach(other, job.id).cancel()
        for job in by_llmq:
            command = ["cancel", job.id, "--url", redis_url, "--queue", queue, "--partitions", "4"]
            assert await asyncio.to_thread(cli, command) == 0
        assert capsys.readouterr().out.count("cancel sent for") == 4

        def through_the_sync_client() -> list[list[int]]:  # in a thread: the worker runs on this event loop
            with Client(redis_url, queue=queue, partitions=4) as sync:
                for job in by_sync:
                    Job.attach(sync, job.id).cancel()
                return [Job.attach(sync, job.id).result(timeout=20).token_ids for job in short]

        assert await asyncio.to_thread(through_the_sync_client) == [expected_tokens([14, p], 5) for p in range(4)]
        for job in long:
            async for _ in job.stream(timeout=20):
                pass
        assert [job.finish_reason for job in long] == ["cancelled"] * 12
        await wait_until(lambda: drained(submitter))
    assert set((await terminal_counts(redis_url, [*short, *long])).values()) == {1}


async def test_resubmitting_an_id_from_any_client_or_lane_is_one_request_in_its_partition(
    redis_url: str, tmp_path: Path
) -> None:
    queue = "bb-dup"
    ids = [rid for p in range(4) for rid in ids_in(p, 4, 2, "dup")]
    async with (
        AsyncClient(redis_url, queue=queue, partitions=4) as first,
        AsyncClient(redis_url, queue=queue, partitions=4) as second,
    ):
        jobs = []
        for rid in ids:
            job = await first.submit(input_ids=[15], max_new_tokens=3, request_id=rid)
            again = await second.submit(input_ids=[15], max_new_tokens=3, request_id=rid)
            other_lane = await first.submit(input_ids=[16], max_new_tokens=9, request_id=rid, priority="interactive")
            assert job.keys == again.keys == other_lane.keys == Keys(queue).partitioned(4)[partition_of(rid, 4)]
            jobs.append(job)
        status = await first.status()
        assert status.depth == len(ids) and [p.depth for p in status.partitions] == [2, 2, 2, 2]
        assert [lane.depth for lane in status.lanes if lane.lane == "interactive"] == [0]
        async with running_worker(redis_url, queue, tmp_path, queue_partitions=4):
            assert [(await job.result(timeout=20)).token_ids for job in jobs] == [expected_tokens([15], 3)] * 8
            late = [await second.submit(input_ids=[15], max_new_tokens=3, request_id=rid) for rid in ids]
            assert [(await job.result(timeout=20)).token_ids for job in late] == [expected_tokens([15], 3)] * 8
            await wait_until(lambda: drained(first))
    assert set((await terminal_counts(redis_url, jobs)).values()) == {1}


# -- backlog limits ---------------------------------------------------------------------------------------------


async def test_max_queue_len_is_shared_out_over_the_partitions(redis_url: str) -> None:
    async with AsyncClient(redis_url, queue="bb-full", partitions=4, max_queue_len=8) as client:
        for rid in ids_in(1, 4, 2, "full"):
            await client.submit(input_ids=[17], request_id=rid)
        with pytest.raises(QueueFull):  # partition 1 holds its share, 8 / 4
            await client.submit(input_ids=[17], request_id=ids_in(1, 4, 1, "full")[0])
        await client.submit(input_ids=[17], request_id=ids_in(1, 4, 1, "full")[0], priority="batch")  # own limit
        for p in (0, 2, 3):
            for rid in ids_in(p, 4, 2, "full"):
                await client.submit(input_ids=[17], request_id=rid)
        for p in range(4):
            with pytest.raises(QueueFull):
                await client.submit(input_ids=[17], request_id=ids_in(p, 4, 1, "full")[0])
        status = await client.status()
        assert [lane.depth for lane in status.lanes] == [0, 8, 1]  # interactive, default, batch
    async with AsyncClient(redis_url, queue="bb-unbounded", partitions=4, max_queue_len=0) as client:
        for rid in ids_in(2, 4, 20, "unbounded"):  # 0 = no limit, in every partition
            await client.submit(input_ids=[17], request_id=rid)
        assert (await client.status()).partitions[2].depth == 20


async def test_a_limit_below_the_partition_count_bounds_each_partition_at_one(redis_url: str) -> None:
    """The README: each partition holds ceil(max_queue_len / P), so a lane holds up to P times that (this suite
    first pinned max_queue_len=3 over 4 partitions accepting 4 as a bug; it is the documented bound)."""
    accepted = 0
    async with AsyncClient(redis_url, queue="bb-small", partitions=4, max_queue_len=3) as client:
        for p in range(4):
            try:
                await client.submit(input_ids=[18], request_id=ids_in(p, 4, 1, "small")[0])
                accepted += 1
            except QueueFull:
                pass
            with pytest.raises(QueueFull):  # its one slot is taken
                await client.submit(input_ids=[18], request_id=ids_in(p, 4, 2, "small")[1])
        assert (await client.status()).depth == accepted == 4 * math.ceil(3 / 4)


async def test_queue_full_says_what_the_lane_holds(redis_url: str) -> None:
    async with AsyncClient(redis_url, queue="bb-message", partitions=4, max_queue_len=8) as client:
        for rid in ids_in(0, 4, 2, "message"):
            await client.submit(input_ids=[19], request_id=rid)
        with pytest.raises(QueueFull) as refused:
            await client.submit(input_ids=[19], request_id=ids_in(0, 4, 1, "message")[0])
        assert (await client.status()).depth == 2
        assert "holds 8" not in str(refused.value), str(refused.value)


# -- wrong settings ---------------------------------------------------------------------------------------------


async def test_requests_of_partitions_a_worker_does_not_read_wait_visibly_until_a_worker_with_the_right_count_comes(
    redis_url: str, tmp_path: Path
) -> None:
    """Clients at P = 4, a worker left at P = 2: what it cannot see is not lost. `status()` at the clients' count
    shows it waiting where no worker ever read (no group: pending unknown), and a worker at 4 serves it."""
    queue = "bb-mismatch"
    async with AsyncClient(redis_url, queue=queue, partitions=4) as client:
        jobs = {
            p: [
                await client.submit(input_ids=[20, p, n], max_new_tokens=4, request_id=rid)
                for n, rid in enumerate(ids_in(p, 4, 3, "mismatch"))
            ]
            for p in range(4)
        }
        async with running_worker(redis_url, queue, tmp_path, queue_partitions=2):
            for p in (0, 1):
                assert [(await job.result(timeout=20)).token_ids for job in jobs[p]] == [
                    expected_tokens([20, p, n], 4) for n in range(3)
                ]
            await asyncio.sleep(0.3)  # a few more read rounds: still nothing of partitions 2 and 3
            status = await client.status()
            assert [(p.depth, p.pending) for p in status.partitions] == [(0, 0), (0, 0), (3, None), (3, None)]
        async with running_worker(redis_url, queue, tmp_path, queue_partitions=4):
            for p in (2, 3):
                attached = [AsyncJob.attach(client, job.id) for job in jobs[p]]
                assert [(await job.result(timeout=20)).token_ids for job in attached] == [
                    expected_tokens([20, p, n], 4) for n in range(3)
                ]
    assert set((await terminal_counts(redis_url, [job for each in jobs.values() for job in each])).values()) == {1}


# -- pipelines ------------------------------------------------------------------------------------------------


async def test_reply_to_completions_of_every_partition_reach_the_documented_streams(
    redis_url: str, tmp_path: Path
) -> None:
    queue = "bb-reply"
    async with (
        running_worker(redis_url, queue, tmp_path, queue_partitions=4),
        AsyncClient(redis_url, queue=queue, partitions=4) as client,
    ):
        jobs = [
            await client.submit(input_ids=[21, p], max_new_tokens=3, reply_to="stage2", request_id=rid)
            for p in range(4)
            for rid in ids_in(p, 4, 2, "reply")
        ]
        await asyncio.gather(*(job.result(timeout=20) for job in jobs))
        async with Redis.from_url(redis_url) as raw:  # the README: one reply stream per partition, each its slot
            lengths = [await raw.xlen(keys.reply("stage2")) for keys in Keys(queue).partitioned(4)]
        assert lengths == [2, 2, 2, 2]


# -- faults ---------------------------------------------------------------------------------------------------


async def test_a_killed_workers_requests_of_every_partition_are_resumed_by_another_whole(
    redis_url: str, tmp_path: Path
) -> None:
    queue = "bb-killed"
    settings: dict[str, Any] = {"queue_partitions": 3, "lease_timeout_s": 0.6, "claim_interval_s": 0.1}
    async with AsyncClient(redis_url, queue=queue, partitions=3) as client:
        async with running_worker(redis_url, queue, tmp_path, step_s=0.01, **settings) as doomed:
            jobs = [
                await client.submit(input_ids=[22, p, n], max_new_tokens=150, temperature=0, request_id=rid)
                for p in range(3)
                for n, rid in enumerate(ids_in(p, 3, 2, "killed"))
            ]
            following = [asyncio.ensure_future(follow(job)) for job in jobs]
            await wait_until(lambda: pending_reaches(client, 6))
            await asyncio.sleep(0.3)  # every request has streamed a part
            await doomed.kill()
        async with running_worker(redis_url, queue, tmp_path, step_s=0.002, **settings):
            outputs = await asyncio.gather(*following)
            await wait_until(lambda: drained(client))
    assert outputs == [expected_tokens([22, p, n], 150) for p in range(3) for n in range(2)]
    assert set((await terminal_counts(redis_url, jobs)).values()) == {1}


async def test_a_cluster_master_holding_one_partition_killed_while_every_partition_streams(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    """P = 3 on three masters; the master of partition 1 is SIGKILLed while 18 requests (6 a partition) stream.
    Every request ends once, its tokens contiguous and the idle answer; a new request after the promotion too."""
    queue, victim = spread_over_three_masters(redis_cluster, "bbp")
    url = redis_cluster.seed_url
    async with (
        running_worker(url, queue, tmp_path, step_s=0.01, queue_partitions=3, max_running=32),
        AsyncClient(url, queue=queue, partitions=3) as client,
    ):
        jobs = [
            await client.submit(input_ids=[23, p, n], max_new_tokens=300, request_id=rid)
            for p in range(3)
            for n, rid in enumerate(ids_in(p, 3, 6, "cluster"))
        ]
        following = [asyncio.ensure_future(follow(job, timeout=90)) for job in jobs]
        await wait_until(lambda: pending_reaches(client, 18), within_s=20)
        await asyncio.sleep(0.5)
        redis_cluster.kill_master(victim)
        await asyncio.to_thread(redis_cluster.wait_for_promotion, victim)
        outputs = await asyncio.gather(*following)
        after = await client.submit(input_ids=[24], max_new_tokens=4, request_id=ids_in(1, 3, 1, "after")[0])
        assert (await after.result(timeout=30)).token_ids == expected_tokens([24], 4)
        assert [job.finish_reason for job in jobs] == ["length"] * 18
    assert outputs == [expected_tokens([23, p, n], 300) for p in range(3) for n in range(6)]
    assert set((await terminal_counts(redis_cluster.seed_url, jobs)).values()) == {1}  # through a live node


@pytest.mark.xfail(
    strict=False,  # timing: how long the healthy streams stall depends on the failover's pace
    reason="bug: while the master of one partition is down (a Cluster that keeps serving its covered slots, "
    "cluster-require-full-coverage no), the healthy partitions' streams stall too: in most runs a 1.2-2.7 s gap, "
    "most of the outage, against 0.01 s a token (the healthy partition's raw result stream stops growing too). "
    "The worker's publisher no longer waits for the hurt partition's calls (tests/worker/test_publisher.py); "
    "suspected rest, not proven: redis-py's cluster client, after a connection error, rebuilds its slot map "
    "under one lock that every command of the process then waits for",
)
async def test_the_healthy_partitions_stream_on_while_one_partitions_master_is_down(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    for node in redis_cluster.nodes:  # the other shards answer while one is down, as a Cluster can be set up
        node.execute("CONFIG", "SET", "cluster-require-full-coverage", "no")
    queue, victim = spread_over_three_masters(redis_cluster, "bbh")
    url = redis_cluster.seed_url
    arrivals: dict[str, list[float]] = {}

    async def timed(job: AsyncJob) -> None:
        async for _ in job.stream(timeout=90):
            arrivals.setdefault(job.id, []).append(time.monotonic())

    async with (
        running_worker(url, queue, tmp_path, step_s=0.01, queue_partitions=3),
        AsyncClient(url, queue=queue, partitions=3) as client,
    ):
        healthy = [
            await client.submit(input_ids=[27, p], max_new_tokens=450, request_id=ids_in(p, 3, 1, "healthy")[0])
            for p in (0, 2)
        ]
        hurt = await client.submit(input_ids=[27, 1], max_new_tokens=450, request_id=ids_in(1, 3, 1, "hurt")[0])
        streams = [asyncio.ensure_future(timed(job)) for job in [*healthy, hurt]]
        await wait_until(lambda: len(arrivals) == 3, within_s=20)
        redis_cluster.kill_master(victim)
        killed = time.monotonic()
        await asyncio.to_thread(redis_cluster.wait_for_promotion, victim)
        promoted = time.monotonic()
        await asyncio.gather(*streams)
    assert promoted - killed > 1.0  # the outage was long enough to tell
    for job in healthy:
        during = [t for t in arrivals[job.id] if killed - 0.1 <= t <= promoted + 0.1]
        gaps = [later - earlier for earlier, later in itertools.pairwise(during)]
        assert max(gaps) < 0.5, f"partition {job.keys.partition}: a {max(gaps):.2f} s stall"


# -- the gateway ----------------------------------------------------------------------------------------------


async def test_the_gateway_with_queue_partitions_serves_completions_from_every_partition(
    redis_url: str,
    tmp_path: Path,
    gateway: Any,  # noqa: F811 - the fixture imported above
) -> None:
    queue = "bb-gateway"
    async with running_worker(redis_url, queue, tmp_path, queue_partitions=4, max_running=16):
        served = await gateway(redis_url=redis_url, queues=queue, queue_partitions=4)
        model = await served.model()
        sdk = served.sdk(timeout=30)
        prompts = [f"partitioned {i}" for i in range(16)]

        async def complete(prompt: str) -> str:
            answer = await sdk.completions.create(model=model, prompt=prompt, max_tokens=4)
            return answer.choices[0].text

        async def stream(prompt: str) -> str:
            text = ""
            async for chunk in await sdk.completions.create(model=model, prompt=prompt, max_tokens=6, stream=True):
                text += "".join(choice.text for choice in chunk.choices)
            return text

        texts = await asyncio.gather(*(complete(prompt) for prompt in prompts), stream("streamed"))
    assert texts == [scripted(prompt, 4) for prompt in prompts] + [scripted("streamed", 6)]
    async with Redis.from_url(redis_url) as raw:  # the gateway's random ids spread its requests over the partitions
        results = [key async for key in raw.scan_iter(match=f"{{llmq:{queue}*}}:result:*")]
    assert len(results) == 17
    assert len({key.split(b"}")[0] for key in results}) >= 3


def scripted(prompt: str, count: int) -> str:
    return "".join(f"<{token}>" for token in expected_tokens(list(prompt.encode()), count))


# -- llmq batch -------------------------------------------------------------------------------------------------


async def test_llmq_batch_over_four_partitions_writes_every_line_once(redis_url: str, tmp_path: Path) -> None:
    queue = "bb-batch"
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = {f"line-{i}": f"batch {i}" for i in range(12)}
    source.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": key,
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": text, "max_tokens": 4},
                }
            )
            + "\n"
            for key, text in prompts.items()
        )
    )
    command = ["batch", str(source), "-o", str(output), "--url", redis_url, "--queue", queue, "--partitions", "4"]
    async with running_worker(redis_url, queue, tmp_path, queue_partitions=4):
        assert await asyncio.to_thread(cli, command) == 0
        assert await asyncio.to_thread(cli, command) == 0  # a rerun: every line is there already
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(row["custom_id"] for row in rows) == sorted(prompts)
    for row in rows:
        assert row["response"]["body"]["choices"][0]["text"] == scripted(prompts[row["custom_id"]], 4)
    assert len({partition_of(row["response"]["request_id"], 4) for row in rows}) >= 3


# -- idle reads -----------------------------------------------------------------------------------------------


async def test_an_idle_worker_reads_a_new_request_of_any_partition_within_its_read_block_share(
    redis_url: str, tmp_path: Path
) -> None:
    """`LLMQ_READ_BLOCK_MS` / P: with 800 ms over 4 partitions, a request of any partition reaches an idle worker
    within about 200 ms (a round of reads on top)."""
    queue = "bb-idle"
    async with (
        running_worker(redis_url, queue, tmp_path, queue_partitions=4, read_block_ms=800),
        AsyncClient(redis_url, queue=queue, partitions=4) as client,
    ):
        await client.generate(input_ids=[25], max_new_tokens=1, timeout=20)  # groups made, worker idle
        waits = []
        for n in range(12):
            await asyncio.sleep(0.05 + 0.07 * n % 0.3)  # land at different points of the block
            started = time.monotonic()
            job = await client.submit(input_ids=[26, n], max_new_tokens=1, request_id=ids_in(n % 4, 4)[0])
            await job.result(timeout=20)
            waits.append(time.monotonic() - started)
    assert max(waits) < 0.6, [round(wait, 3) for wait in waits]
