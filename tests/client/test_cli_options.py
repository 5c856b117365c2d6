"""`llmq`'s command line itself: `--version`, connection options on either side of the subcommand, the exit codes
(each failure's, and the table in docs/cli.md), and one clear line when Redis refuses the credentials."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

import client
from client import protocol, store
from client.cli import main
from client.cli.exits import Exit, NotFound, failure
from client.errors import (
    Cancelled,
    InvalidRequest,
    QueueFull,
    RedisUnavailable,
    RequestExpired,
    RequestFailed,
    ResultTimeout,
)
from tests.client.cli_support import llmq
from worker.embedded_redis import RedisServer

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"llmq-redis {client.__version__}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "{url}", "--queue", "q1", "status", "--json"],
        ["status", "--json", "--url", "{url}", "--queue", "q1"],
        ["--url", "{url}", "status", "--queue", "q1", "--json"],
        ["--queue", "elsewhere", "status", "--queue", "q1", "--url", "{url}", "--json"],  # the later one wins
    ],
)
async def test_connection_options_before_or_after_the_subcommand(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    await server.xadd(store.Keys("q1").requests, {"m": b"x"})
    assert await llmq(*[arg.format(url=redis_url) for arg in argv]) == Exit.OK
    status = json.loads(capsys.readouterr().out)
    assert (status["queue"], status["depth"]) == ("q1", 1)


async def test_connection_options_around_a_nested_subcommand(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    letter = protocol.DeadLetterBody(entry_id="1-0", reason="why", raw=b"")
    await server.xadd(store.Keys("q2").dead, {"m": protocol.encode(letter)})
    for argv in (
        ["--queue", "q2", "dead", "list", "--json", "--url", redis_url],
        ["dead", "--queue", "q2", "list", "--url", redis_url, "--json"],
        ["dead", "list", "--json", "--queue", "q2", "--url", redis_url],
    ):
        assert await llmq(*argv) == Exit.OK
        assert json.loads(capsys.readouterr().out)["reason"] == "why"


RESULT = type("R", (), {"request_id": "r1", "token_ids": [1]})()


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RequestFailed("engine_failed", "boom", request_id="r1"), Exit.FAILED),
        (RequestExpired("expired", "too late"), Exit.FAILED),
        (InvalidRequest("temperature: out of range"), Exit.USAGE),
        (ValueError("not a Redis URL"), Exit.USAGE),
        (ResultTimeout("r1", 1.0, 0), Exit.TIMEOUT),
        (RedisUnavailable("Redis at redis://h did not serve a submit"), Exit.UNAVAILABLE),
        (redis.ConnectionError("refused"), Exit.UNAVAILABLE),
        (Cancelled(RESULT), Exit.CANCELLED),
        (NotFound("no request 'x'"), Exit.NOT_FOUND),
        (QueueFull("lane 'default' of queue 'q' holds 10 unfinished requests"), Exit.QUEUE_FULL),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else value.name,
)
def test_each_failure_has_its_exit_code(error: Exception, code: Exit) -> None:
    assert failure(error, "redis://localhost:6379/0")[0] == code


def test_a_timeout_says_how_to_follow_or_stop_the_request() -> None:
    _, message = failure(ResultTimeout("r1", 1.0, 0), "redis://localhost:6379/0")
    assert "`llmq attach r1`" in message and "`llmq cancel r1`" in message


def test_the_exit_code_table_in_the_docs_matches_the_enum() -> None:
    rows = re.findall(r"^\| `(\d+)` \| `([A-Z_]+)` \|", DOCS.read_text(), flags=re.M)
    assert [(int(value), name) for value, name in rows] == [(code.value, code.name) for code in Exit]


@pytest.fixture
def guarded_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of its own with a password, and a user `reader` allowed PING and HGETALL only."""
    server = RedisServer(tmp_path, "--requirepass", "right-one").start()
    admin = redis.Redis(host="127.0.0.1", port=server.port, password="right-one")
    admin.acl_setuser("reader", enabled=True, passwords=["+pw"], keys=["*"], commands=["+ping", "+hgetall"])
    admin.close()
    yield server
    server.stop()


def test_refused_credentials_are_one_line_without_the_password(
    guarded_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    port = guarded_redis.port
    cases = [
        (
            f"redis://:Wr0ng%40pw@127.0.0.1:{port}/0",
            f"Redis at redis://:***@127.0.0.1:{port}/0 refused the credentials",
        ),
        (f"redis://bob:Wr0ng%40pw@127.0.0.1:{port}/0", "refused the credentials: invalid username-password pair"),
        (f"redis://127.0.0.1:{port}/0", "requires a password and the URL has none"),
        (f"redis://reader:pw@127.0.0.1:{port}/0", "refused a command to user 'reader': this user has no permissions"),
    ]
    for url, expected in cases:
        for argv in (["status"], ["submit", "hi"], ["cancel", "some-id"], ["queues"], ["dead", "list"]):
            assert main([*argv, "--url", url]) == Exit.UNAVAILABLE, (url, argv)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("llmq: error: Redis at "), err
            assert expected in err, (argv, err)
            assert "Wr0ng" not in err and "HELLO" not in err, err
