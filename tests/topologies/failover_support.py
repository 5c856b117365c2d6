"""Helpers of the failover black-box tests: Redis servers that can be killed and come back with their data, a
master with a replica, the `llmq` command as a user runs it, and the checks every test repeats.

The servers are `testing.redis_topologies.RedisNode`s (SIGKILL with `kill()`, back on the same port with
`start()`); `PERSISTENT` keeps every write in an append-only file synced on each command, so a restart, even
after SIGKILL, loses nothing and the tests can ask for every request to end exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import redis

from client import AsyncClient, AsyncJob, Client, Job, LLMQError
from client.protocol import decode_event, decode_request
from client.store import Keys
from testing.redis_topologies import HOST, RedisNode, conf_quote, node_ports, wait_until
from testing.scripted_engine import expected_tokens
from tests import polling

T = TypeVar("T")
PERSISTENT = ('save ""', "appendonly yes", "appendfsync always", "repl-diskless-sync-delay 0")
# Special characters that break a URL unless percent-encoded, and a distinctive tail to look for in messages.
PASSWORD = 'p@ss:w/o#rd?%&= "hunter2"'
SECRETS = ("hunter2", quote(PASSWORD, safe=""), quote("hunter2"), "wrong horse", quote("wrong horse"))


def ids_of(prompt: str) -> list[int]:
    """The scripted engine's prompt ids: the prompt's UTF-8 bytes."""
    return list(prompt.encode())


def scripted(prompt: str, count: int) -> list[int]:
    return expected_tokens(ids_of(prompt), count)


def scripted_text(prompt: str, count: int) -> str:
    return "".join(f"<{token}>" for token in scripted(prompt, count))


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} shown in {text[:300]!r}"


def url_of(node: RedisNode, password: str | None = None, *, user: str = "") -> str:
    """A `redis://` URL of `node`, the password percent-encoded as a careful user writes it."""
    auth = f"{quote(user, safe='')}:{quote(password, safe='')}@" if password is not None else ""
    return f"redis://{auth}{HOST}:{node.port}/0"


def server(workdir: Path, *conf: str, password: str | None = None) -> RedisNode:
    """A started, answering redis-server whose writes survive SIGKILL; stopped by the caller."""
    auth = [f"requirepass {conf_quote(password)}"] if password else []
    (port,) = node_ports(1)  # restarted on it after a SIGKILL: see node_ports
    return RedisNode(workdir, port, [*PERSISTENT, *auth, *conf], password=password).start().wait_ready()


@contextlib.contextmanager
def running(workdir: Path, *conf: str, password: str | None = None) -> Iterator[RedisNode]:
    node = server(workdir, *conf, password=password)
    try:
        yield node
    finally:
        node.stop()


def raw(node: RedisNode) -> redis.Redis:
    """A plain connection to `node` that returns bytes, as the entries are msgpack; close it (`with`)."""
    return redis.Redis(host=HOST, port=node.port, password=node.password, socket_timeout=5)


def restart(node: RedisNode) -> None:
    node.start().wait_ready()


def restart_after(node: RedisNode, down_s: float) -> None:
    time.sleep(down_s)
    restart(node)


@dataclass
class Pair:
    """A master and its replica (plain replication, no sentinel)."""

    master: RedisNode
    replica: RedisNode

    def wait_linked(self, timeout: float = 15) -> None:
        def linked() -> bool | None:
            info = self.replica.client().info("replication")
            return True if info.get("master_link_status") == "up" else None

        wait_until(linked, timeout=timeout, what="replica linked", nodes=[self.master, self.replica])


@contextlib.contextmanager
def master_and_replica(workdir: Path) -> Iterator[Pair]:
    master = server(workdir / "master")
    replica = None
    try:
        replica = server(workdir / "replica", f"replicaof {HOST} {master.port}")
        pair = Pair(master, replica)
        pair.wait_linked()
        yield pair
    finally:
        for node in (replica, master):
            if node is not None:
                node.stop()


def request_ids_in(conn: redis.Redis, keys: Keys) -> Counter[str]:
    """How many entries of each request id the queue's lanes hold."""
    counts: Counter[str] = Counter()
    for stream in keys.lanes.values():
        entries: list[Any] = conn.xrange(stream) or []
        for _, fields in entries:
            counts[decode_request(fields[b"m"]).id] += 1
    return counts


def terminal_events(conn: redis.Redis, keys: Keys, request_ids: Iterable[str]) -> Counter[str]:
    """How many terminal events (`done`, `error`) each request's result stream holds."""
    counts: Counter[str] = Counter()
    for request_id in request_ids:
        counts[request_id] += 0
        entries: list[Any] = conn.xrange(keys.result(request_id)) or []
        for _, fields in entries:
            if decode_event(fields[b"m"]).type != "tokens":
                counts[request_id] += 1
    return counts


async def follow(job: AsyncJob, wait_s: float = 90) -> list[int]:
    """The whole output of `job`, asserting every delta starts where the previous one ended."""
    tokens: list[int] = []
    async for delta in job.stream(timeout=wait_s):
        assert delta.seq == len(tokens), f"{job.id}: a gap or a duplicate at {delta.seq} after {len(tokens)}"
        tokens += delta.token_ids
    return tokens


def follow_sync(job: Job, wait_s: float = 90) -> list[int]:
    tokens: list[int] = []
    for delta in job.stream(timeout=wait_s):
        assert delta.seq == len(tokens), f"{job.id}: a gap or a duplicate at {delta.seq} after {len(tokens)}"
        tokens += delta.token_ids
    return tokens


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def llmq(*argv: str, limit_s: float = 60) -> Run:
    """`llmq ARGV...` in its own process, as a user runs it (no logging configured, real stderr)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", *argv], capture_output=True, text=True, timeout=limit_s, check=False
    )
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


async def llmq_async(*argv: str, limit_s: float = 60) -> Run:
    return await asyncio.to_thread(llmq, *argv, limit_s=limit_s)


@dataclass
class Submitters:
    """Submitters of both clients that submit without pause, each under ids of its own, until `stop` is set:
    what returned is in `accepted`, what raised in `refused`."""

    aclient: AsyncClient
    client: Client
    accepted: list[str] = field(default_factory=list)
    refused: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def _ids(self, name: str) -> Iterator[str]:
        for i in itertools.count():
            if self.stop.is_set():
                return
            yield f"{name}-{i}"

    async def _submit_async(self, name: str) -> None:
        for request_id in self._ids(name):
            try:
                self.accepted.append((await self.aclient.submit("x", max_new_tokens=1, request_id=request_id)).id)
            except LLMQError as error:
                self.refused.append(error)

    def _submit_sync(self, name: str) -> None:
        for request_id in self._ids(name):
            try:
                self.accepted.append(self.client.submit("x", max_new_tokens=1, request_id=request_id).id)
            except LLMQError as error:
                self.refused.append(error)

    async def during(self, chaos: Awaitable[T], *, asyncs: int, syncs: int) -> T:
        """Runs `asyncs` async and `syncs` sync submitters until `chaos`, which sets `stop`, returns; its answer."""
        *_, answer = await asyncio.gather(
            *(self._submit_async(f"async{n}") for n in range(asyncs)),
            *(asyncio.to_thread(self._submit_sync, f"sync{n}") for n in range(syncs)),
            chaos,
        )
        return answer  # type: ignore[return-value]

    async def until_accepted(self, more: int) -> None:
        before = len(self.accepted)
        await polling.wait_until(lambda: len(self.accepted) >= before + more, within_s=30)

    def lost_on(self, node: RedisNode, keys: Keys) -> list[str]:
        """The accepted ids that `node` does not hold exactly once."""
        with raw(node) as conn:
            held = request_ids_in(conn, keys)
        return [request_id for request_id in self.accepted if held[request_id] != 1]
