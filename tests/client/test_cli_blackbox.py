"""Black-box tests of the client library (`Client`, `AsyncClient`, `Job`, `submit_many`, `reply_to`) and the
`llmq` CLI (`submit`, `status`, `cancel`) as a heavy, careless or hostile user drives them, against real
processes: a private redis-server with AOF and two `python -m worker` processes on a tiny random model. Only the
README, `--help` and the documented API are used. The destructive tests (SIGKILL a worker, restart Redis) run
last. It found seven bugs, all fixed since.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from client import (
    AsyncClient,
    AsyncJob,
    Cancelled,
    Client,
    ClientClosed,
    InvalidRequest,
    Job,
    QueueFull,
    RequestExpired,
    RequestFailed,
    ResultTimeout,
    protocol,
    store,
)
from client.cli.exits import Exit
from testing.tiny_models import save_tiny_model
from tests.client.cli_support import LLMQ, PYTHON, ROOT, Fleet, cli, env, greedy, kill, poll
from tests.gateway.batch_support import redis_with_aof
from worker.embedded_redis import RedisServer

pytestmark = pytest.mark.redis

SHORT_IDS = [3, 4, 5]
SHORT = {"input_ids": SHORT_IDS, "max_new_tokens": 8}
LONG = {"prompt": "The quick brown fox", "max_new_tokens": 200}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    folder = Path(tmp_path_factory.mktemp("client-cli"))
    model_dir = save_tiny_model(folder / "model", "llama", max_positions=512)
    fleet = Fleet(folder, redis_with_aof(folder), model_dir)
    try:
        fleet.start_worker("wa")
        fleet.start_worker("wb")
        fleet.wait_workers(["wa", "wb"])
        with Client(fleet.url) as llmq:  # both workers idle: the reference outputs
            fleet.baseline["short"] = llmq.generate(**greedy(**SHORT), timeout=60).token_ids
            fleet.baseline["long"] = llmq.generate(**greedy(**LONG), timeout=60).token_ids
        assert len(fleet.baseline["short"]) == 8 and len(fleet.baseline["long"]) == 200
        yield fleet
    finally:
        fleet.stop()


def contiguous(deltas: list[Any]) -> list[int]:
    """The tokens of a stream, checking each delta's `seq` is where the previous one ended (no gap/duplicate)."""
    tokens: list[int] = []
    for delta in deltas:
        assert delta.seq == len(tokens), f"seq {delta.seq} after {len(tokens)} tokens"
        tokens += delta.token_ids
    return tokens


# ------------------------------------------------------------------------------------------ heavy use


async def test_one_async_client_awaits_hundreds_of_jobs_every_way(fleet: Fleet) -> None:
    """300 jobs in flight from one AsyncClient: streamed, awaited, cancelled mid-stream, timed out then resumed,
    attached from a second client; every complete output equals the idle worker's, every partial one is a prefix."""
    short = fleet.baseline["short"]
    async with AsyncClient(fleet.url) as llmq, AsyncClient(fleet.url) as other:
        jobs = await asyncio.gather(*[llmq.submit(**greedy(**SHORT)) for _ in range(300)])
        assert len({job.id for job in jobs}) == 300

        async def follow(index: int, job: AsyncJob) -> tuple[str, list[int]]:
            mode = index % 5
            if mode == 0:  # cancel on the first delta
                deltas = []
                async for delta in job.stream(timeout=60):
                    deltas.append(delta)
                    await job.cancel()
                tokens = contiguous(deltas)
                try:
                    result = await job.result(timeout=60)
                except Cancelled as cancelled:
                    assert cancelled.result.token_ids == tokens
                    return "cancelled", tokens
                assert result.token_ids == tokens
                return "finished", tokens
            if mode == 1:  # a too-short timeout, then a later result()
                try:
                    return "quick", (await job.result(timeout=0.001)).token_ids
                except ResultTimeout as timeout:
                    assert job.id in str(timeout)
                return "resumed", (await job.result(timeout=60)).token_ids
            if mode == 2:
                return "attached", (await AsyncJob.attach(other, job.id).result(timeout=60)).token_ids
            if mode == 3:
                tokens = contiguous([delta async for delta in job.stream(timeout=60)])
                assert (await job.result(timeout=5)).token_ids == tokens
                return "streamed", tokens
            return "awaited", (await job.result(timeout=60)).token_ids

        outcomes = await asyncio.wait_for(asyncio.gather(*[follow(i, job) for i, job in enumerate(jobs)]), 90)
    for kind, tokens in outcomes:
        if kind == "cancelled":
            assert tokens == short[: len(tokens)]
        else:
            assert tokens == short, kind


def test_one_sync_client_serves_a_hundred_threads(fleet: Fleet) -> None:
    short = fleet.baseline["short"]
    with Client(fleet.url) as llmq:

        def one(index: int) -> list[int]:
            job = llmq.submit(**greedy(**SHORT))
            if index % 3 == 0:
                return Job.attach(llmq, job.id).result(timeout=60).token_ids
            tokens = contiguous(list(job.stream(timeout=60)))
            assert job.result(timeout=5).token_ids == tokens
            return tokens

        with ThreadPoolExecutor(100) as pool:
            outputs = list(pool.map(one, range(200), timeout=90))
    assert all(tokens == short for tokens in outputs)


# --------------------------------------------------------------------------------- ids, attach, cancel


def test_resubmitting_an_id_with_another_body_follows_the_first(fleet: Fleet) -> None:
    with Client(fleet.url) as llmq:
        first = llmq.submit(**greedy(**SHORT), request_id="dup-sync")
        second = llmq.submit(prompt="a completely different body", max_new_tokens=3, request_id="dup-sync")
        assert second.id == "dup-sync"
        assert first.result(timeout=60).token_ids == fleet.baseline["short"]
        again = second.result(timeout=60)
        assert again.token_ids == fleet.baseline["short"] and again.usage.prompt_tokens == len(SHORT_IDS)


async def test_concurrent_duplicate_submits_generate_once(fleet: Fleet) -> None:
    """20 clients race the same id with different bodies: one generation, one completion on the reply stream."""
    redis = Redis.from_url(fleet.url)
    reply = store.Keys("default").reply("dups")
    clients = [AsyncClient(fleet.url) for _ in range(4)]
    try:
        jobs = await asyncio.gather(
            *[
                clients[i % 4].submit(
                    input_ids=[3, 4, 5 + i % 7], max_new_tokens=8, request_id="dup-race", reply_to="dups"
                )
                for i in range(20)
            ]
        )
        results = await asyncio.gather(*[job.result(timeout=60) for job in jobs])
        assert len({tuple(result.token_ids) for result in results}) == 1
        poll(lambda: redis.xlen(reply) >= 1, 10, what="the completion")
        completions = [protocol.decode_completion(fields[b"m"]) for _, fields in redis.xrange(reply)]
        assert [completion.id for completion in completions] == ["dup-race"]
        assert list(completions[0].ids) == results[0].token_ids
    finally:
        for llmq in clients:
            await llmq.aclose()
        redis.close()


def test_attach_and_cancel_of_unknown_or_finished_ids(fleet: Fleet) -> None:
    with Client(fleet.url) as llmq:
        started = time.monotonic()
        with pytest.raises(ResultTimeout) as waited:
            Job.attach(llmq, "no-such-request").result(timeout=0.5)
        assert "no-such-request" in str(waited.value) and time.monotonic() - started < 5
        with pytest.raises(ResultTimeout):
            list(Job.attach(llmq, "no-such-request-2").stream(timeout=0.5))
        Job.attach(llmq, "no-such-request-3").cancel()  # harmless
        done = llmq.submit(**greedy(**SHORT))
        assert done.result(timeout=60).finish_reason == "length"
        done.cancel()  # after the end: changes nothing
        assert Job.attach(llmq, done.id).result(timeout=10).token_ids == fleet.baseline["short"]
    ran = cli("cancel", "no-such-request-4", "--url", fleet.url)
    assert "Traceback" not in ran.stderr and ran.returncode == Exit.NOT_FOUND
    assert "no request 'no-such-request-4' on queue 'default'" in ran.stderr


# ---------------------------------------------------------------------------------------------- deadlines

NOW = dt.datetime.now


@pytest.mark.parametrize(
    "deadline, expected",
    [
        (30, "length"),
        (dt.timedelta(minutes=5), "length"),
        (dt.datetime(9999, 12, 31, tzinfo=dt.UTC), "length"),
        ("naive-future", "length"),
        ("aware-future", "length"),
        (dt.datetime(2000, 1, 1), RequestExpired),
        (dt.datetime(2000, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=-11))), RequestExpired),
        ("naive-past", RequestExpired),
        (-1, InvalidRequest),
        (0, InvalidRequest),
        (dt.timedelta(seconds=-5), InvalidRequest),
        (float("nan"), InvalidRequest),
        (float("inf"), InvalidRequest),
        (1e300, InvalidRequest),
        (True, TypeError),
        ("5", TypeError),
    ],
)
def test_deadlines(fleet: Fleet, deadline: Any, expected: Any) -> None:
    relative = {
        "naive-future": lambda: NOW() + dt.timedelta(seconds=60),
        "aware-future": lambda: dt.datetime.now(dt.timezone(dt.timedelta(hours=13))) + dt.timedelta(seconds=60),
        "naive-past": lambda: NOW() - dt.timedelta(seconds=60),
    }
    if isinstance(deadline, str) and deadline in relative:
        deadline = relative[deadline]()
    with Client(fleet.url) as llmq:
        if isinstance(expected, str):
            assert llmq.submit(**greedy(**SHORT), deadline=deadline).result(timeout=60).finish_reason == expected
        elif expected is RequestExpired:
            job = llmq.submit(**greedy(**SHORT), deadline=deadline)
            with pytest.raises(RequestExpired) as expired:
                job.result(timeout=60)
            assert expired.value.code == "expired"
        else:
            with pytest.raises(expected):
                llmq.submit(**greedy(**SHORT), deadline=deadline)


# ------------------------------------------------------------------------------------- backpressure, bulk


def test_queue_full_is_typed_and_resubmitting_an_id_is_not_refused(fleet: Fleet) -> None:
    queue = "parked"  # no worker serves it: its backlog only grows
    with Client(fleet.url, queue=queue, max_queue_len=3, result_ttl=60) as llmq:
        jobs = [llmq.submit(**SHORT, request_id=f"parked-{i}") for i in range(3)]
        with pytest.raises(QueueFull):
            llmq.submit(**SHORT)
        assert llmq.submit(**SHORT, request_id="parked-0").id == "parked-0"  # idempotent, not a new entry
        assert llmq.status().depth == 3
        with pytest.raises(ResultTimeout):
            jobs[0].result(timeout=0.2)
    shown = cli("status", "--json", "--queue", queue, "--url", fleet.url)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["depth"] == 3


def test_submit_many_waits_while_the_queue_is_full(fleet: Fleet) -> None:
    with Client(fleet.url, max_queue_len=2) as llmq:
        outcomes = list(llmq.submit_many((greedy(**SHORT) for _ in range(12)), window=8, timeout=60))
    assert sorted(outcome.index for outcome in outcomes) == list(range(12))
    assert [outcome.error for outcome in outcomes if outcome.error] == []
    short = fleet.baseline["short"]
    assert all(outcome.result is not None and outcome.result.token_ids == short for outcome in outcomes)


def test_submit_many_reads_an_endless_iterable_lazily_and_stops_on_break(fleet: Fleet) -> None:
    read = itertools.count()

    def endless() -> Iterator[dict[str, Any]]:
        while True:
            next(read)
            yield greedy(**SHORT)

    with Client(fleet.url) as llmq:
        threads = threading.active_count()
        for got, outcome in enumerate(llmq.submit_many(endless(), window=8, timeout=60), 1):
            assert outcome.error is None and outcome.result is not None
            assert outcome.result.token_ids == fleet.baseline["short"]
            if got == 40:
                break
        consumed = next(read)
        assert 40 <= consumed <= 40 + 8 + 2, consumed
        poll(lambda: threading.active_count() <= threads + 1, 10, what="submit_many's threads gone")
        assert next(read) == consumed + 1  # nothing read after the break
        poll(lambda: llmq.status().depth == 0, 20, what="the requests in flight at the break finish")


async def test_async_submit_many_endless_iterable_break(fleet: Fleet) -> None:
    read = itertools.count()

    def endless() -> Iterator[dict[str, Any]]:
        while True:
            next(read)
            yield greedy(**SHORT)

    async with AsyncClient(fleet.url) as llmq:
        outcomes = llmq.submit_many(endless(), window=8, timeout=60)
        got = 0
        async for outcome in outcomes:  # type: ignore[attr-defined]
            assert outcome.result is not None and outcome.result.token_ids == fleet.baseline["short"]
            got += 1
            if got == 40:
                break
        await outcomes.aclose()  # type: ignore[attr-defined]
        consumed = next(read)
        assert 40 <= consumed <= 40 + 8 + 2, consumed
        for _ in range(20):
            await asyncio.sleep(0.05)
        assert next(read) == consumed + 1


def test_reply_to_pipeline_gets_one_completion_per_request(fleet: Fleet) -> None:
    redis = Redis.from_url(fleet.url)
    stream = store.Keys("default").reply("stage2")
    redis.xgroup_create(stream, "indexer", id="0", mkstream=True)
    with Client(fleet.url) as llmq:
        jobs = [llmq.submit(**greedy(**SHORT), reply_to="stage2", request_id=f"rt-{i}") for i in range(15)]
        llmq.submit(**greedy(**SHORT), reply_to="stage2", request_id="rt-0")  # a resubmit adds nothing
        cancelled = llmq.submit(**greedy(**LONG), reply_to="stage2", request_id="rt-cancel")
        llmq.submit(input_ids=[3] * 600, max_new_tokens=4, reply_to="stage2", request_id="rt-refused")
        for _ in cancelled.stream(timeout=60):
            cancelled.cancel()
        results = {job.id: job.result(timeout=60) for job in jobs}
    seen: dict[str, list[Any]] = {}

    def read() -> bool:
        for _, entries in redis.xreadgroup("indexer", "indexer-1", {stream: ">"}, count=100, block=100) or []:
            for entry_id, fields in entries:
                completion = protocol.decode_completion(fields[b"m"])
                seen.setdefault(completion.id, []).append(completion)
                redis.xack(stream, "indexer", entry_id)
        return len(seen) >= 17

    poll(read, 20, every_s=0, what="17 completions")
    assert {key: len(value) for key, value in seen.items() if len(value) != 1} == {}
    for request_id, result in results.items():
        completion = seen[request_id][0]
        assert completion.done is not None and completion.text == result.text
        assert list(completion.ids) == result.token_ids
    assert seen["rt-cancel"][0].done.finish_reason == "cancelled"
    assert seen["rt-refused"][0].error.code == "invalid_request"
    redis.close()


# ----------------------------------------------------------------------------------------- client lifecycle


def test_closing_a_sync_client_while_a_thread_awaits(fleet: Fleet) -> None:
    llmq = Client(fleet.url)
    job = llmq.submit(**greedy(**LONG))
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["result"] = job.result(timeout=30)
        except BaseException as error:  # what the waiter sees is the point
            outcome["error"] = error

    waiter = threading.Thread(target=wait)
    waiter.start()
    for _ in Job.attach(llmq, job.id).stream(timeout=30):
        break  # it is generating
    llmq.close()
    waiter.join(20)
    assert not waiter.is_alive()
    assert isinstance(outcome.get("error"), ClientClosed), repr(outcome)


async def test_closing_an_async_client_while_a_task_awaits(fleet: Fleet) -> None:
    llmq = AsyncClient(fleet.url)
    job = await llmq.submit(**greedy(**LONG))
    waiter = asyncio.create_task(job.result())  # no timeout: the caller relies on the client
    async for _ in job.stream(timeout=30):
        break
    await llmq.aclose()
    done, _ = await asyncio.wait([waiter], timeout=3)
    if not done:
        waiter.cancel()
    assert done, "job.result() still waiting 3 s after aclose()"
    assert isinstance(waiter.exception(), ClientClosed), repr(waiter.exception())


@pytest.mark.parametrize("use_async", [False, True])
async def test_using_a_client_after_close(fleet: Fleet, use_async: bool) -> None:
    """Submit refuses with ClientClosed; nothing is queued to hang on."""
    if use_async:
        aclient = AsyncClient(fleet.url)
        await (await aclient.submit(**greedy(**SHORT))).result(timeout=30)  # its reader has run
        await aclient.aclose()
        with pytest.raises(ClientClosed):
            await aclient.submit(**greedy(**SHORT))
    else:
        client = Client(fleet.url)
        client.submit(**greedy(**SHORT)).result(timeout=30)  # its reader has run
        client.close()
        with pytest.raises(ClientClosed):
            client.submit(**greedy(**SHORT))


CARELESS = """
import asyncio, sys
from client import AsyncClient

async def main():
    llmq = AsyncClient(sys.argv[1])  # never closed: a careless script
    job = await llmq.submit(input_ids=[3, 4, 5], max_new_tokens=4, temperature=0)
    print((await job.result(timeout=30)).finish_reason, flush=True)

asyncio.run(main())
print("exited", flush=True)
"""


def test_asyncio_run_returns_with_an_unclosed_async_client(fleet: Fleet, tmp_path: Path) -> None:
    script = tmp_path / "careless.py"
    script.write_text(CARELESS)
    process = subprocess.Popen([PYTHON, str(script), fleet.url], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env())
    assert process.stdout is not None
    # The result first, however long a loaded machine takes to start Python and generate (the script's own result
    # timeout bounds it); then asyncio.run must return at once: 6 s is for the exit alone, which a client's reader
    # left holding the loop would outlast. (One bound over both failed under CI load before the result came.)
    out = process.stdout.readline()
    try:
        process.wait(timeout=6)
    except subprocess.TimeoutExpired:
        process.kill()
    out += process.communicate()[0]
    assert out.split() == ["length", "exited"], out


async def test_async_client_moves_between_event_loops(fleet: Fleet) -> None:
    """One AsyncClient used from two event loops in turn (each loop in its own thread), closed in the last."""
    llmq = AsyncClient(fleet.url)

    async def use(close: bool) -> list[int]:
        try:
            job = await llmq.submit(**greedy(**SHORT))
            return (await job.result(timeout=20)).token_ids
        finally:
            if close:
                await llmq.aclose()

    def in_new_loop(close: bool) -> list[int]:
        return asyncio.run(asyncio.wait_for(use(close), 30))

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(in_new_loop, False).result(40) == fleet.baseline["short"]
        assert pool.submit(in_new_loop, True).result(40) == fleet.baseline["short"]


def test_wrong_credentials_are_refused_without_leaking_the_password(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, "--requirepass", "right-one").start()
    try:
        secret = "Wr0ng%40Secret"  # URL-encoded '@'
        urls = [
            f"redis://:{secret}@127.0.0.1:{server.port}/0",
            f"redis://nobody:{secret}@127.0.0.1:{server.port}/0",
        ]
        leaks = [secret, "Wr0ng@Secret"]
        for url in urls:
            with pytest.raises(Exception) as refused, Client(url) as llmq:
                llmq.submit(**SHORT)
            assert not any(leak in repr(refused.value) + str(refused.value) for leak in leaks)

            async def submit(url: str = url) -> None:
                async with AsyncClient(url) as llmq:
                    await llmq.submit(**SHORT)

            with pytest.raises(Exception) as refused_async:
                asyncio.run(submit())
            assert not any(leak in repr(refused_async.value) for leak in leaks)
            commands = [["submit", "hi"], ["status", "--json"], ["cancel", "x"]] if "nobody" in url else [["status"]]
            for args in commands:
                ran = cli(*args, timeout_s=30, LLMQ_REDIS_URL=url)
                output = ran.stdout + ran.stderr
                assert ran.returncode == Exit.UNAVAILABLE and "Traceback" not in output, output
                assert not any(leak in output for leak in leaks), output
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_submit_outputs_agree_with_the_client(fleet: Fleet) -> None:
    with Client(fleet.url) as llmq:
        expected = llmq.generate(prompt="hello", max_new_tokens=12, temperature=0, timeout=60)
    common = ["hello", "--max-new-tokens", "12", "--temperature", "0", "--url", fleet.url]
    as_json = cli("submit", *common, "--json")
    assert as_json.returncode == 0, as_json.stderr
    answer = json.loads(as_json.stdout)
    assert answer["token_ids"] == expected.token_ids and answer["text"] == expected.text
    assert answer["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 12
    streamed = cli("submit", *common, "--priority", "interactive", "--seed", "7")
    whole = cli("submit", *common, "--no-stream", "--deadline", "60")
    for ran in (streamed, whole):
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.rstrip("\n") == expected.text
    from_env = subprocess.run([LLMQ, "submit", *common[:-2], "--json"], capture_output=True, text=True, timeout=60,
                              cwd=ROOT, env=env(LLMQ_REDIS_URL=fleet.url))  # fmt: skip
    assert from_env.returncode == 0 and json.loads(from_env.stdout)["token_ids"] == expected.token_ids


@pytest.mark.parametrize(
    "args",
    [
        ["--max-new-tokens", "0"],
        ["--max-new-tokens", "99999999"],
        ["--max-new-tokens", "abc"],
        ["--temperature", "nan"],
        ["--temperature", "-1"],
        ["--top-p", "0"],
        ["--top-k", "-3"],
        ["--seed", "1e3"],
        ["--deadline", "-1"],
        ["--deadline", "inf"],
        ["--priority", "urgent"],
        ["--stop", "x"] * 50,
        ["--timeout", "-1"],
    ],
)
def test_cli_submit_bad_flags_are_clean_errors(fleet: Fleet, args: list[str]) -> None:
    with Client(fleet.url) as llmq:
        before = llmq.status().depth
    ran = cli("submit", "hello", "--url", fleet.url, *args, timeout_s=30)
    assert ran.returncode == Exit.USAGE, (ran.stdout, ran.stderr)
    assert "Traceback" not in ran.stderr and "error" in ran.stderr, ran.stderr
    with Client(fleet.url) as llmq:
        assert llmq.status().depth <= before


def test_cli_empty_prompt_and_odd_prompts(fleet: Fleet) -> None:
    empty = cli("submit", "", "--url", fleet.url, "--max-new-tokens", "2")
    assert empty.returncode != 0 and "Traceback" not in empty.stderr
    for prompt in ["--", "-x looks like a flag", "emoji 😀 and\nnewline", "日本語"]:
        ran = cli("submit", "--url", fleet.url, "--max-new-tokens", "3", "--json", "--", prompt)
        assert ran.returncode == 0, (prompt, ran.stderr)
        answer = json.loads(ran.stdout)
        # The CLI samples (its default temperature, no seed), so the tiny model may draw EOS before the limit: the
        # wire's finish reason for that is "eos" ("stop" is a stop string's, and this request has none).
        ended = (answer["finish_reason"], answer["usage"]["completion_tokens"])
        assert ended == ("length", 3) or (ended[0] == "eos" and 1 <= ended[1] <= 3), (prompt, ended)


def test_cli_timeout_then_cancel_by_id(fleet: Fleet) -> None:
    ran = cli("submit", "count", "--url", fleet.url, "--max-new-tokens", "450", "--timeout", "0.001", "--no-stream")
    assert ran.returncode == Exit.TIMEOUT and "Traceback" not in ran.stderr, ran.stderr
    first, *_, last = ran.stderr.strip().splitlines()
    request_id = first.split()[-1]  # "llmq: request <id>"
    assert request_id in last, ran.stderr  # the timeout names the request it waited for
    cancelled = cli("cancel", request_id, "--url", fleet.url)
    assert cancelled.returncode == 0, cancelled.stderr
    with Client(fleet.url) as llmq:
        try:  # the tiny model may finish 450 tokens before the cancel command has started
            finished = Job.attach(llmq, request_id).result(timeout=30)
        except Cancelled as stopped:
            assert len(stopped.result.token_ids) < 450
        else:
            assert finished.finish_reason in ("eos", "length") and len(finished.token_ids) <= 450
        poll(lambda: all(worker.running == 0 for worker in llmq.status().workers), 10, what="workers idle")


def test_cli_status_json_and_watch(fleet: Fleet) -> None:
    shown = cli("status", "--json", "--url", fleet.url, "--stale-after", "5")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["queue"] == "default" and {"wa", "wb"} <= {worker["id"] for worker in status["workers"]}
    assert {lane["lane"] for lane in status["lanes"]} == {"interactive", "default", "batch"}
    assert cli("status", "--url", fleet.url, "--queue", "never-used", "--json").returncode == 0

    watch = subprocess.Popen([LLMQ, "status", "--watch", "0.1", "--url", fleet.url], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=ROOT, env=env())  # fmt: skip
    assert watch.stdout is not None
    try:
        frames = 0
        buffer = b""
        while frames < 3:
            chunk = watch.stdout.read1(4096)  # type: ignore[attr-defined]
            assert chunk, "watch exited"
            buffer += chunk
            frames = buffer.count(b"\x1b[2J")
        watch.send_signal(signal.SIGINT)
        _, errors = watch.communicate(timeout=10)  # reads on: a full stdout pipe would block its exit
        assert watch.returncode == 0 and b"Traceback" not in errors
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def test_cli_output_into_a_closed_pipe_is_quiet(fleet: Fleet) -> None:
    for args in (["status", "--watch", "0.05"], ["submit", "hello", "--max-new-tokens", "400"]):
        process = subprocess.Popen([LLMQ, *args, "--url", fleet.url], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, cwd=ROOT, env=env())  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        process.stdout.read(3)
        process.stdout.close()  # the reader (`head -c 3`) is gone
        try:
            process.wait(20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert b"Traceback" not in process.stderr.read()


# ------------------------------------------------------------------------- faults (destructive: run last)


async def test_sigkill_a_worker_mid_stream_resumes_without_gap(fleet: Fleet) -> None:
    long = fleet.baseline["long"]
    async with AsyncClient(fleet.url) as llmq, AsyncClient(fleet.url) as watcher:
        job = await llmq.submit(**greedy(**LONG))
        short_jobs = [await llmq.submit(**greedy(**SHORT)) for _ in range(10)]
        deltas = []
        killed = None
        async for delta in job.stream(timeout=60):
            deltas.append(delta)
            if killed is None and sum(len(d.token_ids) for d in deltas) >= 10:
                status = await watcher.status(stale_after_s=2)
                busy = [worker.id for worker in status.workers if worker.running > 0]
                if busy:
                    killed = busy[0]
                    kill(fleet.worker(killed))
        assert killed is not None
        assert contiguous(deltas) == long
        assert (await job.result(timeout=10)).token_ids == long
        attached = await AsyncJob.attach(watcher, job.id).result(timeout=10)
        assert attached.token_ids == long
        for short_job in short_jobs:
            assert (await short_job.result(timeout=60)).token_ids == fleet.baseline["short"]
    survivors = [name for name in ("wa", "wb") if name != killed]
    assert fleet.worker(survivors[0]).alive()


async def test_redis_restart_with_aof_while_clients_stream(fleet: Fleet) -> None:
    long = fleet.baseline["long"]
    async with AsyncClient(fleet.url) as llmq:
        jobs = [await llmq.submit(**greedy(**LONG)) for _ in range(3)]
        streams = [[] for _ in jobs]  # type: list[list[Any]]
        restarted = asyncio.Event()

        async def follow(index: int, job: AsyncJob) -> None:
            async for delta in job.stream(timeout=90):
                streams[index].append(delta)

        async def restart() -> None:
            while sum(len(d.token_ids) for d in streams[0]) < 10:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(fleet.redis.stop)
            await asyncio.sleep(0.3)
            await asyncio.to_thread(fleet.redis.start)
            restarted.set()

        await asyncio.wait_for(asyncio.gather(restart(), *[follow(i, job) for i, job in enumerate(jobs)]), 90)
        assert restarted.is_set()
        for deltas in streams:
            assert contiguous(deltas) == long
        again = await llmq.submit(**greedy(**SHORT))
        assert (await again.result(timeout=30)).token_ids == fleet.baseline["short"]


def test_errors_are_typed_after_everything(fleet: Fleet) -> None:
    """The fleet is still answering: a refused request is a typed error, the CLI still works."""
    with Client(fleet.url) as llmq:
        with pytest.raises(RequestFailed) as refused:
            llmq.generate(input_ids=[3] * 600, max_new_tokens=4, timeout=30)
        assert refused.value.code == "invalid_request"
        with pytest.raises(InvalidRequest):
            llmq.submit(prompt="x", input_ids=[3])
    ran = cli("status", "--json", "--url", fleet.url)
    assert ran.returncode == 0 and json.loads(ran.stdout)["dead"] == 0
