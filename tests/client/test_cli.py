"""`llmq` against the session's redis, through `main(argv)` and once as a real process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from client import protocol, store
from client.cli import main
from client.cli.app import HANDLERS
from client.cli.exits import Exit
from client.cli.parser import build as build_parser
from client.failover import FAILOVER_TIMEOUT_S
from tests.client.twins import KEYS, done, emit, tokens
from tests.polling import wait_until
from worker.embedded_redis import free_port

pytestmark = pytest.mark.redis


async def serve_one(
    server: aioredis.Redis, *events: protocol.TokensEvent | protocol.DoneEvent
) -> protocol.GenerateRequest:
    """Answer the next request on the default queue with `events`, as a worker would."""
    [[_key, [(_entry, fields)]]] = await server.xread({KEYS.requests: "0-0"}, block=10_000)
    request = protocol.decode_request(fields[protocol.ENTRY_FIELD])
    await emit(server, request.id, *events)
    return request


async def test_submit_streams_text(redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    serving = asyncio.create_task(serve_one(server, tokens(0, [1], "Hello"), tokens(1, [2], ", world"), done()))
    code = await asyncio.to_thread(
        main,
        [
            "submit",
            "Hi",
            "--url",
            redis_url,
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
            "--stop",
            "\n",
            "--stop",
            "END",
            "--top-k",
            "3",
            "--timeout",
            "10",
        ],
    )
    request = await serving
    out = capsys.readouterr()
    assert code == 0 and out.out == "Hello, world\n"
    assert f"request {request.id}" in out.err
    assert request.params == protocol.SamplingParams(max_new_tokens=5, temperature=0.0, top_k=3, stop=["\n", "END"])


async def test_submit_json(redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    serving = asyncio.create_task(serve_one(server, tokens(0, [1, 2], "ok"), done("stop", 2)))
    code = await asyncio.to_thread(main, ["submit", "Hi", "--url", redis_url, "--json", "--timeout", "10"])
    await serving
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (result["text"], result["token_ids"], result["finish_reason"]) == ("ok", [1, 2], "stop")
    assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}


async def test_submit_no_stream_reports_a_cancel(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    serving = asyncio.create_task(serve_one(server, tokens(0, [1], "part"), done("cancelled", 1)))
    code = await asyncio.to_thread(main, ["submit", "Hi", "--url", redis_url, "--no-stream", "--timeout", "10"])
    await serving
    out = capsys.readouterr()
    assert code == Exit.CANCELLED and out.out == "part\n" and "cancelled" in out.err


def test_submit_rejects_bad_input_without_redis(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "Hi", "--url", "redis://127.0.0.1:1/0", "--temperature", "-1"]) == Exit.USAGE
    assert "temperature" in capsys.readouterr().err


async def test_status_json(redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    await server.xadd(KEYS.requests, {"m": b"x"})  # unreadable: counted, but no size to estimate
    batch = protocol.encode(protocol.parse_request({"id": "b1", "prompt": "x" * 40, "submitted": 1}))
    for _ in range(3):
        await server.xadd(KEYS.lane("batch"), {"m": batch})
    await server.set(KEYS.fleet_rate, "100")
    await server.xadd(KEYS.dead, {"m": b"x"})
    assert await asyncio.to_thread(main, ["status", "--json", "--url", redis_url]) == 0
    status = json.loads(capsys.readouterr().out)
    tokens = 3 * (10 + protocol.DEFAULT_MAX_NEW_TOKENS)  # 40 bytes of prompt count 10 tokens
    lane = {"pending": None, "lag": None, "oldest_pending_age_s": None, "held": 0}  # nothing held: no worker read
    assert status == {
        "queue": "default",
        "depth": 4,
        "pending": None,
        "lag": None,
        "dead": 1,
        "workers": [],
        "oldest_pending_age_s": None,
        "stale_workers": [],
        "lanes": [
            {"lane": "interactive", "depth": 0, **lane, "backlog_tokens": 0, "backlog_seconds": 0.0},
            {"lane": "default", "depth": 1, **lane, "backlog_tokens": 0, "backlog_seconds": 0.0},
            {"lane": "batch", "depth": 3, **lane, "backlog_tokens": tokens, "backlog_seconds": tokens / 100},
        ],
        "tokens_per_s": 100.0,
        "partitions": [],  # one partition: no breakdown
        "prefix_caches": {},  # no live worker: none
        "tenants": [],  # none with a weight, quotas or requests held
    }


async def test_status_reports_the_oldest_pending_request(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    await server.xgroup_create(KEYS.requests, "workers", id="0", mkstream=True)
    await server.xadd(KEYS.requests, {"m": b"x"}, id=f"{protocol.ms_now() - 5000}-0")
    await server.xreadgroup("workers", "w", {KEYS.requests: ">"})
    assert await asyncio.to_thread(main, ["status", "--json", "--url", redis_url]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["pending"] == 1 and status["lag"] == 0 and 4.5 < status["oldest_pending_age_s"] < 60


async def test_status_text_lists_workers(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    now = protocol.ms_now()
    info = protocol.WorkerInfo(
        id="gpu-worker-1",
        host="h",
        pid=1,
        queue="default",
        model="m",
        running=2,
        waiting=3,
        kv_used_blocks=25,
        kv_total_blocks=100,
        tokens_generated=9,
        started=now,
        heartbeat=now,
    )
    await server.hset(KEYS.workers, "gpu-worker-1", protocol.encode(info))
    assert await asyncio.to_thread(main, ["status", "--url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "depth 0" in out and "live workers: 1" in out
    assert "gpu-worker-1" in out and "running 2" in out and "waiting 3" in out and "25/100 (25%)" in out
    assert "prefix cache" not in out  # a worker that reports no prefix cache (caching off, or an older release)
    await server.hset(
        KEYS.prefix_caches, "gpu-worker-1", protocol.encode(protocol.PrefixCacheInfo(queries=800, hits=600))
    )
    await server.hset(KEYS.prefix_caches, "gone-worker", protocol.encode(protocol.PrefixCacheInfo(queries=1, hits=1)))
    assert await asyncio.to_thread(main, ["status", "--url", redis_url]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if "gpu-worker-1" in line]
    assert "prefix cache 75% of 800 prompt tokens" in line and "gone-worker" not in out


async def test_cancel(redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    await server.set(store.Keys("chat").submitted("req-42"), 1)  # what a submit leaves
    assert await asyncio.to_thread(main, ["cancel", "req-42", "--url", redis_url, "--queue", "chat"]) == 0
    assert await server.exists(store.Keys("chat").cancel("req-42"))
    assert "cancel sent for req-42" in capsys.readouterr().out


def test_url_from_environment(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LLMQ_REDIS_URL", redis_url)
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["depth"] == 0


def test_errors_are_one_line_without_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    assert main(["status", "--url", url, "--failover-timeout", "0.5"]) == Exit.UNAVAILABLE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmq: error:")
    assert "hunter2" not in err and ":***@" in err
    assert main(["cancel", "bad id", "--url", url]) == Exit.USAGE
    assert "request id" in capsys.readouterr().err


def test_the_failover_window_defaults_to_20_s_and_is_set_by_flag_or_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert build_parser(HANDLERS).parse_args(["status"]).failover_timeout == FAILOVER_TIMEOUT_S == 20
    monkeypatch.setenv("LLMQ_FAILOVER_TIMEOUT_S", "3")
    parser = build_parser(HANDLERS)
    assert parser.parse_args(["status"]).failover_timeout == 3
    assert parser.parse_args(["--failover-timeout", "0", "status"]).failover_timeout == 0
    assert parser.parse_args(["status", "--failover-timeout", "7.5"]).failover_timeout == 7.5
    for bad in ("-1", "nan", "inf", "3601", "soon"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["status", "--failover-timeout", bad])
        assert exit_info.value.code == Exit.USAGE
        assert "--failover-timeout: must be seconds in [0, 3600]" in capsys.readouterr().err


def test_a_zero_window_fails_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    assert main(["status", "--url", url, "--failover-timeout", "0"]) == Exit.UNAVAILABLE
    assert time.monotonic() - started < FAILOVER_TIMEOUT_S / 2  # no 20 s wait: the one attempt failed
    assert "127.0.0.1" in capsys.readouterr().err


def test_console_entry_point(redis_url: str) -> None:
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url}
    done_ = subprocess.run(
        [sys.executable, "-m", "client.cli", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done_.returncode == 0, done_.stderr
    assert json.loads(done_.stdout)["queue"] == "default"


async def test_status_watch_redraws_with_token_rates(
    redis_url: str, server: aioredis.Redis, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    start = protocol.ms_now() - 10_000
    frames = iter([(100, start + 9_000), (300, start + 10_000)])

    async def beat() -> None:
        tokens, heartbeat = next(frames)
        info = protocol.WorkerInfo(
            id="w",
            host="h",
            pid=1,
            queue="default",
            model="m",
            running=1,
            waiting=0,
            kv_used_blocks=1,
            kv_total_blocks=10,
            tokens_generated=tokens,
            started=start,
            heartbeat=heartbeat,
        )
        await server.hset(KEYS.workers, "w", protocol.encode(info))

    await beat()
    loop = asyncio.get_running_loop()
    sleeps = []

    def fake_pause(stopped: threading.Event, seconds: float) -> None:  # a new heartbeat, then Ctrl-C
        sleeps.append(seconds)
        if len(sleeps) == 2:
            stopped.set()  # what the SIGINT handler does
            return
        asyncio.run_coroutine_threadsafe(beat(), loop).result()

    monkeypatch.setattr("client.cli.status.pause", fake_pause)
    assert await asyncio.to_thread(main, ["status", "--watch", "0.5", "--url", redis_url, "--stale-after", "60"]) == 0
    out = capsys.readouterr().out
    assert out.count("\x1b[H\x1b[2J") == 2 and sleeps == [0.5, 0.5]
    assert "11.1 tok/s" in out  # first frame: 100 tokens over the 9 s since start
    assert "200.0 tok/s" in out  # second frame: 200 more tokens in the 1 s between heartbeats


def test_batch_help_says_how_to_resume(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["batch", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "INPUT.jsonl" in text and "--output" in text and "exactly once" in text and "rerunning" in text


def test_batch_refuses_a_missing_input(tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["batch", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--url", redis_url])
    assert code == Exit.USAGE and "no such input file" in capsys.readouterr().err


def test_batch_refuses_an_output_that_is_a_folder_or_the_input(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}}\n')
    assert main(["batch", str(source), "-o", str(tmp_path), "--url", redis_url]) == Exit.USAGE
    assert "is a directory" in capsys.readouterr().err
    assert main(["batch", str(source), "-o", str(tmp_path / "." / "in.jsonl"), "--url", redis_url]) == Exit.USAGE
    assert "is the input file" in capsys.readouterr().err
    assert source.read_text().count("\n") == 1  # untouched


async def test_batch_files_run_in_the_batch_lane_unless_a_line_names_a_tier(
    redis_url: str, server: aioredis.Redis, tmp_path: Path
) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {**body, "service_tier": "priority"}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--url", redis_url, "--timeout", "0.5"]
    assert await asyncio.to_thread(main, argv) == Exit.FAILED  # no worker: both lines time out, and are error lines
    assert [await server.xlen(KEYS.lane(lane)) for lane in ("interactive", "default", "batch")] == [1, 0, 1]


async def test_a_batch_line_with_n_answers_every_choice_in_one_output_line(
    redis_url: str, server: aioredis.Redis, tmp_path: Path
) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 2, "seed": 5}
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "pair", "url": "/v1/completions", "body": body}) + "\n")
    argv = ["batch", str(source), "-o", str(output), "--url", redis_url, "--timeout", "20"]
    running = asyncio.create_task(asyncio.to_thread(main, argv))

    async def both_submitted() -> bool:
        return await server.xlen(KEYS.lane("batch")) == 2

    await wait_until(both_submitted, within_s=20)
    requests = [protocol.decode_request(f[protocol.ENTRY_FIELD]) for _, f in await server.xrange(KEYS.lane("batch"))]
    assert [request.params.seed for request in requests] == [5, 6]  # each choice seeded apart
    for index, request in enumerate(requests):  # the test plays the worker
        await emit(server, request.id, tokens(0, [index + 1], f"c{index}"), done("eos", 1))
    assert await running == Exit.OK
    [row] = [json.loads(text) for text in output.read_text().splitlines()]
    answer = row["response"]["body"]
    assert [(choice["index"], choice["text"]) for choice in answer["choices"]] == [(0, "c0"), (1, "c1")]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
