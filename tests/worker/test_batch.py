"""`llmq batch`: an OpenAI Batch file through the queue, exactly once per line across a `kill -9` of the CLI,
with malformed lines answered in the output; and `submit_many` underneath it."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from client import AsyncClient, Cancelled, Client, InvalidRequest, ResultTimeout
from client.batch import output_line, parse_line, run_batch
from client.errors import LimitExceeded
from testing.scripted_engine import expected_tokens, text_of
from tests.polling import wait_until

GOOD = 1000


def chat_line(index: int) -> str:
    body = {"messages": [{"role": "user", "content": f"q{index % 50}"}], "max_tokens": 6, "temperature": 0}
    return json.dumps({"custom_id": f"c{index}", "method": "POST", "url": "/v1/chat/completions", "body": body})


MALFORMED = [
    "{not json",
    json.dumps(["a", "list"]),
    json.dumps({"custom_id": "m-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    json.dumps({"custom_id": "m-body", "method": "POST", "url": "/v1/completions", "body": {"messages": []}}),
    json.dumps({"custom_id": "m-field", "url": "/v1/completions", "body": {"prompt": "x", "logit_bias": {"5": 1}}}),
    json.dumps({"custom_id": "m-range", "url": "/v1/completions", "body": {"prompt": "x", "temperature": 1e9}}),
]


def answer(index: int) -> str:
    return "".join(text_of(t) for t in expected_tokens(list(f"q{index % 50}".encode()), 6))


def read_output(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_killed_batch_resumes_exactly_once(start_worker: Any, redis_url: str, tmp_path: Path) -> None:
    running = await start_worker(step_s=0.002)
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [chat_line(i) for i in range(GOOD)]
    for offset, bad in enumerate(MALFORMED):
        lines.insert(100 * offset + 7, bad)
    source.write_text("\n".join(lines) + "\n")
    command = [sys.executable, "-m", "client.cli", "batch", str(source), "-o", str(output), "--url", redis_url]

    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(command, stderr=log)  # noqa: ASYNC220 - returns at once; the test polls its output
    await wait_until(lambda: output.exists() and output.read_text().count("\n") >= GOOD // 3, within_s=60)
    first.send_signal(signal.SIGKILL)
    first.wait()
    with output.open("a") as sink:
        sink.write('{"id": "cut sh')  # the kill left a line half written
    second = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
    # The malformed lines were answered by the first run (they come early); the exit status still reports them.
    total = GOOD + len(MALFORMED)
    assert second.returncode == 1 and f"{total}/{total} done, {len(MALFORMED)} failed" in second.stderr

    rows = read_output(output)
    keys = [row["custom_id"] if "line" not in row else row["line"] for row in rows]
    assert len(keys) == len(set(keys)) == total
    for row in rows:
        if (row["custom_id"] or "").startswith("c"):
            body = row["response"]["body"]
            assert row["error"] is None and row["response"]["status_code"] == 200
            assert body["choices"][0]["message"]["content"] == answer(int(row["custom_id"][1:]))
            assert body["usage"]["completion_tokens"] == 6 and body["object"] == "chat.completion"
        else:
            assert row["response"] is None and row["error"]["code"] == "invalid_request", row
    # Never generated twice: the rerun re-attached to what the killed run had submitted.
    assert sum(running.worker.engine.stats().requests_finished.values()) == GOOD


async def test_batch_answers_equal_one_at_a_time_on_the_real_engine(
    start_worker: Any, redis_url: str, tmp_path: Path
) -> None:
    await start_worker(real_model=True)
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = [f"The quick brown fox {i}" for i in range(12)]
    lines = [
        json.dumps(
            {"custom_id": f"p{i}", "url": "/v1/completions", "body": {"prompt": p, "max_tokens": 8, "temperature": 0}}
        )
        for i, p in enumerate(prompts)
    ]
    source.write_text("\n".join(lines) + "\n")
    with Client(redis_url) as client:
        failed = await asyncio.to_thread(run_batch, client, source, output, window=4, timeout=60)
        alone = [
            (await asyncio.to_thread(client.generate, p, max_new_tokens=8, temperature=0, timeout=60)).text
            for p in prompts
        ]
    assert failed == 0
    by_id = {row["custom_id"]: row["response"]["body"]["choices"][0]["text"] for row in read_output(output)}
    assert [by_id[f"p{i}"] for i in range(12)] == alone


async def test_lines_without_their_own_custom_id_are_known_by_number(
    start_worker: Any, redis_url: str, tmp_path: Path
) -> None:
    """A line with no usable custom_id, or one repeating an earlier line's, is answered once under its line
    number; no custom_id (not even one looking like a line number) stands for it, or it for one, on a rerun."""
    await start_worker()
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [chat_line(0), "{not json", chat_line(2).replace('"c2"', '"line-2"'), chat_line(3).replace('"c3"', '"c0"')]
    source.write_bytes(("\n".join(lines) + "\n").encode("utf-8-sig"))  # a byte-order mark is no malformed line
    with Client(redis_url) as client:
        assert await asyncio.to_thread(run_batch, client, source, output, window=4, timeout=60) == 2
        before = output.read_text()
        assert await asyncio.to_thread(run_batch, client, source, output, window=4, timeout=60) == 2
    assert output.read_text() == before  # the rerun wrote nothing and still reports the two failures
    rows = {row["custom_id"] if "line" not in row else row["line"]: row for row in read_output(output)}
    assert sorted(rows, key=str) == [2, 4, "c0", "line-2"]
    assert rows["c0"]["response"]["body"]["choices"][0]["message"]["content"] == answer(0)  # the first "c0"
    assert rows["line-2"]["error"] is None
    assert rows[2]["custom_id"] is None and "not JSON" in rows[2]["error"]["message"]
    assert rows[4]["custom_id"] == "c0" and "already line 1's" in rows[4]["error"]["message"]


def test_error_lines_name_the_codes_the_gateway_uses() -> None:
    line = parse_line(1, chat_line(1), "f" * 16)
    partial = SimpleNamespace(request_id=line.request_id, token_ids=[1, 2])
    errors = [
        Cancelled(partial),
        ResultTimeout(line.request_id, 5, 0),
        LimitExceeded("max_prompt_bytes", "too long"),
        InvalidRequest("x"),
    ]
    codes = [json.loads(output_line(line, "default", error=error))["error"]["code"] for error in errors]
    assert codes == ["cancelled", "timeout", "invalid_request", "invalid_request"]


async def test_submit_many_keeps_its_window_and_reports_each_outcome(start_worker: Any, redis_url: str) -> None:
    await start_worker()
    requests = ({"input_ids": [3, i % 50 + 3], "max_new_tokens": 4} for i in range(200))
    bad: list[Any] = [
        {"input_ids": [3], "max_new_tokens": 0},
        {"input_ids": [3], "max_tokens": 4},  # a typo: refused alone, the run goes on
        [("input_ids", [3])],  # not a mapping
    ]
    async with AsyncClient(redis_url, max_queue_len=20) as client:  # a full queue makes it wait, not fail
        outcomes = [o async for o in client.submit_many([*bad, *requests], window=32)]
    assert sorted(o.index for o in outcomes) == list(range(203))
    refused = sorted((o for o in outcomes if o.error is not None), key=lambda o: o.index)
    assert [o.index for o in refused] == [0, 1, 2]
    assert all(isinstance(o.error, InvalidRequest) for o in refused)
    assert "'max_tokens'" in str(refused[1].error) and "not list" in str(refused[2].error)
    for outcome in outcomes:
        if outcome.index > 2:
            assert outcome.result is not None
            assert outcome.result.token_ids == expected_tokens([3, (outcome.index - 3) % 50 + 3], 4)
