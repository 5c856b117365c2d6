"""The Batch API over HTTP (`/v1/files`, `/v1/batches`) through the real `openai` SDK: a batch runs every line once
with OpenAI-shaped output and error files, a malformed file fails it, a cancel stops it, another API key sees none
of it, and a 500-line batch completes with every `custom_id` once across a gateway killed mid-batch."""

from __future__ import annotations

import io
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import openai
import pytest

from client import AsyncJob, Cancelled
from client.connection import open_async
from gateway.batch_driver import END_ATTEMPTS
from gateway.batch_lines import identity_of, lines
from gateway.batch_store import ANONYMOUS, BatchStore, owner_of
from gateway.batch_upload import split
from gateway.errors import APIError
from testing.redis_topologies import RedisClusterSet
from testing.tiny_models import save_tiny_model
from tests.gateway.batch_support import Stack, poll, redis_with_aof
from tests.polling import wait_until

CHAT: Final = "/v1/chat/completions"
ENDED = {"completed", "failed", "expired", "cancelled"}


def line(custom_id: Any, content: str = "hi", *, url: str = CHAT, model: str = "m", **body: Any) -> str:
    request = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": request})


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def rows(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(text) for text in data.decode().splitlines() if text.strip()]


async def ended(sdk: openai.AsyncOpenAI, batch_id: str, within_s: float = 60) -> Any:
    found: list[Any] = []

    async def done() -> bool:
        found[:] = [await sdk.batches.retrieve(batch_id)]
        return found[0].status in ENDED

    await wait_until(done, within_s)
    return found[0]


async def submitted(sdk: openai.AsyncOpenAI, data: bytes, **options: Any) -> Any:
    upload = await sdk.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    return await sdk.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h", **options)


async def test_a_batch_answers_every_line_once_in_openai_shape(gateway: Any, start_worker: Any) -> None:
    await start_worker(real_model=True)
    served = await gateway(batch_poll_s=0.05)
    model = await served.model()
    sdk = served.sdk()
    lines = [line(f"req-{i}", f"question {i}", model=model, temperature=0) for i in range(8)]
    lines.append(line("two", "question 0", model=model, temperature=0, n=2))  # two choices in one answer
    lines.append(line("refused", model=model, best_of=2))  # a body llmq cannot run: answered in the error file
    data = jsonl(lines)

    upload = await sdk.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    assert upload.id.startswith("file-") and upload.purpose == "batch" and upload.bytes == len(data)
    assert (await sdk.files.retrieve(upload.id)).filename == "input.jsonl"
    assert (await sdk.files.content(upload.id)).content == data
    batch = await sdk.batches.create(
        input_file_id=upload.id, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"}
    )
    assert batch.id.startswith("batch_") and batch.status == "validating" and batch.metadata == {"job": "nightly"}
    kept = await sdk.files.retrieve(upload.id)  # the input outlives the batch's window
    assert kept.expires_at is not None and kept.expires_at >= batch.expires_at + served.state.settings.batch_ttl_s

    batch = await ended(sdk, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 9, 1)
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.model == model and batch.output_file_id and batch.error_file_id

    output = rows((await sdk.files.content(batch.output_file_id)).content)
    assert sorted(row["custom_id"] for row in output) == sorted([*(f"req-{i}" for i in range(8)), "two"])
    [two] = [row["response"]["body"] for row in output if row["custom_id"] == "two"]
    [req_0] = [row["response"]["body"] for row in output if row["custom_id"] == "req-0"]
    assert [choice["index"] for choice in two["choices"]] == [0, 1]
    greedy = req_0["choices"][0]["message"]["content"]  # the same question, greedy: every choice is its answer
    assert [choice["message"]["content"] for choice in two["choices"]] == [greedy, greedy]
    assert two["usage"]["prompt_tokens"] == req_0["usage"]["prompt_tokens"]  # the prompt counted once
    assert two["usage"]["completion_tokens"] == 2 * req_0["usage"]["completion_tokens"]
    for row in output:
        assert row["error"] is None and row["id"].startswith("batch_req_")
        assert row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == model
        assert body["id"] == row["response"]["request_id"]
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["completion_tokens"] <= 3 * len(body["choices"])  # max_tokens per choice
    assert len({row["response"]["request_id"] for row in output}) == 9
    errors = rows((await sdk.files.content(batch.error_file_id)).content)
    assert [(row["custom_id"], row["response"], row["error"]["code"]) for row in errors] == [
        ("refused", None, "invalid_request")
    ]
    assert "best_of" in errors[0]["error"]["message"]
    assert (await sdk.files.retrieve(batch.output_file_id)).purpose == "batch_output"
    outputs = [f.id async for f in sdk.files.list(purpose="batch_output")]
    assert sorted(outputs) == sorted([batch.output_file_id, batch.error_file_id])
    with pytest.raises(openai.ConflictError):  # an ended batch cannot be cancelled
        await sdk.batches.cancel(batch.id)

    deleted = await sdk.files.delete(upload.id)
    assert deleted.deleted and deleted.id == upload.id
    with pytest.raises(openai.NotFoundError):
        await sdk.files.retrieve(upload.id)


async def test_a_malformed_file_fails_the_batch_with_its_errors(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway(batch_poll_s=0.05, batch_max_lines=5)
    sdk = served.sdk()
    model = await served.model()
    data = jsonl(["not json", line("a"), line("a"), line("b", url="/v1/completions"), line("c", model="")])
    batch = await ended(sdk, (await submitted(sdk, data)).id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.output_file_id is None and batch.errors is not None and batch.errors.data is not None
    found = [(error.line, error.code) for error in batch.errors.data]
    assert found == [
        (1, "invalid_request"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_endpoint"),
        (5, "missing_required_parameter"),
    ]

    empty = await ended(sdk, (await submitted(sdk, b"\n")).id)
    assert empty.status == "failed" and [e.code for e in empty.errors.data] == ["empty_file"]
    long = await ended(sdk, (await submitted(sdk, jsonl([line(f"l{i}", model=model) for i in range(6)]))).id)
    assert long.status == "failed" and [e.code for e in long.errors.data] == ["too_many_requests"]
    unknown = await ended(sdk, (await submitted(sdk, jsonl([line("u", model="no-such-model")]))).id)
    assert unknown.status == "failed" and [e.code for e in unknown.errors.data] == ["model_not_found"]


async def test_a_cancelled_batch_stops_and_keeps_what_finished(gateway: Any, start_worker: Any) -> None:
    await start_worker(step_s=0.05)  # slow tokens: the batch is still running when the cancel comes
    served = await gateway(batch_poll_s=0.05, batch_window=2)
    model = await served.model()
    sdk = served.sdk()
    batch = await submitted(sdk, jsonl([line(f"r{i}", model=model, max_tokens=8) for i in range(30)]))

    async def started() -> bool:
        now = await sdk.batches.retrieve(batch.id)
        return now.status == "in_progress" and now.request_counts is not None and now.request_counts.completed >= 1

    await wait_until(started, 60)
    cancelling = await sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    batch = await ended(sdk, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts is not None and 1 <= batch.request_counts.completed < 30
    assert batch.output_file_id is not None
    output = rows((await sdk.files.content(batch.output_file_id)).content)
    assert len(output) == batch.request_counts.completed == len({row["custom_id"] for row in output})
    assert (await sdk.batches.cancel(batch.id)).status == "cancelled"  # a cancel again changes nothing


async def test_a_batch_past_its_window_expires_with_its_unfinished_lines_in_the_error_file(
    gateway: Any, start_worker: Any
) -> None:
    await start_worker(step_s=0.05)
    served = await gateway(batch_poll_s=0.05, batch_window=2)
    model = await served.model()
    sdk = served.sdk()
    batch = await submitted(sdk, jsonl([line(f"r{i}", model=model, max_tokens=8) for i in range(30)]))

    async def started() -> bool:
        now = await sdk.batches.retrieve(batch.id)
        return now.request_counts is not None and now.request_counts.completed >= 1

    await wait_until(started, 60)
    # the 24 hours pass: the batch's window ends now (its record, as the store keeps it)
    await served.state.batches.update(batch.id, lambda record: {"expires_at": 0})
    batch = await ended(sdk, batch.id)
    assert batch.status == "expired" and batch.expired_at is not None
    assert batch.request_counts is not None and batch.request_counts.completed >= 1
    assert batch.request_counts.completed + batch.request_counts.failed == 30
    assert batch.output_file_id is not None and batch.error_file_id is not None
    output = rows((await sdk.files.content(batch.output_file_id)).content)
    errors = rows((await sdk.files.content(batch.error_file_id)).content)
    assert sorted(row["custom_id"] for row in output + errors) == sorted(f"r{i}" for i in range(30))
    assert {row["error"]["code"] for row in errors} <= {"batch_expired", "expired"}
    assert any(row["error"]["code"] == "batch_expired" for row in errors)


async def test_a_batch_reaching_the_end_of_its_window_cancels_its_lines_in_flight(
    gateway: Any, start_worker: Any
) -> None:
    await start_worker(step_s=0.05)  # a line takes 10 s: the first two are generating when the window ends
    served = await gateway(batch_poll_s=0.05, batch_window=2)
    model = await served.model()
    sdk = served.sdk()
    data = jsonl([line(f"r{i}", model=model, max_tokens=200) for i in range(4)])
    batch = await submitted(sdk, data)

    async def started() -> bool:
        return (await sdk.batches.retrieve(batch.id)).status == "in_progress"

    await wait_until(started, 60)
    await served.state.batches.update(batch.id, lambda record: {"expires_at": 0})
    assert (await ended(sdk, batch.id)).status == "expired"
    first = next(lines(data, identity_of(batch.id)))
    job = AsyncJob.attach(served.state.client, first.request_id, queue=await served.state.models.queue_of(model))
    with pytest.raises(Cancelled):  # stopped on the worker, not left generating its 200 tokens
        await job.result(timeout=30)


async def test_a_batch_no_worker_validates_expires_at_the_end_of_its_window(gateway: Any) -> None:
    served = await gateway(batch_poll_s=0.05)  # no worker: the batch waits in `validating`
    sdk = served.sdk()
    batch = await submitted(sdk, jsonl([line("a"), line("b")]))
    assert (await sdk.batches.retrieve(batch.id)).status == "validating"
    await served.state.batches.update(batch.id, lambda record: {"expires_at": 0})  # its 24 hours pass
    batch = await ended(sdk, batch.id, within_s=20)
    assert batch.status == "expired" and batch.expired_at is not None
    assert batch.output_file_id is None and batch.error_file_id is None


async def test_a_batch_past_its_window_expires_though_the_workers_expired_answers_fill_its_count(
    gateway: Any,
) -> None:
    served = await gateway(batch_max_running=0)  # the batch is set up below, then driven by a second gateway
    sdk = served.sdk()
    batch = await submitted(sdk, jsonl([line("a")]))
    expired_answer = json.dumps({"custom_id": "a", "response": None, "error": {"code": "expired", "message": "late"}})
    await served.state.batches.answer(batch.id, [("a", expired_answer, False)])
    counts = {"total": 1, "completed": 0, "failed": 0}
    moved = {"status": "in_progress", "model": "m", "request_counts": counts, "expires_at": 0}
    await served.state.batches.update(batch.id, lambda record: moved)
    driver = await gateway(batch_poll_s=0.05)
    batch = await ended(driver.sdk(), batch.id, within_s=20)
    assert batch.status == "expired" and batch.expired_at is not None and batch.completed_at is None
    assert batch.error_file_id is not None and batch.output_file_id is None


async def test_an_unfinished_batchs_input_file_cannot_be_deleted(gateway: Any) -> None:
    served = await gateway(batch_poll_s=0.05)  # no worker: the batch waits in `validating`
    sdk = served.sdk()
    batch = await submitted(sdk, jsonl([line("a")]))
    with pytest.raises(openai.ConflictError) as refused:
        await sdk.files.delete(batch.input_file_id)
    assert refused.value.code == "file_in_use" and batch.id in refused.value.message
    assert (await sdk.files.retrieve(batch.input_file_id)).id == batch.input_file_id
    await sdk.batches.cancel(batch.id)
    assert (await ended(sdk, batch.id, within_s=20)).status == "cancelled"
    assert (await sdk.files.delete(batch.input_file_id)).deleted  # once the batch has ended, it can


async def test_an_output_file_past_its_bound_fails_the_batch(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway(batch_poll_s=0.05, batch_output_max_bytes=1024)
    model = await served.model()
    sdk = served.sdk()
    batch = await ended(sdk, (await submitted(sdk, jsonl([line(f"r{i}", model=model) for i in range(6)]))).id)
    assert batch.status == "failed" and batch.output_file_id is None and batch.errors is not None
    assert [error.code for error in batch.errors.data or []] == ["output_too_large"]


async def test_a_batch_whose_files_cannot_be_written_fails_instead_of_retrying_forever(
    gateway: Any, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await start_worker()
    served = await gateway(batch_poll_s=0.05)
    model = await served.model()
    sdk = served.sdk()
    tries: list[str] = []
    put_file = served.state.batches.put_file

    async def refused(owner: str, filename: str, purpose: str, *args: Any) -> dict[str, Any]:
        if purpose != "batch_output":  # the upload is stored
            return await put_file(owner, filename, purpose, *args)
        tries.append(filename)
        raise RuntimeError("the output cannot be stored")

    monkeypatch.setattr(served.state.batches, "put_file", refused)
    batch = await ended(sdk, (await submitted(sdk, jsonl([line("a", model=model)]))).id)
    assert batch.status == "failed" and batch.output_file_id is None and batch.errors is not None
    assert [error.code for error in batch.errors.data or []] == ["finalize_failed"]
    assert len(tries) == END_ATTEMPTS


async def test_files_and_batches_belong_to_their_api_key(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway(api_keys="key-one,key-two", batch_file_max_bytes=4096, batch_poll_s=0.05)
    one, two = served.sdk(api_key="key-one"), served.sdk(api_key="key-two")
    models: list[str] = []

    async def listed() -> bool:
        models[:] = [m.id async for m in one.models.list()]
        return bool(models)

    await wait_until(listed)
    model = models[0]
    batch = await submitted(one, jsonl([line("x", model=model)]))
    upload_id = batch.input_file_id
    for call in (
        two.files.retrieve(upload_id),
        two.files.content(upload_id),
        two.files.delete(upload_id),
        two.batches.retrieve(batch.id),
        two.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    with pytest.raises(openai.NotFoundError):  # nor can it run another's file
        await two.batches.create(input_file_id=upload_id, endpoint=CHAT, completion_window="24h")
    assert [b.id async for b in two.batches.list()] == [] and [f.id async for f in two.files.list()] == []
    assert [b.id async for b in one.batches.list()] == [batch.id]
    assert upload_id in [f.id async for f in one.files.list()]
    assert (await ended(one, batch.id)).status == "completed"

    with pytest.raises(openai.BadRequestError) as refused:
        await one.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert refused.value.param == "purpose"
    with pytest.raises(openai.APIStatusError) as too_big:
        await one.files.create(file=("x.jsonl", io.BytesIO(b"x" * 5000)), purpose="batch")
    assert too_big.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        await one.batches.create(input_file_id=upload_id, endpoint=CHAT, completion_window="1h")


async def test_two_gateways_share_the_batches_and_answer_each_line_once(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    first, second = await gateway(batch_poll_s=0.05), await gateway(batch_poll_s=0.05)
    model = await first.model()
    batches = [await submitted(first.sdk(), jsonl([line(f"{n}-{i}", model=model) for i in range(20)])) for n in "ab"]
    for letter, batch in zip("ab", batches, strict=True):  # either gateway answers for any batch: the state is in Redis
        done = await ended(second.sdk(), batch.id)
        assert done.status == "completed" and done.output_file_id is not None
        output = rows((await first.sdk().files.content(done.output_file_id)).content)
        assert sorted(row["custom_id"] for row in output) == sorted(f"{letter}-{i}" for i in range(20))


async def test_batches_list_newest_first_page_by_page(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway(batch_max_running=0)  # this gateway drives none: the batches stay validating
    sdk = served.sdk()
    made = [(await submitted(sdk, jsonl([line("a")]))).id for _ in range(5)]
    first = await sdk.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    assert [b.id async for b in sdk.batches.list(limit=2)] == made[::-1]  # the SDK follows `after`
    assert all(b.status == "validating" for b in first.data)


async def test_a_listing_goes_on_after_its_cursor_object_is_deleted(gateway: Any) -> None:
    sdk = (await gateway(batch_max_running=0)).sdk()
    made = [(await sdk.files.create(file=(f"{n}.jsonl", io.BytesIO(b"{}\n")), purpose="batch")).id for n in range(5)]
    newest = made[::-1]
    first = await sdk.files.list(limit=2)
    assert [f.id for f in first.data] == newest[:2] and first.has_more
    await sdk.files.delete(newest[1])  # the page's cursor is gone: the next page starts after its position still
    second = await sdk.files.list(limit=2, after=newest[1])
    assert [f.id for f in second.data] == newest[2:4] and second.has_more
    assert [f.id async for f in sdk.files.list(limit=2)] == [newest[0], *newest[2:]]


async def test_an_owners_index_lasts_as_long_as_its_longest_lived_record(redis_url: str) -> None:
    redis = open_async(redis_url)
    store = BatchStore(redis, "index-ttl", ttl_s=60)
    try:
        upload = await store.put_file("alice", "in.jsonl", "batch", b"{}\n")
        await store.keep_file(upload["id"], 7200)  # an input file kept for its batch outlives `ttl_s`
        await store.put_file("alice", "other.jsonl", "batch", b"{}\n")  # a later write must not shorten it
        assert await redis.ttl("{index-ttl:owner:alice}:files") > 3600
        assert await redis.zscore("{index-ttl:owner:alice}:files:until", upload["id"]) >= upload["expires_at"] + 7000
        await store.put_batch({"id": "batch_y", "status": "validating", "_owner": "alice", "input_file_id": "f"})
        assert await redis.ttl("{index-ttl:owner:alice}:batches") > 24 * 3600
        assert [f["id"] for f in (await store.listed("alice", "files", None, 10))[0]][-1] == upload["id"]
    finally:
        await redis.aclose()


# ------------------------------------------------------------------------------- across a gateway restart


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path, redis_with_aof(tmp_path / "redis"), save_tiny_model(tmp_path / "model", "llama"))
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.slow  # several processes (redis-server, a worker, gateways)
@pytest.mark.redis
@pytest.mark.model
def test_a_500_line_batch_completes_once_across_a_gateway_killed_mid_batch(stack: Stack) -> None:
    lease = ("--batch-lease-s", "2", "--batch-poll-s", "0.2", "--batch-window", "32")
    stack.start_worker()
    first = stack.start_gateway("first", *lease)
    stack.wait_ready()
    sdk = openai.OpenAI(base_url=f"{first.url}/v1", api_key="unused", max_retries=0)
    lines = [line(f"line-{i}", f"count to {i}", model=stack.model_id, max_tokens=2) for i in range(500)]
    upload = sdk.files.create(file=("big.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")

    def some_done() -> Any:
        now = sdk.batches.retrieve(batch.id)
        return now.request_counts is not None and now.request_counts.completed >= 20 and now

    midway = poll(some_done, 120, every_s=0.05, what="some lines done")
    os.killpg(first.process.popen.pid, signal.SIGKILL)  # no clean stop: its lease must expire
    first.process.popen.wait(10)
    del stack.gateways["first"]
    assert midway.status == "in_progress" and midway.request_counts.completed < 400, "nearly done before the kill"

    second = stack.start_gateway("second", *lease)
    stack.wait_ready()
    sdk = openai.OpenAI(base_url=f"{second.url}/v1", api_key="unused", max_retries=0)

    def ended_sync() -> Any:
        now = sdk.batches.retrieve(batch.id)
        return now.status in ENDED and now

    done = poll(ended_sync, 300, 0.2, "the batch ended")
    assert done.status == "completed", done
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (500, 0)
    assert done.output_file_id is not None
    output = rows(sdk.files.content(done.output_file_id).content)
    assert sorted(row["custom_id"] for row in output) == sorted(f"line-{i}" for i in range(500))
    assert len({row["response"]["request_id"] for row in output}) == 500


# ------------------------------------------------------------------------------------------ uploads


def test_a_multipart_body_gives_back_the_files_bytes_untouched() -> None:
    data = b'{"a": 1}\r\n--not-the-boundary\r\n\x00\xff'
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--XyZ--\r\n"
    )
    parts = split(body, b"XyZ")
    assert parts["purpose"].data == b"batch" and parts["purpose"].filename is None
    assert parts["file"].data == data and parts["file"].filename == "in.jsonl"
    with pytest.raises(APIError) as malformed:
        split(b"--XyZ\r\nno end", b"XyZ")
    assert malformed.value.status == 400


# ------------------------------------------------------------------------------------------ Redis Cluster


async def test_the_store_keeps_each_object_in_one_slot_of_a_redis_cluster(redis_cluster: RedisClusterSet) -> None:
    redis = open_async(redis_cluster.seed_url)
    store = BatchStore(redis, "llmq", ttl_s=3600)
    try:
        upload = await store.put_file("alice", "in.jsonl", "batch", b"{}\n")
        assert await store.file_data(upload["id"]) == b"{}\n" and await store.file("bob", upload["id"]) is None
        await store.keep_file(upload["id"], 7200)
        batch = {"id": "batch_x", "object": "batch", "status": "validating", "_owner": "alice", "input_file_id": "f"}
        await store.put_batch(batch | {"request_counts": {"total": 2, "completed": 0, "failed": 0}})
        moved = await store.update("batch_x", lambda now: {"status": "in_progress"})
        assert moved is not None and moved["status"] == "in_progress"
        await store.answer("batch_x", [("a", "line a", True), ("b", "line b", False), ("a", "again", True)])
        assert await store.counts("batch_x") == (1, 1) and await store.answered("batch_x") == {"a", "b"}
        assert (
            await store.answers("batch_x", True, 100) == b"line a\n" and await store.answers("batch_x", True, 6) is None
        )
        assert await store.take_lease("batch_x", "me", 5) and not await store.take_lease("batch_x", "you", 5)
        assert await store.renew_lease("batch_x", "me", 5) and not await store.renew_lease("batch_x", "you", 5)
        await store.release_lease("batch_x", "me")
        assert await store.take_lease("batch_x", "you", 5)
        await store.release_lease("batch_x", "me")  # not its lease any more: "you" keeps it
        assert not await store.take_lease("batch_x", "me", 5) and await store.renew_lease("batch_x", "you", 60)
        assert await redis.pttl("{llmq:batch:batch_x}:lease") > 5000
        assert [b["id"] for b in (await store.listed("alice", "batches", None, 10))[0]] == ["batch_x"]
        assert (await store.listed("bob", "files", None, 10)) == ([], False)
        assert owner_of("Bearer k1", True) == owner_of("bearer  k1 ", True) != owner_of("Bearer k2", True)
        assert owner_of("Bearer k1", False) == ANONYMOUS
        assert await store.to_drive() == ["batch_x"]
        assert await store.delete_file("alice", upload["id"]) and await store.file_data(upload["id"]) is None
    finally:
        await redis.aclose()
