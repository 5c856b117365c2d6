"""Black-box tests of the `llmq` command's promises (issue 29, item 2) as a shell-script author meets them:
`llmq ...` run as a subprocess, judged only by its exit code, stdout and stderr, against a real redis-server
(the session's, a password-protected one, a Redis Cluster and a Sentinel set). The spec is docs/cli.md and
`llmq --help`; the exit codes asserted are read from the docs' table, so a test fails when the table and the
command disagree. Requests are served by the scripted in-process worker (`cli_support.scripted_worker`), whose
answers are a pure function of the prompt (`scripted_text`), so chat history can be checked token for token.
Keys are written only where docs/protocol.md names them (`{llmq:<queue>}:requests`, `:dead`, `:workers`, ...).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re
import signal
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from client import protocol
from testing.redis_topologies import RedisClusterSet, SentinelSet
from tests.client.cli_support import (
    LLMQ,
    PYTHON,
    ROOT,
    dead_letter,
    default_sigint,
    env,
    heartbeat,
    scripted_text,
    scripted_worker,
)
from worker.embedded_redis import RedisServer, free_port

pytestmark = pytest.mark.redis

GUARD_S = 120  # a hang guard for one command, never an assertion about speed


def documented_exit_codes() -> dict[str, int]:
    """The exit-code table of docs/cli.md: name -> code."""
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text.split("## Exit codes", 1)[1]
    rows = re.findall(r"^\| `(\d+)` \| `([A-Z_]+)` \|", section, flags=re.MULTILINE)
    return {name: int(code) for code, name in rows}


CODES = documented_exit_codes()


@dataclass
class Done:
    rc: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]

    def error_line(self) -> str:
        """The one `llmq: error: ...` line a failure prints (asserting there is exactly one)."""
        errors = [line for line in self.err_lines if line.startswith("llmq: error:")]
        assert len(errors) == 1, self
        return errors[0]


async def llmq(*args: str, stdin: str | None = None, program: Sequence[str] = (LLMQ,), **extra_env: str) -> Done:
    """`llmq ARGS` as a subprocess, without blocking the loop (an in-process worker serves it meanwhile)."""
    process = await asyncio.create_subprocess_exec(
        *program,
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=env(**extra_env),
    )
    try:
        out, err = await asyncio.wait_for(
            process.communicate(None if stdin is None else stdin.encode()), timeout=GUARD_S
        )
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return Done(process.returncode, out.decode(), err.decode())


def request_id_of(done: Done) -> str:
    """The id `submit` prints on stderr (`llmq: request ID`)."""
    match = re.search(r"^llmq: request (\S+)$", done.err, flags=re.MULTILINE)
    assert match, done
    return match.group(1)


def lane_key(queue: str = "default", lane: str = "default") -> str:
    return f"{{llmq:{queue}}}:requests" + ("" if lane == "default" else f":{lane}")


def dead_key(queue: str = "default") -> str:
    return f"{{llmq:{queue}}}:dead"


def request(request_id: str, prompt: str = "hello", **params: object) -> protocol.GenerateRequest:
    sampling = protocol.SamplingParams(**{"max_new_tokens": 6, "temperature": 0, **params})
    return protocol.GenerateRequest(id=request_id, prompt=prompt, params=sampling, submitted=protocol.ms_now())


@pytest.fixture
async def server(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis.from_url(redis_url)
    yield conn
    await conn.aclose()


# --- version and global options ------------------------------------------------------------------------------


async def test_version_prints_the_distribution_and_its_version() -> None:
    version = importlib.metadata.version("llmq-redis")
    for program in ((LLMQ,), (PYTHON, "-m", "client.cli")):
        done = await llmq("--version", program=program)
        assert done.rc == 0, done
        assert done.out.strip() == f"llmq-redis {version}", done


async def test_help_lists_every_documented_command() -> None:
    done = await llmq("--help")
    assert done.rc == 0
    for command in ("submit", "attach", "chat", "status", "queues", "cancel", "dead", "batch"):
        assert re.search(rf"^\s+{command}\s", done.out, flags=re.MULTILINE), command


async def test_connection_options_go_before_or_after_the_subcommand(redis_url: str, server: aioredis.Redis) -> None:
    await server.xadd(lane_key("qa"), {"m": b"x"})
    await server.xadd(lane_key("qa"), {"m": b"y"})
    await server.xadd(dead_key("qa"), {"m": dead_letter(request("r-qa"))})
    variants = [
        ("--url", redis_url, "--queue", "qa", "status", "--json"),
        ("status", "--json", "--url", redis_url, "--queue", "qa"),
        ("--url", redis_url, "status", "--queue", "qa", "--json"),
        ("--queue", "nope", "--url", "redis://127.0.0.1:1/0", "status", "--url", redis_url, "--queue", "qa", "--json"),
        ("--prefix", "llmq", "--partitions", "1", "status", "--url", redis_url, "--queue", "qa", "--json"),
    ]
    for argv in variants:
        done = await llmq(*argv)
        assert done.rc == 0, (argv, done)
        status = json.loads(done.out)
        assert (status["queue"], status["depth"], status["dead"]) == ("qa", 2, 1), argv

    # after a nested subcommand, too, and the later one wins there as well
    done = await llmq("--queue", "nope", "dead", "list", "--json", "--url", redis_url, "--queue", "qa")
    assert done.rc == 0, done
    assert [json.loads(line)["request_id"] for line in done.out.splitlines()] == ["r-qa"]

    # the later of two URLs wins: a bad one after a good one is the one used
    done = await llmq("--url", redis_url, "status", "--url", "http://nowhere")
    assert done.rc == CODES["USAGE"], done
    assert "http://nowhere" in done.error_line()


async def test_the_environment_supplies_the_url_and_a_flag_overrides_it(redis_url: str, server: aioredis.Redis) -> None:
    await server.xadd(lane_key(), {"m": b"x"})
    done = await llmq("status", "--json", LLMQ_REDIS_URL=redis_url)
    assert done.rc == 0, done
    assert json.loads(done.out)["depth"] == 1
    done = await llmq("status", "--json", "--url", redis_url, LLMQ_REDIS_URL="redis://127.0.0.1:1/0")
    assert done.rc == 0, done


# --- exit codes ---------------------------------------------------------------------------------------------


def test_the_docs_table_names_every_exit_code_once() -> None:
    assert CODES == {
        "OK": 0,
        "FAILED": 1,
        "USAGE": 2,
        "TIMEOUT": 3,
        "UNAVAILABLE": 4,
        "CANCELLED": 5,
        "NOT_FOUND": 6,
        "QUEUE_FULL": 7,
        "INTERRUPTED": 130,
    }


HOSTILE_USAGE = [
    ("submit", ""),  # empty prompt
    ("submit", "x", "--max-new-tokens", "0"),
    ("submit", "x", "--max-new-tokens", "-1"),
    ("submit", "x", "--max-new-tokens", str(10**30)),
    ("submit", "x", "--temperature", "nan"),
    ("submit", "x", "--temperature", "-1"),
    ("submit", "x", "--top-p", "2"),
    ("submit", "x", "--top-k", "-5"),
    ("submit", "x", "--seed", str(10**30)),
    ("submit", "x", "--deadline", "-5"),
    ("submit", "x", "--deadline", "nan"),
    ("submit", "x", "--deadline", "1e30"),
    ("submit", "x", "--stop", ""),
    ("submit", "\udcff\udcfe"),  # argv bytes that are not UTF-8 (os.fsdecode's surrogateescape)
    ("submit", "x", "--stop", "\udcff"),
    ("submit", "x", "--timeout", "-1"),
    ("submit", "x", "--timeout", "nan"),
    ("submit", "x", "--timeout", "abc"),
    ("submit", "x", "--priority", "urgent"),
    ("submit",),  # no prompt
    ("nosuchcommand",),
    ("attach", ""),
    ("attach", "a b"),
    ("attach", "*"),
    ("attach", "id*"),
    ("attach", "x" * 129),
    ("attach", "idé"),
    ("cancel", ""),
    ("cancel", "a b"),
    ("cancel", "*"),
    ("cancel", "[ab]"),
    ("cancel", "ü"),
    ("--queue", "", "status"),
    ("--queue", "a*", "status"),
    ("--queue", "q?", "queues"),
    ("--queue", "[ab]", "submit", "x"),
    ("--queue", "a b", "dead", "list"),
    ("--queue", "{tag}", "status"),
    ("--queue", "ü", "status"),
    ("--prefix", "", "status"),
    ("--prefix", "ll*", "queues"),
    ("--partitions", "0", "status"),
    ("--partitions", "-1", "status"),
    ("--partitions", str(10**12), "status"),
    ("--partitions", "abc", "status"),
    ("queues", "--max-keys", "0"),
    ("queues", "--max-keys", "-1"),
    ("queues", "--stale-after", "0"),
    ("status", "--stale-after", "-1"),
    ("status", "--stale-after", "nan"),
    ("dead", "list", "--limit", "-1"),
    ("dead", "list", "--limit", "0"),
    ("dead", "list", "--limit", ""),
    ("dead", "list", "--limit", "1.5"),
    ("dead", "drop", "--all", "--limit", "-1"),
    ("dead", "replay", "--all", "--limit", "0"),
    ("dead", "replay", "--all", "--priority", "urgent"),
    ("dead",),
    ("dead", "frobnicate"),
    ("--url", "", "status"),
    ("--url", "http://127.0.0.1:6379/0", "status"),
    ("--url", "not a url", "queues"),
    ("--url", "redis://127.0.0.1:99999/0", "status"),
]


@pytest.mark.parametrize("argv", HOSTILE_USAGE, ids=lambda argv: " ".join(argv) or "-")
async def test_bad_flags_and_refused_requests_exit_with_the_usage_code(redis_url: str, argv: tuple[str, ...]) -> None:
    done = await llmq(*argv, LLMQ_REDIS_URL=redis_url)
    assert done.rc == CODES["USAGE"], done
    assert done.out == "", done
    assert "error:" in done.err_lines[-1], done
    assert "Traceback" not in done.err, done


async def test_nothing_was_queued_by_refused_requests(redis_url: str, server: aioredis.Redis) -> None:
    await asyncio.gather(*(llmq(*argv, LLMQ_REDIS_URL=redis_url) for argv in HOSTILE_USAGE if argv[:1] == ("submit",)))
    for lane in ("interactive", "default", "batch"):
        assert await server.xlen(lane_key(lane=lane)) == 0


async def test_a_closed_port_exits_unavailable_after_the_failover_window(tmp_path: Path) -> None:
    """Every command waits out the failover window (`--failover-timeout`, 1 s here), then exits 4."""
    url = f"redis://:pa%40ss%3Aw0rd@127.0.0.1:{free_port()}/0"
    commands = [
        ("status",),
        ("queues",),
        ("submit", "hello", "--timeout", "1"),
        ("cancel", "abc"),
        ("attach", "abc"),
        ("dead", "list"),
        ("dead", "drop", "--all"),
    ]
    window = ("--url", url, "--failover-timeout", "1")
    chat = llmq(*window, "chat", "--timeout", "1", stdin="hi\n")
    results = await asyncio.gather(*(llmq(*window, *argv) for argv in commands), chat)
    for argv, done in zip([*commands, ("chat",)], results, strict=True):
        assert done.rc == CODES["UNAVAILABLE"], (argv, done)
        line = done.error_line()
        assert "127.0.0.1" in line, line
        for secret in ("pa@ss", "pa%40ss", "w0rd", "%3Aw0rd"):
            assert secret not in done.err + done.out, (argv, done)


async def test_a_timeout_exits_3_and_names_the_commands_that_follow_or_stop_it(redis_url: str) -> None:
    done = await llmq("--url", redis_url, "submit", "no worker here", "--timeout", "0.5")
    assert done.rc == CODES["TIMEOUT"], done
    request_id = request_id_of(done)
    line = done.error_line()
    assert f"llmq attach {request_id}" in line and f"llmq cancel {request_id}" in line, line
    # the request stays queued: `attach` finds it (and times out too, rather than saying not found)
    again = await llmq("--url", redis_url, "attach", request_id, "--timeout", "0.3")
    assert again.rc == CODES["TIMEOUT"], again


async def test_a_full_lane_exits_queue_full(redis_url: str, server: aioredis.Redis) -> None:
    """The CLI's client has the library's default `max_queue_len` (10000, docs/client.md)."""
    pipe = server.pipeline(transaction=False)
    for _ in range(10_000):
        pipe.xadd(lane_key(), {"m": b"backlog"})
    await pipe.execute()
    done = await llmq("--url", redis_url, "submit", "one more", "--timeout", "1")
    assert done.rc == CODES["QUEUE_FULL"], done
    assert "default" in done.error_line()
    assert await server.xlen(lane_key()) == 10_000
    # another lane has its own limit
    other = await llmq("--url", redis_url, "submit", "one more", "--priority", "batch", "--timeout", "0.3")
    assert other.rc == CODES["TIMEOUT"], other


async def test_the_worker_refusing_a_request_exits_failed(redis_url: str, tmp_path: Path) -> None:
    async with scripted_worker(redis_url, tmp_path):
        # the scripted model's context is 512 tokens: prompt + max_new_tokens beyond it is the worker's refusal
        done = await llmq("--url", redis_url, "submit", "x" * 300, "--max-new-tokens", "300", "--timeout", "60")
    assert done.rc == CODES["FAILED"], done
    assert done.out == ""
    assert "invalid_request" in done.error_line() or "context" in done.error_line(), done


async def test_an_expired_deadline_exits_failed(redis_url: str, tmp_path: Path) -> None:
    first = await llmq("--url", redis_url, "submit", "late", "--deadline", "0.01", "--timeout", "0.5")
    assert first.rc == CODES["TIMEOUT"], first
    request_id = request_id_of(first)
    async with scripted_worker(redis_url, tmp_path):
        done = await llmq("--url", redis_url, "attach", request_id, "--timeout", "60")
    assert done.rc == CODES["FAILED"], done
    assert "expired" in done.error_line(), done


# --- submit ---------------------------------------------------------------------------------------------------


async def test_submit_without_a_live_worker_warns_at_once_and_waits_600_s_by_default(
    redis_url: str, tmp_path: Path
) -> None:
    process = await asyncio.create_subprocess_exec(
        LLMQ, "--url", redis_url, "submit", "anyone there?",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env(),
    )  # fmt: skip
    assert process.stderr is not None
    lines: list[str] = []
    try:
        while not any("no live worker" in line for line in lines):
            line = (await asyncio.wait_for(process.stderr.readline(), GUARD_S)).decode()
            assert line, f"stderr ended without the warning: {lines}"
            lines.append(line)
        # warned while still waiting (not at the end of a wait), and it says how long it will wait
        assert process.returncode is None
        warning = next(line for line in lines if "no live worker" in line)
        assert warning.startswith("llmq: warning:"), warning
        assert "600" in warning, warning
    finally:
        process.kill()
        await asyncio.wait_for(process.wait(), GUARD_S)
    # the request stayed queued for the next worker
    request_id = lines[0].split()[-1]
    async with scripted_worker(redis_url, tmp_path):
        done = await llmq("--url", redis_url, "attach", request_id, "--no-stream", "--timeout", "60")
    assert done.rc == 0, done
    assert done.out.strip() == scripted_text("anyone there?", 256)


async def test_ctrl_c_while_streaming_cancels_the_request_then_exits_130(redis_url: str, tmp_path: Path) -> None:
    async with scripted_worker(redis_url, tmp_path, step_s=0.05):
        process = await asyncio.create_subprocess_exec(
            LLMQ, "--url", redis_url, "submit", "interrupt me", "--max-new-tokens", "240",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env(),
            preexec_fn=default_sigint,
        )  # fmt: skip
        assert process.stderr is not None and process.stdout is not None
        request_id = (await asyncio.wait_for(process.stderr.readline(), GUARD_S)).decode().split()[-1]
        assert await asyncio.wait_for(process.stdout.read(3), GUARD_S)  # tokens are streaming
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), GUARD_S)
        assert process.returncode == CODES["INTERRUPTED"], err
        done = await llmq("--url", redis_url, "attach", request_id, "--json", "--timeout", "60")
    assert done.rc == CODES["CANCELLED"], done
    result = json.loads(done.out)
    assert result["finish_reason"] == "cancelled"
    assert len(result["token_ids"]) < 240


async def test_ctrl_c_as_soon_as_the_id_is_printed_cancels_the_request(
    redis_url: str, server: aioredis.Redis, tmp_path: Path
) -> None:
    workers = "{llmq:default}:workers"
    stale = {f"gone-{n}": heartbeat(f"gone-{n}", at_ms=1) for n in range(100_000)}
    names = list(stale)
    for start in range(0, len(names), 10_000):
        await server.hset(workers, mapping={name: stale[name] for name in names[start : start + 10_000]})
    process = await asyncio.create_subprocess_exec(
        LLMQ, "--url", redis_url, "submit", "stop me",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env(),
        preexec_fn=default_sigint,
    )  # fmt: skip
    assert process.stderr is not None
    first = (await asyncio.wait_for(process.stderr.readline(), GUARD_S)).decode()
    assert first.startswith("llmq: request "), first
    request_id = first.split()[-1]
    process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(process.wait(), GUARD_S) == CODES["INTERRUPTED"]
    await server.delete(workers)
    async with scripted_worker(redis_url, tmp_path):
        done = await llmq("--url", redis_url, "attach", request_id, "--no-stream", "--timeout", "60")
    assert done.rc == CODES["CANCELLED"], (done.rc, done.err)


async def test_submit_with_a_live_worker_streams_the_answer_and_does_not_warn(redis_url: str, tmp_path: Path) -> None:
    prompt = "Grüße, 世界 🌍"
    async with scripted_worker(redis_url, tmp_path):
        streamed = await llmq("--url", redis_url, "submit", prompt, "--max-new-tokens", "7", "--temperature", "0")
        whole = await llmq("submit", prompt, "--max-new-tokens", "7", "--no-stream", "--url", redis_url)
        as_json = await llmq("--url", redis_url, "submit", prompt, "--max-new-tokens", "7", "--json")
        dash = await llmq("--url", redis_url, "submit", "--max-new-tokens", "3", "--", "-starts with a dash")
    expected = scripted_text(prompt, 7)
    for done in (streamed, whole):
        assert done.rc == 0, done
        assert done.out.strip() == expected, done
        assert "no live worker" not in done.err, done
    assert as_json.rc == 0, as_json
    result = json.loads(as_json.out)
    assert result["text"] == expected
    assert len(result["token_ids"]) == 7
    assert dash.rc == 0, dash
    assert dash.out.strip() == scripted_text("-starts with a dash", 3)


async def test_submit_to_a_queue_whose_name_looks_like_a_pattern_part(redis_url: str, tmp_path: Path) -> None:
    """`.`, `:` and `-` are allowed in names; a queue `a.b` is not the queue `a:b` nor `default`."""
    async with scripted_worker(redis_url, tmp_path, queue="a.b"):
        served = await llmq("--url", redis_url, "--queue", "a.b", "submit", "dots", "--max-new-tokens", "2")
        elsewhere = await llmq("--url", redis_url, "--queue", "a:b", "submit", "colon", "--timeout", "0.5")
    assert served.rc == 0, served
    assert served.out.strip() == scripted_text("dots", 2)
    assert elsewhere.rc == CODES["TIMEOUT"], elsewhere
    assert "no live worker on queue 'a:b'" in elsewhere.err, elsewhere


async def test_partitioned_queue_submit_attach_status_queues(redis_url: str, tmp_path: Path) -> None:
    prompts = [f"part {n}" for n in range(6)]
    async with scripted_worker(redis_url, tmp_path, queue_partitions=4):
        submitted = [
            await llmq("--url", redis_url, "--partitions", "4", "submit", prompt, "--max-new-tokens", "3")
            for prompt in prompts[:3]
        ] + [
            await llmq("--url", redis_url, "submit", prompt, "--max-new-tokens", "3", LLMQ_QUEUE_PARTITIONS="4")
            for prompt in prompts[3:]
        ]
        attached = [
            await llmq("--url", redis_url, "attach", request_id_of(done), "--no-stream", "--partitions", "4")
            for done in submitted
        ]
        status = await llmq("--url", redis_url, "status", "--json", "--partitions", "4")
        listed = await llmq("--url", redis_url, "queues", "--json")
    for prompt, done, again in zip(prompts, submitted, attached, strict=True):
        assert done.rc == 0 and done.out.strip() == scripted_text(prompt, 3), done
        assert again.rc == 0 and again.out.strip() == scripted_text(prompt, 3), again
    assert status.rc == 0, status
    assert len(json.loads(status.out)["partitions"]) == 4
    assert listed.rc == 0, listed
    assert [(row["queue"], row["partitions"]) for row in json.loads(listed.out)] == [("default", 4)]


# --- cancel and attach --------------------------------------------------------------------------------------


@pytest.mark.parametrize("request_id", ["nosuch", "0", "1-0", "-", "a.b:c-d", "x" * 128])
async def test_cancel_and_attach_of_an_unknown_id_exit_not_found(redis_url: str, request_id: str) -> None:
    for command in ("cancel", "attach"):
        done = await llmq("--url", redis_url, command, "--", request_id)
        assert done.rc == CODES["NOT_FOUND"], (command, done)
        line = done.error_line()
        assert request_id in line and "default" in line, line
        assert done.out == ""


async def test_unknown_id_on_another_queue_is_not_found_there(redis_url: str) -> None:
    submitted = await llmq("--url", redis_url, "--queue", "qx", "submit", "here", "--timeout", "0.3")
    request_id = request_id_of(submitted)
    done = await llmq("--url", redis_url, "--queue", "qy", "cancel", request_id)
    assert done.rc == CODES["NOT_FOUND"], done
    done = await llmq("--url", redis_url, "--queue", "qx", "cancel", request_id)
    assert done.rc == 0, done


async def test_cancel_a_queued_request_then_it_ends_cancelled(redis_url: str, tmp_path: Path) -> None:
    submitted = await llmq("--url", redis_url, "submit", "never mind", "--timeout", "0.3")
    request_id = request_id_of(submitted)
    cancelled = await llmq("--url", redis_url, "cancel", request_id)
    assert cancelled.rc == 0, cancelled
    async with scripted_worker(redis_url, tmp_path):
        done = await llmq("--url", redis_url, "attach", request_id, "--json", "--timeout", "60")
    assert done.rc == CODES["CANCELLED"], done
    assert len(done.err_lines) == 1 and "cancelled" in done.err, done
    assert json.loads(done.out)["finish_reason"] == "cancelled"


async def test_cancel_from_another_process_ends_the_follower_with_cancelled(redis_url: str, tmp_path: Path) -> None:
    async with scripted_worker(redis_url, tmp_path, step_s=0.05):
        process = await asyncio.create_subprocess_exec(
            LLMQ, "--url", redis_url, "submit", "long one", "--max-new-tokens", "240", "--timeout", "100",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env(),
        )  # fmt: skip
        assert process.stderr is not None and process.stdout is not None
        request_id = (await asyncio.wait_for(process.stderr.readline(), GUARD_S)).decode().split()[-1]
        first_text = await asyncio.wait_for(process.stdout.read(3), GUARD_S)  # streaming has begun
        assert first_text
        cancel = await llmq("--url", redis_url, "cancel", request_id)
        rest, err = await asyncio.wait_for(process.communicate(), GUARD_S)
    assert cancel.rc == 0, cancel
    assert process.returncode == CODES["CANCELLED"], err
    text = (first_text + rest).decode().strip()
    assert scripted_text("long one", 240).startswith(text)
    assert len(text) < len(scripted_text("long one", 240))


async def test_cancel_of_a_finished_request_says_so_and_exits_0(redis_url: str, tmp_path: Path) -> None:
    async with scripted_worker(redis_url, tmp_path):
        finished = await llmq("--url", redis_url, "submit", "done soon", "--max-new-tokens", "2")
    assert finished.rc == 0, finished
    request_id = request_id_of(finished)
    done = await llmq("--url", redis_url, "cancel", request_id)
    assert done.rc == 0, done
    said = (done.out + done.err).lower()
    assert "already" in said or "ended" in said or "finished" in said, done
    assert "cancel sent" not in said, done
    # and the result is still what the worker answered
    attached = await llmq("--url", redis_url, "attach", request_id, "--no-stream")
    assert attached.rc == 0, attached
    assert attached.out.strip() == scripted_text("done soon", 2)


async def test_attach_follows_a_request_submitted_elsewhere_from_its_first_token(
    redis_url: str, tmp_path: Path
) -> None:
    queued = await llmq("--url", redis_url, "submit", "follow me", "--max-new-tokens", "9", "--timeout", "0.3")
    request_id = request_id_of(queued)
    async with scripted_worker(redis_url, tmp_path):
        streamed = await llmq("--url", redis_url, "attach", request_id)
        whole = await llmq("attach", request_id, "--no-stream", "--url", redis_url)
        as_json = await llmq("--url", redis_url, "attach", request_id, "--json")
    expected = scripted_text("follow me", 9)
    assert streamed.rc == 0 and streamed.out.strip() == expected, streamed
    assert whole.rc == 0 and whole.out.strip() == expected, whole
    assert as_json.rc == 0, as_json
    assert json.loads(as_json.out)["text"] == expected


# --- passwords ---------------------------------------------------------------------------------------------

PASSWORDS = ["p@ss", "p:ss", "p/ss", "p%ss", "pässwörd€", "a b", "%41%", "hunter2:#?x/@y"]


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server whose default user needs `right-one`, plus one ACL user per hostile password."""
    server = RedisServer(Path(tmp_path_factory.mktemp("locked")), "--requirepass", "right-one").start()
    with redis.Redis(port=server.port, password="right-one") as conn:
        for index, password in enumerate(PASSWORDS):
            conn.execute_command("ACL", "SETUSER", f"u{index}", "on", f">{password}", "~*", "&*", "+@all")
        conn.execute_command("ACL", "SETUSER", "reader", "on", ">reader-pw", "~*", "&*", "+@read", "+ping")
    yield server
    server.stop()


def secret_fragments(password: str) -> set[str]:
    return {password, quote(password, safe=""), quote(password)}


@pytest.mark.parametrize("index", range(len(PASSWORDS)), ids=PASSWORDS)
async def test_hostile_passwords_right_wrong_and_missing(locked_redis: RedisServer, index: int) -> None:
    password = PASSWORDS[index]
    host = f"127.0.0.1:{locked_redis.port}"
    right = await llmq("--url", f"redis://u{index}:{quote(password, safe='')}@{host}/0", "status", "--json")
    assert right.rc == 0, right
    wrong_password = password + "-nope"
    wrong = await llmq("--url", f"redis://u{index}:{quote(wrong_password, safe='')}@{host}/0", "status")
    assert wrong.rc == CODES["UNAVAILABLE"], wrong
    assert len(wrong.err_lines) == 1, wrong
    assert "refused the credentials" in wrong.error_line()
    for secret in secret_fragments(password) | secret_fragments(wrong_password):
        assert secret not in wrong.err + wrong.out, (secret, wrong)


async def test_a_wrong_password_fails_in_one_line_for_every_command(locked_redis: RedisServer) -> None:
    url = f"redis://:wr%40ng%2Fs3cr%C3%A9t@127.0.0.1:{locked_redis.port}/0"
    commands = [
        ("status",),
        ("queues",),
        ("submit", "x"),
        ("cancel", "abc"),
        ("attach", "abc"),
        ("dead", "list"),
        ("dead", "show", "1-0"),
        ("dead", "replay", "--all"),
        ("dead", "drop", "--all"),
    ]
    results = await asyncio.gather(*(llmq("--url", url, *argv) for argv in commands))
    results.append(await llmq("--url", url, "chat", stdin="hi\n"))
    for argv, done in zip([*commands, ("chat",)], results, strict=True):
        assert done.rc == CODES["UNAVAILABLE"], (argv, done)
        assert len(done.err_lines) == 1, (argv, done)
        assert "refused the credentials" in done.error_line(), (argv, done)
        for secret in ("wr@ng", "wr%40ng", "s3cr", "%C3%A9"):
            assert secret not in done.err + done.out, (argv, done)


async def test_a_missing_password_says_the_url_has_none(locked_redis: RedisServer) -> None:
    done = await llmq("--url", f"redis://127.0.0.1:{locked_redis.port}/0", "queues")
    assert done.rc == CODES["UNAVAILABLE"], done
    assert len(done.err_lines) == 1, done
    assert "requires a password and the URL has none" in done.error_line()


async def test_a_user_refused_a_command_by_acl_exits_unavailable(locked_redis: RedisServer) -> None:
    done = await llmq("--url", f"redis://reader:reader-pw@127.0.0.1:{locked_redis.port}/0", "submit", "x")
    assert done.rc == CODES["UNAVAILABLE"], done
    assert len(done.err_lines) == 1, done
    assert "reader-pw" not in done.err


async def test_an_unencoded_slash_in_the_password_is_not_echoed(locked_redis: RedisServer) -> None:
    done = await llmq("--url", f"redis://:topsecret/x@127.0.0.1:{locked_redis.port}/0", "status")
    assert done.rc != 0
    assert "topsecret" not in done.err + done.out, done


async def test_sentinel_credentials_refused_in_one_line(tmp_path: Path) -> None:
    with SentinelSet(tmp_path / "sentinel", password="data secret", sentinel_password="watch:secret") as sentinels:
        right = await llmq("--url", sentinels.url, "status", "--json")
        assert right.rc == 0, right
        hosts = ",".join(f"{host}:{port}" for host, port in sentinels.sentinel_addresses)
        name = sentinels.service_name
        wrong_data = f"redis+sentinel://:bad%20data%40pw@{hosts}/{name}?sentinel_password=watch%3Asecret"
        wrong_watch = f"redis+sentinel://:data%20secret@{hosts}/{name}?sentinel_password=bad%3Awatch%2Fpw"
        for url in (wrong_data, wrong_watch):
            done = await llmq("--url", url, "status")
            assert done.rc == CODES["UNAVAILABLE"], done
            assert len(done.err_lines) == 1, done
            for secret in (
                "bad data",
                "bad%20data",
                "data%40pw",
                "bad:watch",
                "bad%3Awatch",
                "watch%2Fpw",
                "data%20secret",
            ):
                assert secret not in done.err + done.out, (secret, done)


# --- queues ------------------------------------------------------------------------------------------------


async def test_queues_lists_every_queue_with_depth_dead_and_live_workers(
    redis_url: str, server: aioredis.Redis
) -> None:
    """More queues than one SCAN page (1000 keys), in every kind of key a queue's traffic creates."""
    expected: dict[str, tuple[int, int, int]] = {}
    pipe = server.pipeline(transaction=False)
    for n in range(1500):
        queue = f"q{n:04d}"
        depth, dead, live = n % 3, n % 2, n % 4 == 0
        for i in range(depth):
            pipe.xadd(lane_key(queue, ("default", "interactive", "batch")[i]), {"m": b"x"})
        for _ in range(dead):
            pipe.xadd(dead_key(queue), {"m": dead_letter(request(f"r{n}"))})
        if live:
            pipe.hset(f"{{llmq:{queue}}}:workers", f"w{n}", heartbeat(f"w{n}", queue))
            pipe.hset(f"{{llmq:{queue}}}:workers", f"old{n}", heartbeat(f"old{n}", queue, at_ms=1))
        if depth or dead or live:
            expected[queue] = (depth, dead, int(live))
    # keys that are no queue's: other prefixes, bare names, patterns in names
    pipe.xadd("{other:q0001}:requests", {"m": b"x"})
    pipe.xadd("llmq:plain:requests", {"m": b"x"})
    pipe.xadd("{llmq:a*}:requests", {"m": b"x"})
    pipe.xadd("{llmq:[ab]}:dead", {"m": b"x"})
    pipe.set("{llmq:onlyresult}:result:abc", b"x")
    await pipe.execute()

    done = await llmq("--url", redis_url, "queues", "--json")
    assert done.rc == 0, done
    assert "may be incomplete" not in done.err and "there may be more" not in done.err, done
    listed = {row["queue"]: (row["depth"], row["dead"], row["live_workers"]) for row in json.loads(done.out)}
    assert listed == expected

    table = await llmq("queues", "--url", redis_url)
    assert table.rc == 0, table
    rows = table.out.splitlines()
    assert len(rows) == 1 + len(expected), rows[:3]
    assert re.match(r"^q0000\s+1\s+0\s+0\s+1\s*$", rows[1]), rows[1]


async def test_queues_stops_at_max_keys_and_warns(redis_url: str, server: aioredis.Redis) -> None:
    pipe = server.pipeline(transaction=False)
    for n in range(50):
        pipe.xadd(lane_key(f"q{n}"), {"m": b"x"})
    await pipe.execute()
    done = await llmq("--url", redis_url, "queues", "--json", "--max-keys", "5")
    assert done.rc == 0, done
    assert len(json.loads(done.out)) <= 5
    assert "warning" in done.err and "max-keys" in done.err, done
    huge = await llmq("--url", redis_url, "queues", "--json", "--max-keys", str(10**12))
    assert huge.rc == 0, huge
    assert len(json.loads(huge.out)) == 50


async def test_queues_on_an_empty_redis(redis_url: str) -> None:
    done = await llmq("--url", redis_url, "queues", "--json")
    assert done.rc == 0, done
    assert json.loads(done.out) == []


async def test_one_odd_key_does_not_hide_every_queue(redis_url: str, server: aioredis.Redis) -> None:
    await server.xadd(lane_key("good"), {"m": b"x"})
    await server.set(lane_key("odd"), b"not a stream")
    done = await llmq("--url", redis_url, "queues", "--json")
    assert done.rc != CODES["UNAVAILABLE"], done
    assert "good" in done.out


async def test_queues_on_a_redis_cluster_finds_queues_on_every_master(tmp_path: Path) -> None:
    with RedisClusterSet(tmp_path / "cluster") as cluster:
        names = [cluster.queue_on(master, prefix=f"m{i}q") for i, master in enumerate(cluster.masters())]
        assert len(set(names)) == 3
        conn = redis.RedisCluster.from_url(cluster.seed_url.replace("redis+cluster://", "redis://"))
        try:
            for depth, name in enumerate(names, start=1):
                for _ in range(depth):
                    conn.xadd(lane_key(name), {"m": b"x"})
            conn.hset(f"{{llmq:{names[0]}}}:workers", "w", heartbeat("w", names[0]))
        finally:
            conn.close()
        done = await llmq("--url", cluster.seed_url, "queues", "--json")
    assert done.rc == 0, done
    listed = {row["queue"]: (row["depth"], row["live_workers"]) for row in json.loads(done.out)}
    assert listed == {names[0]: (1, 1), names[1]: (2, 0), names[2]: (3, 0)}


# --- dead letters --------------------------------------------------------------------------------------------


async def dead_lettered_by_a_worker(redis_url: str, server: aioredis.Redis, tmp_path: Path) -> str:
    """A real dead letter, past its delivery limit (docs/protocol.md): `submit` queues it, a ghost consumer of
    the group `workers` takes it and "dies" five times (its delivery count), and a worker with
    `max_deliveries` 2 claims it once its lease lapses and moves it to the dead letters. Returns the request id."""
    queued = await llmq(
        "--url", redis_url, "submit", "poisoned", "--max-new-tokens", "5", "--temperature", "0", "--timeout", "0.3"
    )  # fmt: skip
    request_id = request_id_of(queued)
    await server.xgroup_create(lane_key(), "workers", id="0")
    ((_, ((entry_id, _),)),) = await server.xreadgroup("workers", "ghost", {lane_key(): ">"}, count=1)
    await server.execute_command("XCLAIM", lane_key(), "workers", "ghost", 0, entry_id, "RETRYCOUNT", 5)
    async with scripted_worker(
        redis_url, tmp_path / "claimer", lease_timeout_s=0.3, claim_interval_s=0.1, max_deliveries=2
    ):
        for _ in range(GUARD_S * 10):
            if await server.xlen(dead_key()):
                break
            await asyncio.sleep(0.1)
    assert await server.xlen(dead_key()) == 1
    return request_id


async def test_a_real_dead_letter_is_listed_shown_replayed_and_completes(
    redis_url: str, server: aioredis.Redis, tmp_path: Path
) -> None:
    request_id = await dead_lettered_by_a_worker(redis_url, server, tmp_path)

    listed = await llmq("--url", redis_url, "dead", "list", "--json")
    assert listed.rc == 0, listed
    (letter,) = [json.loads(line) for line in listed.out.splitlines()]
    assert letter["request_id"] == request_id and "max_deliveries" in letter["reason"], letter
    failed = await llmq("--url", redis_url, "attach", request_id, "--timeout", "60")
    assert failed.rc == CODES["FAILED"] and "delivery_limit" in failed.error_line(), failed
    table = await llmq("--url", redis_url, "dead", "list")
    assert letter["id"] in table.out and request_id in table.out, table

    for key in (letter["id"], request_id):
        shown = await llmq("--url", redis_url, "dead", "show", key, "--json")
        assert shown.rc == 0, shown
        body = json.loads(shown.out)
        assert body["id"] == letter["id"]
        assert body["request"]["id"] == request_id and body["request"]["prompt"] == "poisoned"

    replayed = await llmq("--url", redis_url, "dead", "replay", request_id)
    assert replayed.rc == 0, replayed
    assert await server.xlen(dead_key()) == 0
    async with scripted_worker(redis_url, tmp_path):
        attached = await llmq("--url", redis_url, "attach", request_id, "--no-stream", "--timeout", "60")
    assert attached.rc == 0, attached
    assert attached.out.strip() == scripted_text("poisoned", 5)
    gone = await llmq("--url", redis_url, "dead", "show", request_id)
    assert gone.rc == CODES["NOT_FOUND"], gone


async def test_a_letter_for_a_refused_result_stream_keeps_its_request(
    redis_url: str, server: aioredis.Redis, tmp_path: Path
) -> None:
    queued = await llmq("--url", redis_url, "submit", "blocked", "--max-new-tokens", "3", "--timeout", "0.3")
    request_id = request_id_of(queued)
    await server.set(f"{{llmq:default}}:result:{request_id}", b"in the way")
    async with scripted_worker(redis_url, tmp_path):
        for _ in range(GUARD_S * 10):
            if await server.xlen(dead_key()):
                break
            await asyncio.sleep(0.1)
    listed = await llmq("--url", redis_url, "dead", "list", "--json")
    (letter,) = [json.loads(line) for line in listed.out.splitlines()]
    assert "refused" in letter["reason"], letter  # the path under test
    shown = await llmq("--url", redis_url, "dead", "show", request_id, "--json")
    assert shown.rc == 0, shown
    assert json.loads(shown.out)["request"]["prompt"] == "blocked"


async def test_two_concurrent_replays_of_one_letter_run_it_once(
    redis_url: str, server: aioredis.Redis, tmp_path: Path
) -> None:
    request_id = await dead_lettered_by_a_worker(redis_url, server, tmp_path)
    first, second = await asyncio.gather(
        llmq("--url", redis_url, "dead", "replay", request_id), llmq("--url", redis_url, "dead", "replay", request_id)
    )
    assert sorted([first.rc, second.rc]) == [0, CODES["NOT_FOUND"]], (first, second)
    assert await server.xlen(lane_key()) == 1  # queued once
    async with scripted_worker(redis_url, tmp_path):
        attached = await llmq("--url", redis_url, "attach", request_id, "--json", "--timeout", "60")
    assert attached.rc == 0, attached
    assert len(json.loads(attached.out)["token_ids"]) == 5
    events = [
        msgpack.unpackb(fields[b"m"]) for _, fields in await server.xrange(f"{{llmq:default}}:result:{request_id}")
    ]
    assert [event["type"] for event in events].count("done") == 1, events
    seqs = [event["seq"] for event in events if event["type"] == "tokens"]
    assert seqs == sorted(set(seqs)), events
    assert await server.xlen(lane_key()) == 0


async def test_drop_removes_one_letter_by_either_id(redis_url: str, server: aioredis.Redis) -> None:
    for n in range(3):
        await server.xadd(dead_key(), {"m": dead_letter(request(f"req-{n}"))})
    ids = [entry.decode() for entry, _ in await server.xrange(dead_key())]
    by_entry = await llmq("--url", redis_url, "dead", "drop", ids[0])
    by_request = await llmq("--url", redis_url, "dead", "drop", "req-2")
    assert (by_entry.rc, by_request.rc) == (0, 0), (by_entry, by_request)
    listed = await llmq("--url", redis_url, "dead", "list", "--json")
    assert [json.loads(line)["request_id"] for line in listed.out.splitlines()] == ["req-1"]
    again = await llmq("--url", redis_url, "dead", "drop", ids[0])
    assert again.rc == CODES["NOT_FOUND"], again


async def test_limits_bound_list_drop_and_replay(redis_url: str, server: aioredis.Redis) -> None:
    for n in range(6):
        await server.xadd(dead_key(), {"m": dead_letter(request(f"lim-{n}"))})

    async def listed(*extra: str) -> list[str]:
        done = await llmq("--url", redis_url, "dead", "list", "--json", *extra)
        assert done.rc == 0, done
        return [json.loads(line)["request_id"] for line in done.out.splitlines()]

    assert await listed("--limit", "2") == ["lim-0", "lim-1"]  # oldest first
    assert await listed("--limit", str(10**12)) == [f"lim-{n}" for n in range(6)]
    assert await listed() == [f"lim-{n}" for n in range(6)]  # the default, 20, covers them

    dropped = await llmq("--url", redis_url, "dead", "drop", "--all", "--limit", "2")
    assert dropped.rc == 0, dropped
    assert await listed() == ["lim-2", "lim-3", "lim-4", "lim-5"]
    replayed = await llmq("--url", redis_url, "dead", "replay", "--all", "--limit", "1", "--priority", "batch")
    assert replayed.rc == 0, replayed
    assert await listed() == ["lim-3", "lim-4", "lim-5"]
    assert await server.xlen(lane_key(lane="batch")) == 1
    everything = await llmq("--url", redis_url, "dead", "replay", "--all", "--limit", str(10**12))
    assert everything.rc == 0, everything
    assert await listed() == []
    assert await server.xlen(lane_key()) == 3


async def test_a_huge_limit_is_a_usage_error_for_drop_and_replay(redis_url: str, server: aioredis.Redis) -> None:
    await server.xadd(dead_key(), {"m": dead_letter(request("keep-me"))})
    for command in ("drop", "replay"):
        done = await llmq("--url", redis_url, "dead", command, "--all", "--limit", str(10**23))
        assert done.rc == CODES["USAGE"], done
    assert await server.xlen(dead_key()) == 1


async def test_a_huge_limit_for_list_is_not_redis_unavailable(redis_url: str, server: aioredis.Redis) -> None:
    await server.xadd(dead_key(), {"m": dead_letter(request("keep-me"))})
    done = await llmq("--url", redis_url, "dead", "list", "--limit", str(10**23))
    assert done.rc in (0, CODES["USAGE"]), done


HOSTILE_LETTER_IDS = ["*", "a b", "", "1-*", "-", "+", "$", ">", "0-0", "[a]", "ü", "req-*", "req-?", "*-0"]


@pytest.mark.parametrize("letter_id", HOSTILE_LETTER_IDS, ids=lambda i: repr(i))
async def test_hostile_letter_ids_match_nothing_and_touch_nothing(
    redis_url: str, server: aioredis.Redis, letter_id: str
) -> None:
    for n in range(2):
        await server.xadd(dead_key(), {"m": dead_letter(request(f"req-{n}"))})
    for command in ("show", "replay", "drop"):
        done = await llmq("--url", redis_url, "dead", command, "--", letter_id)
        assert done.rc in (CODES["NOT_FOUND"], CODES["USAGE"]), (command, done)
        done.error_line()
        assert "Traceback" not in done.err
    assert await server.xlen(dead_key()) == 2
    for lane in ("interactive", "default", "batch"):
        assert await server.xlen(lane_key(lane=lane)) == 0


@pytest.mark.parametrize("letter_id", ["99999999999999999999-0", "1-99999999999999999999"])
async def test_an_out_of_range_letter_id_is_not_redis_unavailable(
    redis_url: str, server: aioredis.Redis, letter_id: str
) -> None:
    await server.xadd(dead_key(), {"m": dead_letter(request("req-0"))})
    done = await llmq("--url", redis_url, "dead", "show", letter_id)
    assert done.rc in (CODES["NOT_FOUND"], CODES["USAGE"]), done


async def test_replay_all_skips_unreadable_letters_with_exit_failed(redis_url: str, server: aioredis.Redis) -> None:
    await server.xadd(dead_key(), {"m": dead_letter(None, reason="unreadable", raw=b"\x01garbage")})
    await server.xadd(dead_key(), {"m": dead_letter(request("good-one"))})
    await server.xadd(dead_key(), {"m": b"not msgpack at all"})
    done = await llmq("--url", redis_url, "dead", "replay", "--all")
    assert done.rc == CODES["FAILED"], done
    assert await server.xlen(lane_key()) == 1
    left = await llmq("--url", redis_url, "dead", "list", "--json")
    assert [json.loads(line)["request_id"] for line in left.out.splitlines()] == [None, None]
    dropped = await llmq("--url", redis_url, "dead", "drop", "--all")
    assert dropped.rc == 0, dropped
    assert await server.xlen(dead_key()) == 0


async def test_dead_letters_of_a_queue_are_not_another_queues(redis_url: str, server: aioredis.Redis) -> None:
    await server.xadd(dead_key("qa"), {"m": dead_letter(request("only-in-qa"))})
    elsewhere = await llmq("--url", redis_url, "dead", "show", "only-in-qa")
    assert elsewhere.rc == CODES["NOT_FOUND"], elsewhere
    dropped = await llmq("--url", redis_url, "dead", "drop", "--all")
    assert dropped.rc == 0, dropped
    assert await server.xlen(dead_key("qa")) == 1
    here = await llmq("--url", redis_url, "--queue", "qa", "dead", "show", "only-in-qa")
    assert here.rc == 0, here


# --- chat ----------------------------------------------------------------------------------------------------


async def test_chat_keeps_the_history_across_turns(redis_url: str, tmp_path: Path) -> None:
    system, first, second, third = "Be terse.", "hi there", "and then?", "ünïcödé ✓"
    async with scripted_worker(redis_url, tmp_path):
        done = await llmq(
            "--url", redis_url, "chat", "--system", system, "--max-new-tokens", "4", "--temperature", "0",
            stdin=f"{first}\n{second}\n{third}\n",
        )  # fmt: skip
    assert done.rc == 0, done
    # the scripted engine answers the messages' contents joined: each answer depends on every earlier turn
    one = scripted_text(system + first, 4)
    two = scripted_text(system + first + one + second, 4)
    three = scripted_text(system + first + one + second + two + third, 4)
    assert [line for line in done.out.splitlines() if line.strip()] == [one, two, three], done


async def test_chat_sends_chat_messages_on_the_interactive_lane(redis_url: str, server: aioredis.Redis) -> None:
    done = await llmq("--url", redis_url, "chat", "--system", "S", "--timeout", "0.5", stdin="hello\nnever sent\n")
    assert done.rc == CODES["TIMEOUT"], done  # a timed-out answer ends the chat with its code
    assert await server.xlen(lane_key(lane="default")) == 0
    ((_, fields),) = await server.xrange(lane_key(lane="interactive"))
    sent = msgpack.unpackb(fields[b"m"])
    assert sent.get("prompt") is None
    assert sent["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"}]


async def test_chat_with_a_priority_uses_that_lane(redis_url: str, server: aioredis.Redis) -> None:
    done = await llmq("--url", redis_url, "chat", "--priority", "batch", "--timeout", "0.3", stdin="x\n")
    assert done.rc == CODES["TIMEOUT"], done
    assert await server.xlen(lane_key(lane="batch")) == 1
    assert await server.xlen(lane_key(lane="interactive")) == 0


async def test_chat_on_empty_input_ends_cleanly(redis_url: str, server: aioredis.Redis) -> None:
    done = await llmq("--url", redis_url, "chat", stdin="")
    assert done.rc == 0, done
    assert done.out.strip() == ""
    assert await server.xlen(lane_key(lane="interactive")) == 0


async def test_a_failed_answer_ends_the_chat_with_failed(redis_url: str, tmp_path: Path) -> None:
    async with scripted_worker(redis_url, tmp_path):
        done = await llmq(
            "--url", redis_url, "chat", "--max-new-tokens", "300", stdin="y" * 300 + "\nnot reached\n"
        )  # fmt: skip
    assert done.rc == CODES["FAILED"], done
    done.error_line()
