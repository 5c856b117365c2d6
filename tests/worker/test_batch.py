"""`llmq batch`: an OpenAI Batch file through the queue, exactly once per line across a `kill -9` of the CLI,
with malformed lines answered in the output; and `submit_many` underneath it."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from client import AsyncClient, Client, InvalidRequest
from client.batch import run_batch
from tests.polling import wait_until
from tests.scripted_engine import expected_tokens, text_of

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
    # The malformed lines were answered by the first run (they come early): this one fails nothing.
    assert second.returncode == 0 and f"{GOOD + len(MALFORMED)}/{GOOD + len(MALFORMED)} done" in second.stderr

    rows = read_output(output)
    ids = [row["custom_id"] for row in rows]
    assert len(ids) == len(set(ids)) == GOOD + len(MALFORMED)
    for row in rows:
        if row["custom_id"].startswith("c"):
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


async def test_submit_many_keeps_its_window_and_reports_each_outcome(start_worker: Any, redis_url: str) -> None:
    await start_worker()
    requests = ({"input_ids": [3, i % 50 + 3], "max_new_tokens": 4} for i in range(200))
    bad = [{"input_ids": [3], "max_new_tokens": 0}]
    async with AsyncClient(redis_url, max_queue_len=20) as client:  # a full queue makes it wait, not fail
        outcomes = [o async for o in client.submit_many([*bad, *requests], window=32)]
    assert sorted(o.index for o in outcomes) == list(range(201))
    (refused,) = [o for o in outcomes if o.error is not None]
    assert refused.index == 0 and isinstance(refused.error, InvalidRequest)
    for outcome in outcomes[1:] if outcomes[0].index == 0 else outcomes:
        if outcome.index:
            assert outcome.result is not None
            assert outcome.result.token_ids == expected_tokens([3, (outcome.index - 1) % 50 + 3], 4)
