"""`submit(..., n=k)`, black box: written from docs/client.md ("Several answers (`n`)", "Batch files") and the
client's public API only, on a real redis-server; the answers come from an in-process worker on the real engine
and a tiny random model (`start_worker(real_model=True)`), or the scripted engine for `llmq batch`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from client import (
    AsyncChoices,
    AsyncClient,
    AsyncJob,
    Cancelled,
    Choices,
    Client,
    Delta,
    InvalidRequest,
    Job,
    QueueFull,
    RequestExpired,
    RequestFailed,
    ResultTimeout,
    protocol,
    store,
)
from tests.client.cli_support import llmq, scripted_worker
from tests.worker import conftest as worker_fixtures

pytestmark = pytest.mark.redis

# The worker tests' fixtures: `start_worker(real_model=True)` runs an in-process worker on the tiny model.
model_dir = worker_fixtures.model_dir
start_worker = worker_fixtures.start_worker

KEYS = store.Keys("default")
PROMPT_IDS = [5, 17, 42, 99, 7, 23, 64, 11, 3, 88]
LONG = 400  # tokens: long enough (with ignore_eos) that a cancel lands mid-generation


def queued(url: str) -> list[protocol.GenerateRequest]:
    """Every request entry of the default queue's default lane, oldest first."""
    with redis.Redis.from_url(url) as conn:
        return [protocol.decode_request(f[protocol.ENTRY_FIELD]) for _, f in conn.xrange(KEYS.requests)]


def submitted_marks(url: str) -> list[bytes]:
    with redis.Redis.from_url(url) as conn:
        return sorted(conn.keys(KEYS.submitted("*")))


# --- what goes into the queue (no worker) -----------------------------------------------------------------------


def test_n_writes_one_request_per_choice_with_derived_ids_and_seeds(redis_url: str) -> None:
    with Client(redis_url) as llmq_client:
        job = llmq_client.submit(
            "A name for a cat:", n=3, seed=1000, temperature=0.9, max_new_tokens=8, request_id="cats"
        )
    assert isinstance(job, Choices)
    assert job.id == "cats"
    assert [j.id for j in job.jobs] == ["cats-0", "cats-1", "cats-2"]
    assert all(isinstance(j, Job) for j in job.jobs)
    entries = queued(redis_url)
    assert [e.id for e in entries] == ["cats-0", "cats-1", "cats-2"]
    assert [e.params.seed for e in entries] == [1000, 1001, 1002]
    assert {e.prompt for e in entries} == {"A name for a cat:"}
    assert {(e.params.max_new_tokens, e.params.temperature) for e in entries} == {(8, 0.9)}
    assert protocol.choice_ids("cats", 3) == ["cats-0", "cats-1", "cats-2"]


async def test_async_n_writes_the_same_requests(redis_url: str) -> None:
    async with AsyncClient(redis_url) as client:
        job = await client.submit(input_ids=PROMPT_IDS, n=2, seed=-5, request_id="a")
    assert isinstance(job, AsyncChoices)
    assert job.id == "a"
    assert [j.id for j in job.jobs] == ["a-0", "a-1"]
    assert all(isinstance(j, AsyncJob) for j in job.jobs)
    entries = queued(redis_url)
    assert [(e.id, e.params.seed, e.input_ids) for e in entries] == [("a-0", -5, PROMPT_IDS), ("a-1", -4, PROMPT_IDS)]


def test_n_without_request_id_derives_from_a_generated_id(redis_url: str) -> None:
    with Client(redis_url) as client:
        job = client.submit("x", n=2)
    assert isinstance(job, Choices)
    assert [e.id for e in queued(redis_url)] == [f"{job.id}-0", f"{job.id}-1"]


def test_n_1_is_a_plain_job_under_its_own_id(redis_url: str) -> None:
    with Client(redis_url) as client:
        job = client.submit("x", n=1, seed=3, request_id="solo")
    assert not isinstance(job, Choices)
    assert isinstance(job, Job)
    assert job.id == "solo"
    assert [(e.id, e.params.seed) for e in queued(redis_url)] == [("solo", 3)]


def test_n_16_is_the_most(redis_url: str) -> None:
    with Client(redis_url) as client:
        job = client.submit("x", n=16, request_id="many")
    assert len(job.jobs) == 16
    assert [e.id for e in queued(redis_url)] == [f"many-{i}" for i in range(16)]


@pytest.mark.parametrize("n", [0, -1, 17, 1000])
def test_n_outside_1_to_16_is_refused_before_redis_is_touched(n: int) -> None:
    """Nothing listens on the URL: a client that tried Redis would retry, then raise `RedisUnavailable`."""
    with Client("redis://127.0.0.1:1/0", failover_timeout=3) as client, pytest.raises(InvalidRequest):
        client.submit("x", n=n)


@pytest.mark.parametrize("n", [0, 17])
async def test_async_n_outside_1_to_16_is_refused_before_redis_is_touched(n: int) -> None:
    async with AsyncClient("redis://127.0.0.1:1/0", failover_timeout=3) as client:
        with pytest.raises(InvalidRequest):  # not RedisUnavailable: Redis was never tried
            await client.submit("x", n=n)


@pytest.mark.parametrize("n", [True, 2.0, "2"])
def test_n_of_another_type_is_refused(redis_url: str, n: Any) -> None:
    """Booleans are not numbers; neither is a float or a string a count."""
    with Client(redis_url) as client, pytest.raises((InvalidRequest, TypeError)):
        client.submit("x", n=n)
    assert queued(redis_url) == []


def test_queue_full_for_all_choices_adds_none(redis_url: str) -> None:
    with Client(redis_url, max_queue_len=4) as client:
        client.submit("first", request_id="first")
        client.submit("second", request_id="second")
        with pytest.raises(QueueFull):
            client.submit("x", n=3, request_id="three")  # room for 2 of the 3
        assert [e.id for e in queued(redis_url)] == ["first", "second"]
        assert not any(b"three" in key for key in submitted_marks(redis_url))  # a retry is no duplicate
        job = client.submit("x", n=2, request_id="two")  # exactly the room left
        assert [j.id for j in job.jobs] == ["two-0", "two-1"]
        assert [e.id for e in queued(redis_url)] == ["first", "second", "two-0", "two-1"]
        with pytest.raises(QueueFull):
            client.submit("x", n=2, request_id="more")
        assert len(queued(redis_url)) == 4


async def test_async_queue_full_for_all_choices_adds_none(redis_url: str) -> None:
    async with AsyncClient(redis_url, max_queue_len=2) as client:
        with pytest.raises(QueueFull):
            await client.submit("x", n=3, request_id="three")
        assert queued(redis_url) == []
        job = await client.submit("x", n=2, request_id="two")
        assert isinstance(job, AsyncChoices)
    assert len(queued(redis_url)) == 2


def test_resubmitting_the_same_call_attaches_to_the_same_choices(redis_url: str) -> None:
    with Client(redis_url) as client:
        first = client.submit("x", n=3, seed=1, request_id="again")
        second = client.submit("x", n=3, seed=1, request_id="again")
    assert [j.id for j in first.jobs] == [j.id for j in second.jobs]
    assert [e.id for e in queued(redis_url)] == ["again-0", "again-1", "again-2"]


def test_seed_at_the_top_of_its_range_still_fits(redis_url: str) -> None:
    top = protocol.MAX_SEED
    with Client(redis_url) as client:
        client.submit("x", n=3, seed=top - 2, request_id="top")
    assert [e.params.seed for e in queued(redis_url)] == [top - 2, top - 1, top]


@pytest.mark.parametrize("offset", [1, 0])
def test_seed_whose_later_choices_pass_the_maximum_is_refused_before_submitting(redis_url: str, offset: int) -> None:
    """Choice `i` is seeded `seed + i` and every seed must be at most 2^64 - 1, which the client checks before
    submitting: a call whose last choice's seed would be out of range is refused whole, nothing queued (not
    some choices queued and the last refused by the worker, nor a seed wrapped round)."""
    seed = protocol.MAX_SEED - offset
    with Client(redis_url) as client, pytest.raises(InvalidRequest) as raised:
        client.submit("x", n=3, seed=seed, request_id="overflow")
    assert raised.value.param in (None, "params.seed")
    assert queued(redis_url) == []
    assert submitted_marks(redis_url) == []


def test_request_id_whose_derived_ids_are_too_long_is_refused_before_submitting(redis_url: str) -> None:
    """Request ids are at most 128 characters; with `n` the queued ids are `<id>-<i>`."""
    with Client(redis_url) as client:
        with pytest.raises(InvalidRequest):
            client.submit("x", n=2, request_id="r" * 128)
        assert queued(redis_url) == []
        with pytest.raises(InvalidRequest):
            client.submit("x", n=11, request_id="r" * 126)  # "-0" fits, "-10" makes 129
        assert queued(redis_url) == []
        job = client.submit("x", n=2, request_id="r" * 126)  # "-0", "-1": exactly 128
    assert [len(j.id) for j in job.jobs] == [128, 128]
    assert [len(e.id) for e in queued(redis_url)] == [128, 128]


def test_invalid_field_with_n_is_refused_before_submitting(redis_url: str) -> None:
    with Client(redis_url) as client, pytest.raises(InvalidRequest):
        client.submit("x", n=3, temperature=-1.0)
    assert queued(redis_url) == []


# --- answers from a worker on the real engine --------------------------------------------------------------------


async def single(client: AsyncClient, **kwargs: Any) -> Any:
    job = await client.submit(**kwargs)
    return await job.result(timeout=60)


async def test_greedy_choices_are_equal_and_equal_one_call(redis_url: str, start_worker: Callable[..., Any]) -> None:
    await start_worker(real_model=True)
    request = {"input_ids": PROMPT_IDS, "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    async with AsyncClient(redis_url) as client:
        alone = await single(client, **request)
        job = await client.submit(**request, n=3, request_id="greedy")
        result = await job.result(timeout=60)
    assert result.choices is not None and len(result.choices) == 3
    assert [c.token_ids for c in result.choices] == [alone.token_ids] * 3
    assert [c.request_id for c in result.choices] == ["greedy-0", "greedy-1", "greedy-2"]
    assert (result.text, result.token_ids, result.finish_reason) == (
        result.choices[0].text,
        result.choices[0].token_ids,
        result.choices[0].finish_reason,
    )
    assert job.finish_reason == result.choices[0].finish_reason == "length"


async def test_seeded_choice_i_is_the_answer_of_one_call_seeded_seed_plus_i(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    await start_worker(real_model=True)
    request = {"input_ids": PROMPT_IDS, "max_new_tokens": 8, "temperature": 1.5, "ignore_eos": True}
    async with AsyncClient(redis_url) as client:
        result = await (await client.submit(**request, n=4, seed=77)).result(timeout=60)
        alone = [await single(client, **request, seed=77 + i) for i in range(4)]
    assert result.choices is not None
    assert [c.token_ids for c in result.choices] == [a.token_ids for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) > 1  # sampled: the seeds do differ in what they draw


async def test_usage_counts_the_prompt_once_and_every_completion(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    await start_worker(real_model=True)
    async with AsyncClient(redis_url) as client:
        alone = await single(client, input_ids=PROMPT_IDS, max_new_tokens=5, temperature=0, ignore_eos=True)
        job = await client.submit(input_ids=PROMPT_IDS, max_new_tokens=5, temperature=1.0, seed=3, n=3)
        result = await job.result(timeout=60)
    assert alone.usage.prompt_tokens == len(PROMPT_IDS)
    assert result.choices is not None
    assert [c.usage.prompt_tokens for c in result.choices] == [len(PROMPT_IDS)] * 3
    assert result.usage.prompt_tokens == len(PROMPT_IDS)
    assert result.usage.completion_tokens == sum(c.usage.completion_tokens for c in result.choices) == 15


async def test_stream_interleaves_choices_by_index_then_result_agrees(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    await start_worker(real_model=True)
    async with AsyncClient(redis_url) as client:
        job = await client.submit(
            input_ids=PROMPT_IDS, max_new_tokens=12, temperature=1.0, seed=9, ignore_eos=True, n=3
        )
        deltas: list[Delta] = [delta async for delta in job.stream(timeout=60)]
        result = await job.result(timeout=30)  # after the stream: the same answers, not a wait
    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, list[int]] = defaultdict(list)
    for delta in deltas:
        assert delta.seq == len(tokens[delta.index])  # each choice's deltas in order, no gap, no duplicate
        texts[delta.index] += delta.text
        tokens[delta.index] += delta.token_ids
    assert sorted(tokens) == [0, 1, 2]
    assert result.choices is not None
    assert [tokens[i] for i in range(3)] == [c.token_ids for c in result.choices]
    assert [texts[i] for i in range(3)] == [c.text for c in result.choices]
    assert all(len(c.token_ids) == 12 for c in result.choices)


async def test_sync_choices_stream_and_result(redis_url: str, start_worker: Callable[..., Any]) -> None:
    """The blocking twin, in a thread (the worker runs in this test's loop)."""
    await start_worker(real_model=True)

    def use() -> tuple[Any, list[Delta], Any]:
        with Client(redis_url) as client:
            job = client.submit(input_ids=PROMPT_IDS, max_new_tokens=6, temperature=0.8, seed=5, n=2, ignore_eos=True)
            deltas = list(job.stream(timeout=60))
            result = job.result(timeout=30)
            alone = client.submit(input_ids=PROMPT_IDS, max_new_tokens=6, temperature=0.8, seed=6, ignore_eos=True)
            return result, deltas, alone.result(timeout=60)

    result, deltas, alone = await asyncio.to_thread(use)
    assert {d.index for d in deltas} == {0, 1}
    assert result.choices is not None and len(result.choices) == 2
    assert result.choices[1].token_ids == alone.token_ids
    assert "".join(d.text for d in deltas if d.index == 1) == result.choices[1].text
    assert result.usage.completion_tokens == 12


async def test_cancel_stops_every_choice(redis_url: str, start_worker: Callable[..., Any]) -> None:
    await start_worker(real_model=True)
    async with AsyncClient(redis_url) as client:
        job = await client.submit(input_ids=PROMPT_IDS, max_new_tokens=LONG, temperature=0, ignore_eos=True, n=3)
        async for _delta in job.stream(timeout=60):
            break  # generation has started
        await job.cancel()
        with pytest.raises(Cancelled):
            await job.result(timeout=30)
        for choice in job.jobs:
            with pytest.raises(Cancelled) as raised:
                await choice.result(timeout=30)
            assert len(raised.value.result.token_ids) < LONG
            assert choice.finish_reason == "cancelled"


async def test_cancelling_one_choice_by_its_own_job_ends_the_call_cancelled(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    """`jobs` holds the choices' own jobs; cancelling one (as `llmq cancel <id>-1`) makes `result()` raise
    `Cancelled` ("raises Cancelled if one was cancelled"), and does not hang the call."""
    await start_worker(real_model=True)
    async with AsyncClient(redis_url) as client:
        job = await client.submit(
            input_ids=PROMPT_IDS, max_new_tokens=LONG, temperature=0, ignore_eos=True, n=3, request_id="one"
        )
        async for _delta in job.stream(timeout=60):
            break
        await job.jobs[1].cancel()
        with pytest.raises(Cancelled):
            await job.result(timeout=60)
        with pytest.raises(Cancelled) as raised:
            await job.jobs[1].result(timeout=30)
        assert len(raised.value.result.token_ids) < LONG


async def test_cancel_by_id_from_another_client(redis_url: str, start_worker: Callable[..., Any]) -> None:
    """A choice's id is a request id of its own: another client cancels it by `Job.attach`."""
    await start_worker(real_model=True)
    async with AsyncClient(redis_url) as client, AsyncClient(redis_url) as other:
        job = await client.submit(
            input_ids=PROMPT_IDS, max_new_tokens=LONG, temperature=0, ignore_eos=True, n=2, request_id="far"
        )
        async for _delta in job.stream(timeout=60):
            break
        await AsyncJob.attach(other, "far-0").cancel()
        with pytest.raises(Cancelled):
            await job.result(timeout=60)


async def test_a_failing_choice_fails_the_call_and_cancels_the_others(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    """Choice 1's id is taken first by a request the worker refuses (a token id outside the tiny vocabulary):
    submitting the call under that id attaches to it (submitting is idempotent per request id), so choice 1
    fails; the call raises its error and the other choices are cancelled rather than run to their end."""
    await start_worker(real_model=True)
    async with AsyncClient(redis_url) as client:
        bad = await client.submit(input_ids=[100_000], max_new_tokens=4, request_id="mixed-1")
        with pytest.raises(RequestFailed) as bad_error:
            await bad.result(timeout=60)
        assert bad_error.value.code == "invalid_request"
        job = await client.submit(
            input_ids=PROMPT_IDS, max_new_tokens=LONG, temperature=0, ignore_eos=True, n=3, request_id="mixed"
        )
        with pytest.raises(RequestFailed) as raised:
            await job.result(timeout=60)
        assert raised.value.code == "invalid_request"
        for index in (0, 2):
            with pytest.raises(Cancelled) as cancelled:
                await job.jobs[index].result(timeout=30)
            assert len(cancelled.value.result.token_ids) < LONG


async def test_a_failing_choice_stops_the_stream_with_its_error(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    await start_worker(real_model=True)
    async with AsyncClient(redis_url) as client:
        bad = await client.submit(input_ids=[100_000], max_new_tokens=4, request_id="streamed-0")
        with pytest.raises(RequestFailed):
            await bad.result(timeout=60)
        job = await client.submit(
            input_ids=PROMPT_IDS, max_new_tokens=LONG, temperature=0, ignore_eos=True, n=2, request_id="streamed"
        )
        seen = 0
        with pytest.raises(RequestFailed):
            async for delta in job.stream(timeout=60):
                seen += len(delta.token_ids)
        assert seen < LONG
        with pytest.raises(Cancelled):
            await job.jobs[1].result(timeout=30)


async def test_tools_on_a_model_without_tool_support_fail_every_choice(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    await start_worker(real_model=True)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    async with AsyncClient(redis_url) as client:
        job = await client.submit(
            messages=[{"role": "user", "content": "hi"}], tools=[tool], max_new_tokens=4, n=3, seed=1
        )
        with pytest.raises(RequestFailed) as raised:
            await job.result(timeout=60)
        assert raised.value.param == "tools"
        assert raised.value.code == "invalid_request"
        for choice in job.jobs:  # every choice has ended, none left generating
            with pytest.raises((RequestFailed, Cancelled)):
                await choice.result(timeout=30)


async def test_prompt_logprobs_with_n_score_the_prompt_for_every_choice(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    await start_worker(real_model=True)
    common = {"input_ids": PROMPT_IDS, "max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    async with AsyncClient(redis_url) as client:
        plain = await (await client.submit(**common, seed=40, n=2)).result(timeout=60)
        job = await client.submit(**common, seed=40, n=2, prompt_logprobs=2)
        deltas = [delta async for delta in job.stream(timeout=60)]
        scored = await job.result(timeout=30)
    assert plain.choices is not None and scored.choices is not None
    assert [c.token_ids for c in scored.choices] == [c.token_ids for c in plain.choices]  # scoring changes nothing
    assert scored.prompt_token_ids == PROMPT_IDS
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(PROMPT_IDS)
    assert scored.prompt_logprobs[0] is None
    for choice in scored.choices:
        assert choice.prompt_token_ids == PROMPT_IDS
        assert choice.prompt_logprobs is not None
        got = [None if e is None else e.logprob for e in choice.prompt_logprobs]
        want = [None if e is None else e.logprob for e in scored.prompt_logprobs]
        assert got[0] is None and got[1:] == pytest.approx(want[1:], abs=1e-4)
        assert all(e is None or len(e.top) == 2 for e in choice.prompt_logprobs)
    prompt_deltas = [d for d in deltas if d.prompt_logprobs is not None]
    assert sorted(d.index for d in prompt_deltas) == [0, 1]  # one scored-prompt delta per choice
    assert all(d.token_ids == [] for d in prompt_deltas)
    assert scored.usage.prompt_tokens == len(PROMPT_IDS)


async def test_choices_read_together_compute_their_prompt_once(
    redis_url: str, start_worker: Callable[..., Any]
) -> None:
    """The docs' figure, through the queue: four choices of a 70-token prompt, taken together by one worker,
    cost 70 + 3 x 6 prompt tokens; the worker's published prefix-cache counters show 3 x 64 tokens found."""
    await start_worker(real_model=True)  # page size 16
    prompt_ids = [10 + (i * 37) % 390 for i in range(70)]
    async with AsyncClient(redis_url) as client:
        job = await client.submit(input_ids=prompt_ids, max_new_tokens=3, temperature=0, n=4)
        result = await job.result(timeout=60)
        assert result.choices is not None and len({tuple(c.token_ids) for c in result.choices}) == 1
        deadline = time.monotonic() + 10
        caches: dict[Any, Any] = {}
        while time.monotonic() < deadline:
            caches = dict((await client.status()).prefix_caches or {})
            if caches and next(iter(caches.values())).queries >= 4 * 70:
                break
            await asyncio.sleep(0.1)
    [cache] = caches.values()
    assert cache.hits == 3 * 64
    assert result.usage.prompt_tokens == 70


# --- llmq batch -------------------------------------------------------------------------------------------------


def batch_line(custom_id: str, **body: Any) -> str:
    url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"max_tokens": 4, **body}})


async def test_batch_line_with_n_answers_every_choice_in_one_line(redis_url: str, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        "\n".join(
            [
                batch_line("one", prompt="hello there"),
                batch_line("three", prompt="hello there", n=3, seed=1, temperature=0.5),
                batch_line("chat", n=2, seed=2, temperature=0.5, messages=[{"role": "user", "content": "hi"}]),
            ]
        )
        + "\n"
    )
    (tmp_path / "model").mkdir()
    output = tmp_path / "out.jsonl"
    async with scripted_worker(redis_url, tmp_path):
        code = await llmq("batch", str(source), "-o", str(output), "--url", redis_url)
    assert code == 0
    lines = {line["custom_id"]: line for line in map(json.loads, output.read_text().splitlines())}
    assert sorted(lines) == ["chat", "one", "three"]
    one, three, chat = (lines[k]["response"]["body"] for k in ("one", "three", "chat"))
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert all("message" in c for c in chat["choices"])
    assert len(one["choices"]) == 1
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] > 0  # the prompt counted once
    assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"] == 12
    assert all(lines[k]["error"] is None for k in lines)


async def test_batch_line_with_n_out_of_range_is_an_error_line(redis_url: str, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        "\n".join(
            [batch_line("zero", prompt="x", n=0), batch_line("many", prompt="x", n=17), batch_line("ok", prompt="x")]
        )
        + "\n"
    )
    (tmp_path / "model").mkdir()
    output = tmp_path / "out.jsonl"
    async with scripted_worker(redis_url, tmp_path):
        code = await llmq("batch", str(source), "-o", str(output), "--url", redis_url)
    assert code == 1
    lines = {line["custom_id"]: line for line in map(json.loads, output.read_text().splitlines())}
    assert sorted(lines) == ["many", "ok", "zero"]
    assert lines["zero"]["error"] is not None and lines["many"]["error"] is not None
    assert lines["ok"]["error"] is None
    assert not any(e.id.endswith("-16") for e in queued(redis_url))


# --- before a worker takes them, and partitioned queues (scripted engine) ----------------------------------------


async def test_cancel_before_any_worker_reads_ends_every_choice_ungenerated(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    async with AsyncClient(redis_url) as client:
        job = await client.submit("hello", max_new_tokens=50, n=3, request_id="early")
        assert job.finish_reason is None
        await job.cancel()
        async with scripted_worker(redis_url, tmp_path):
            with pytest.raises(Cancelled):
                await job.result(timeout=30)
            for choice in job.jobs:
                with pytest.raises(Cancelled) as raised:
                    await choice.result(timeout=30)
                assert raised.value.result.token_ids == []


async def test_choices_past_their_deadline_expire(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    async with AsyncClient(redis_url) as client:
        job = await client.submit("hello", max_new_tokens=5, n=2, deadline=0.05)
        await asyncio.sleep(0.3)
        async with scripted_worker(redis_url, tmp_path):
            with pytest.raises(RequestExpired):
                await job.result(timeout=30)


def partition_entries(url: str, partitions: int) -> list[str]:
    with redis.Redis.from_url(url) as conn:
        return sorted(
            protocol.decode_request(f[protocol.ENTRY_FIELD]).id
            for keys in KEYS.partitioned(partitions)
            for _, f in conn.xrange(keys.requests)
        )


async def test_partitioned_refusal_under_a_named_id_is_completed_by_a_retry(redis_url: str, tmp_path: Path) -> None:
    """Over 3 partitions, `split-0` and `split-2` share partition 0 and `split-1` is alone in partition 2; each
    partition holds one request (max_queue_len 3), so partition 0 refuses. The call named its id: a choice
    already submitted stays, and the same call again (with room) attaches to it and submits the rest."""
    assert [store.partition_of(f"split-{i}", 3) for i in range(3)] == [0, 2, 0]
    async with AsyncClient(redis_url, partitions=3, max_queue_len=3) as tight:
        with pytest.raises(QueueFull):
            await tight.submit("hello", max_new_tokens=4, n=3, request_id="split")
    assert set(partition_entries(redis_url, 3)) <= {"split-1"}
    (tmp_path / "model").mkdir()
    async with AsyncClient(redis_url, partitions=3) as roomy:
        job = await roomy.submit("hello", max_new_tokens=4, n=3, request_id="split")
        assert partition_entries(redis_url, 3) == ["split-0", "split-1", "split-2"]  # each once
        async with scripted_worker(redis_url, tmp_path, queue_partitions=3):
            result = await job.result(timeout=30)
    assert result.choices is not None
    assert [len(c.token_ids) for c in result.choices] == [4, 4, 4]


async def test_partitioned_refusal_without_a_named_id_cancels_the_choices_submitted(
    redis_url: str, tmp_path: Path
) -> None:
    """Partition 2 is full beforehand; 16 choices under a random id land in every partition (all but surely), so
    the call is refused, and whatever it had submitted to partitions 0 and 1 is cancelled, never generated."""
    async with AsyncClient(redis_url, partitions=3, max_queue_len=48) as client:  # 16 per partition
        fillers = [f"fill{i}" for i in range(400) if store.partition_of(f"fill{i}", 3) == 2][:16]
        for rid in fillers:
            await client.submit("x", max_new_tokens=1, request_id=rid)
        with pytest.raises(QueueFull):
            await client.submit("hello", max_new_tokens=4, n=16)
        leftovers = [rid for rid in partition_entries(redis_url, 3) if not rid.startswith("fill")]
        assert {store.partition_of(rid, 3) for rid in leftovers} <= {0, 1}
        (tmp_path / "model").mkdir()
        async with scripted_worker(redis_url, tmp_path, queue_partitions=3):
            for rid in leftovers:
                with pytest.raises(Cancelled) as raised:
                    await AsyncJob.attach(client, rid).result(timeout=30)
                assert raised.value.result.token_ids == []
            for rid in fillers:  # served, so partition 2 has room again (a random id may land there)
                await AsyncJob.attach(client, rid).result(timeout=30)
            await (await client.submit("after", max_new_tokens=2)).result(timeout=30)  # the queue still serves


def test_choices_go_together_into_the_lane_asked_for(redis_url: str) -> None:
    with Client(redis_url) as client:
        client.submit("x", n=3, priority="interactive", request_id="urgent")
    with redis.Redis.from_url(redis_url) as conn:
        ids = [protocol.decode_request(f[protocol.ENTRY_FIELD]).id for _, f in conn.xrange(KEYS.lane("interactive"))]
        assert conn.xlen(KEYS.requests) == 0
    assert ids == ["urgent-0", "urgent-1", "urgent-2"]


async def test_result_timeout_without_a_worker(redis_url: str) -> None:
    async with AsyncClient(redis_url) as client:
        job = await client.submit("x", n=2)
        with pytest.raises(ResultTimeout):
            await job.result(timeout=0.3)
        assert job.finish_reason is None
