"""`llmq submit`, `attach`, `cancel` and `chat` against a real redis-server and an in-process worker on the scripted
engine: the no-worker warning, the default timeout, each exit code a request can end with, unknown ids, and the
chat history."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from client import Client, Job, store
from client.cli.app import HANDLERS
from client.cli.exits import Exit
from client.cli.parser import DEFAULT_TIMEOUT_S
from client.cli.parser import build as build_parser
from tests.client.cli_support import heartbeat, llmq, scripted_text, scripted_worker
from tests.polling import wait_until

pytestmark = pytest.mark.redis
KEYS = store.Keys("default")


def test_submit_waits_600_s_by_default_and_0_means_no_limit() -> None:
    parser = build_parser(HANDLERS)
    assert parser.parse_args(["submit", "hi"]).timeout == DEFAULT_TIMEOUT_S == 600
    assert parser.parse_args(["submit", "hi", "--timeout", "0"]).timeout is None
    assert parser.parse_args(["attach", "x", "--timeout", "2.5"]).timeout == 2.5
    assert parser.parse_args(["chat"]).timeout == DEFAULT_TIMEOUT_S


async def test_submit_without_a_live_worker_warns_at_once_then_times_out(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    await server.hset(KEYS.workers, "gone", heartbeat("gone", at_ms=1))  # stopped long ago: not a live worker
    assert await llmq("submit", "hi", "--url", redis_url, "--timeout", "0.3") == Exit.TIMEOUT
    err = capsys.readouterr().err
    lines = err.splitlines()
    request_id = lines[0].split()[-1]  # "llmq: request <id>"
    assert lines[1].startswith("llmq: warning: no live worker on queue 'default'") and "--timeout (0.3 s)" in lines[1]
    assert lines[-1].startswith("llmq: error:") and f"llmq attach {request_id}" in lines[-1]
    assert await server.xlen(KEYS.requests) == 1  # still queued for a worker to come


async def test_submit_streams_from_a_live_worker_without_a_warning(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with scripted_worker(redis_url, tmp_path):
        code = await llmq("submit", "hi", "--url", redis_url, "--max-new-tokens", "5", "--temperature", "0")
    out = capsys.readouterr()
    assert code == Exit.OK and out.out == scripted_text("hi", 5) + "\n"
    assert "warning" not in out.err


async def test_a_request_the_worker_refuses_exits_1(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with scripted_worker(redis_url, tmp_path):  # its context is 512 tokens
        code = await llmq("submit", "hi", "--url", redis_url, "--max-new-tokens", "600", "--json")
    err = capsys.readouterr().err
    assert code == Exit.FAILED and "failed (invalid_request)" in err and "exceeds the model's context" in err


async def test_attach_streams_an_existing_request_and_cancel_says_it_ended(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with scripted_worker(redis_url, tmp_path):
        with Client(redis_url) as client:
            result = await asyncio.to_thread(
                lambda: client.generate("tell", max_new_tokens=6, temperature=0, request_id="att-1", timeout=30)
            )
        assert await llmq("attach", "att-1", "--url", redis_url) == Exit.OK
        assert capsys.readouterr().out == result.text + "\n" == scripted_text("tell", 6) + "\n"
        assert await llmq("--url", redis_url, "attach", "att-1", "--json") == Exit.OK
        assert json.loads(capsys.readouterr().out)["token_ids"] == result.token_ids
        assert await llmq("cancel", "att-1", "--url", redis_url) == Exit.OK
        assert "request att-1 already ended (length): nothing to cancel" in capsys.readouterr().out


async def test_cancelling_a_followed_request_exits_5(
    redis_url: str, server: aioredis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with scripted_worker(redis_url, tmp_path, step_s=0.02):  # 500 tokens: 10 s unless cancelled
        with Client(redis_url) as client:
            client.submit("long", max_new_tokens=500, request_id="long-1")
        following = asyncio.create_task(llmq("attach", "long-1", "--url", redis_url))
        await wait_until(lambda: server.xlen(KEYS.result("long-1")), within_s=30)  # it runs
        assert await llmq("cancel", "long-1", "--url", redis_url) == Exit.OK
        assert await following == Exit.CANCELLED
    out = capsys.readouterr()
    assert "cancel sent for long-1" in out.out and "request long-1 was cancelled after" in out.err


async def test_attach_and_cancel_of_an_unknown_id_exit_6_at_once(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("attach", "cancel"):
        assert await llmq(command, "no-such-id", "--url", redis_url) == Exit.NOT_FOUND
        err = capsys.readouterr().err
        assert err.startswith("llmq: error: no request 'no-such-id' on queue 'default'") and err.count("\n") == 1
    assert not await server.exists(KEYS.cancel("no-such-id"))  # nothing was sent
    with Client(redis_url) as client:
        client.submit("x", request_id="queued-1")  # known from its submit, before any worker saw it
    assert await llmq("cancel", "queued-1", "--url", redis_url) == Exit.OK
    assert await server.exists(KEYS.cancel("queued-1"))


async def test_chat_streams_each_answer_and_sends_the_history(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[dict[str, Any]] = []
    submit = Client.submit

    def recording(self: Client, *args: Any, **kwargs: Any) -> Job:
        sent.append(kwargs)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(Client, "submit", recording)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n\nand then?\n"))  # the empty line is skipped
    argv = ["chat", "--url", redis_url, "--system", "be brief", "--max-new-tokens", "4", "--temperature", "0"]
    async with scripted_worker(redis_url, tmp_path):
        assert await llmq(*argv) == Exit.OK
    first = scripted_text("be brief" + "hi", 4)  # the scripted engine reads the messages' contents, joined
    second = scripted_text("be brief" + "hi" + first + "and then?", 4)
    assert capsys.readouterr().out == f"{first}\n{second}\n"
    assert [call["messages"] for call in sent] == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and then?"},
        ],
    ]
    assert {call["priority"] for call in sent} == {"interactive"}
