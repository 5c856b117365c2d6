"""The service on a real Redis Cluster and a real Sentinel set: every public operation, wrong URLs refused up front,
and a primary killed (or failed over) while requests stream, with nothing lost.

Workers run in-process on the scripted engine (testing/scripted_engine.py): its tokens are a pure function of the
prompt and the position, so a stream that survived a failover is checked token for token against the idle answer.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from client import AsyncClient, Cancelled, Client
from client.cli import main as cli
from client.connection import WrongDeployment, check_async, open_async
from client.store import Keys
from testing.certificates import TLSFiles, tls_files
from testing.redis_topologies import RedisClusterSet, SentinelSet
from testing.scripted_engine import expected_tokens
from tests.polling import wait_until
from tests.worker.conftest import serving

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
TOKENS = 300  # at 10 ms a step a request streams for 3 s: long enough to be cut by a failover


async def test_every_public_operation_on_a_cluster_with_queues_on_two_shards(
    redis_cluster: RedisClusterSet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = redis_cluster.queues_on_different_masters()
    url = redis_cluster.seed_url
    async with serving(url, first, tmp_path), serving(url, second, tmp_path), AsyncClient(url, queue=first) as client:
        await client.check()
        # one client follows jobs of two queues whose keys live on different shards
        jobs = [await client.submit(f"hello {i}", max_new_tokens=8, queue=(first, second)[i % 2]) for i in range(6)]
        results = await asyncio.gather(*(job.result(timeout=30) for job in jobs))
        for i, result in enumerate(results):
            assert result.token_ids == expected_tokens(list(f"hello {i}".encode()), 8)
            assert result.finish_reason == "length"
        long = await client.submit("cancel me", max_new_tokens=TOKENS, queue=second)
        async for _ in long.stream(timeout=30):
            await long.cancel()  # by sharded pub/sub, to the second queue's shard
            break
        with pytest.raises(Cancelled):
            await long.result(timeout=30)
        for queue in (first, second):
            status = await client.status(queue=queue)
            assert len(status.workers) == 1 and status.depth == 0
        with Client(url, queue=second) as sync_client:  # in a thread: the workers share this event loop
            await asyncio.to_thread(sync_client.check)
            result = await asyncio.to_thread(sync_client.generate, "sync", max_new_tokens=4, timeout=30)
            assert result.token_ids == expected_tokens(list(b"sync"), 4)
        assert await asyncio.to_thread(cli, ["status", "--url", url, "--queue", first, "--json"]) == 0
        assert f'"queue": "{first}"' in capsys.readouterr().out


async def test_the_gateway_serves_queues_on_two_shards(
    redis_cluster: RedisClusterSet, tmp_path: Path, gateway: Any
) -> None:
    first, second = redis_cluster.queues_on_different_masters()
    url = redis_cluster.seed_url
    async with serving(url, first, tmp_path, model="model-a"), serving(url, second, tmp_path, model="model-b"):
        served = await gateway(redis_url=url, queues=f"{first},{second}")
        models = {str(tmp_path / "model-a"): first, str(tmp_path / "model-b"): second}

        async def both_listed() -> bool:
            async with served.http() as http:
                return len((await http.get("/v1/models")).json()["data"]) == 2

        await wait_until(both_listed)
        async with served.http() as http:
            health = await http.get("/health")
        assert health.status_code == 200 and health.json()["models"] == sorted(models)
        sdk = served.sdk()
        for model in models:
            answer = await sdk.completions.create(model=model, prompt="hi", max_tokens=3)
            assert answer.choices[0].text == "".join(f"<{t}>" for t in expected_tokens(list(b"hi"), 3))


async def test_a_plain_url_to_a_cluster_node_or_a_sentinel_is_refused_naming_the_url_that_works(
    redis_cluster: RedisClusterSet, sentinel_set: SentinelSet, capsys: pytest.CaptureFixture[str]
) -> None:
    node = redis_cluster.masters()[0]
    for url, scheme in ((node.url, "redis+cluster://"), (sentinel_set.sentinels[0].url, "redis+sentinel://")):
        redis = open_async(url)
        with pytest.raises(WrongDeployment, match=scheme.replace("+", r"\+")):
            await check_async(redis, url)
        await redis.aclose()
    # the CLI on a plain URL to a node that does not own the queue's slot: explained, not a bare MOVED payload
    other = redis_cluster.queue_on(redis_cluster.masters()[1])
    assert await asyncio.to_thread(cli, ["status", "--url", node.url, "--queue", other]) == 4  # Exit.UNAVAILABLE
    assert "redis+cluster://" in capsys.readouterr().err


def test_the_worker_process_refuses_a_wrong_url_before_loading_its_model(
    redis_cluster: RedisClusterSet, sentinel_set: SentinelSet, tmp_path: Path
) -> None:
    wrong = {
        redis_cluster.masters()[0].url: "redis+cluster://",
        sentinel_set.sentinels[0].url: "redis+sentinel://",
        sentinel_set.url.partition("?")[0].rpartition("/")[0]: "names its service",  # no service name
        "http://127.0.0.1:1": "not a Redis URL",
    }
    for url, message in wrong.items():
        run = subprocess.run(
            [sys.executable, "-m", "worker", "--redis-url", url, "--model", str(tmp_path / "no-such-model")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode != 0 and message in run.stderr, run.stderr
        assert "Traceback" not in run.stderr and "no-such-model" not in run.stderr  # refused before the model
        assert "secret" not in run.stderr


async def _stream_through(client: AsyncClient, count: int, fault: asyncio.Future[None]) -> list[list[int]]:
    """`count` requests streamed to the end while `fault` happens; each one's tokens in order, gaps checked."""
    jobs = [await client.submit(f"request {i}", max_new_tokens=TOKENS) for i in range(count)]

    async def follow(job: object) -> list[int]:
        tokens: list[int] = []
        async for delta in job.stream(timeout=60):  # type: ignore[attr-defined]
            assert delta.seq == len(tokens), "no gap, no duplicate"
            tokens += delta.token_ids
        return tokens

    outputs = await asyncio.gather(*(follow(job) for job in jobs), fault)
    return list(outputs[:count])


def _check_outputs(outputs: list[list[int]]) -> None:
    for i, tokens in enumerate(outputs):
        assert tokens == expected_tokens(list(f"request {i}".encode()), TOKENS), f"request {i}"


async def test_a_cluster_master_killed_while_requests_stream_loses_nothing(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    queue = redis_cluster.queues_on_different_masters()[0]
    url = redis_cluster.seed_url
    async with serving(url, queue, tmp_path, step_s=0.01), AsyncClient(url, queue=queue) as client:

        async def kill_the_queues_master() -> None:
            await asyncio.sleep(1.0)
            master = redis_cluster.master_for_key(Keys(queue).requests)
            redis_cluster.kill_master(master)
            await asyncio.to_thread(redis_cluster.wait_for_promotion, master)

        _check_outputs(await _stream_through(client, 20, asyncio.ensure_future(kill_the_queues_master())))
        after = await client.submit("after", max_new_tokens=5)
        assert (await after.result(timeout=30)).token_ids == expected_tokens(list(b"after"), 5)


@pytest.mark.parametrize("fault", ["kill -9", "SENTINEL FAILOVER"])
async def test_a_sentinel_master_lost_while_requests_stream_loses_nothing(
    sentinel_set: SentinelSet, tmp_path: Path, fault: str
) -> None:
    """Through SENTINEL FAILOVER the old master lives on as a replica: a worker still connected to it reads
    READONLY, which must send it to the new master, not wedge it."""
    url = sentinel_set.url
    async with serving(url, "default", tmp_path, step_s=0.01), AsyncClient(url) as client:

        async def lose_the_master() -> None:
            await asyncio.sleep(1.0)
            if fault == "kill -9":
                old = sentinel_set.kill_master()
                await asyncio.to_thread(sentinel_set.wait_for_new_master, old)
            else:
                await asyncio.to_thread(sentinel_set.failover)

        _check_outputs(await _stream_through(client, 20, asyncio.ensure_future(lose_the_master())))
        after = await client.submit("after", max_new_tokens=5)
        assert (await after.result(timeout=30)).token_ids == expected_tokens(list(b"after"), 5)
        assert len((await client.status()).workers) == 1


async def test_one_queue_over_three_partitions_spreads_over_the_shards_of_a_cluster(
    redis_cluster: RedisClusterSet, tmp_path: Path
) -> None:
    """`LLMQ_QUEUE_PARTITIONS=3`: the queue's three hash tags land on different masters, and one worker and one
    client serve and follow requests in all of them; status adds the partitions up."""
    queue = next(
        f"p{i}"
        for i in range(1000)
        if len({redis_cluster.master_for_key(keys.requests).port for keys in Keys(f"p{i}").partitioned(3)}) == 3
    )
    url = redis_cluster.seed_url
    async with serving(url, queue, tmp_path, queue_partitions=3), AsyncClient(url, queue=queue, partitions=3) as client:
        jobs = [await client.submit(input_ids=[3, i], max_new_tokens=6) for i in range(45)]
        results = await asyncio.gather(*(job.result(timeout=60) for job in jobs))
        assert [r.token_ids for r in results] == [expected_tokens([3, i], 6) for i in range(45)]
        assert {job.keys.partition for job in jobs} == {0, 1, 2}
        status = await client.status()
        assert len(status.partitions) == 3 and status.depth == sum(p.depth for p in status.partitions)
        assert [w.id for w in status.workers]  # the worker's heartbeat, in partition 0


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make test certificates")
    return tls_files(tmp_path_factory.mktemp("tls"))


async def test_a_tls_only_cluster_and_sentinel_set_serve_through_rediss_urls_and_the_ca_file(
    tls: TLSFiles, tmp_path: Path
) -> None:
    """`rediss+cluster://` and `rediss+sentinel://` with a CA file, against nodes that speak TLS only (their
    replication, cluster bus and sentinels too; no plain port at all): the worker's connection, both clients and
    `check()`."""
    ca = str(tls.ca)
    with RedisClusterSet(tmp_path / "cluster", replicas=0, tls=tls) as cluster:
        queue = cluster.queue_on(cluster.masters()[1])
        await _serve_over_tls(cluster.seed_url, queue, ca, tmp_path)
    with SentinelSet(tmp_path / "sentinel", password="data secret", tls=tls) as sentinels:
        await _serve_over_tls(sentinels.url, "default", ca, tmp_path)


async def _serve_over_tls(url: str, queue: str, ca: str, tmp_path: Path) -> None:
    assert url.startswith("rediss+")
    async with serving(url, queue, tmp_path, redis_ca_file=ca), AsyncClient(url, queue=queue, ssl_ca_certs=ca) as c:
        await c.check()
        result = await (await c.submit(input_ids=[3, 4], max_new_tokens=5)).result(timeout=30)
        assert result.token_ids == expected_tokens([3, 4], 5)

        def through_the_sync_client() -> list[int]:
            with Client(url, queue=queue, ssl_ca_certs=ca) as sync:
                sync.check()
                return sync.generate(input_ids=[5], max_new_tokens=3, timeout=30).token_ids

        assert await asyncio.to_thread(through_the_sync_client) == expected_tokens([5], 3)
