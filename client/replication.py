"""Writes that wait for replicas: `WAIT n` sent right after a write, on the connection that made it.

Redis replicates asynchronously, so a write the primary acknowledged can vanish with it in a failover. With
`replicas` > 0 the writes that matter (a submission, a request's terminal event, a claim's fence) are followed by
`WAIT replicas WAIT_TIMEOUT_MS` in the same pipeline: one connection, so WAIT covers exactly those writes (it
counts the replicas that acknowledged this connection's writes so far). Fewer acknowledgements than asked raise
`NotReplicated`, a failure to retry like a dropped connection: every such write here is idempotent.

On a Cluster such a pipeline is pinned to the node of the written key (`pinned_pipeline`) rather than sent by
redis-py's cluster pipeline: when a connection drops mid-pipeline that one resends only the commands without an
answer, and (8.1) without the node they were meant for, so a WAIT could run alone on another master, where it
answers for no write of ours and a submit would return that nothing acknowledged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import PipelineCommand
from redis.commands.core import AsyncCoreCommands
from redis.event import EventDispatcher
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    NoScriptError,
    RedisError,
    TimeoutError,
    TryAgainError,
)

from client.connection import is_cluster

WAIT_TIMEOUT_MS = 1000  # how long one WAIT blocks for the replicas' acknowledgements


class RegisteredScript(Protocol):
    """A script registered on a connection: redis-py's `Script`/`AsyncScript`, or a `client.scripts` wrapper."""

    @property
    def sha(self) -> str: ...

    @property
    def script(self) -> str | bytes: ...

    def __call__(self, keys: Sequence[Any] = ..., args: Sequence[Any] = ...) -> Any: ...


class NotReplicated(RedisError):
    """Fewer replicas acknowledged a write than asked for (in `WAIT_TIMEOUT_MS`); the write itself is on the
    primary. A `RedisError`, so every caller's Redis failure handling retries it."""

    def __init__(self, acknowledged: int, wanted: int) -> None:
        super().__init__(f"{acknowledged} of {wanted} replicas acknowledged the write within {WAIT_TIMEOUT_MS} ms")
        self.acknowledged = acknowledged
        self.wanted = wanted


class Rerouted(RedisError):
    """A pinned pipeline's node no longer serves its key's slot (MOVED, ASK, TRYAGAIN, CLUSTERDOWN): the Cluster's
    map is read again, and the call, retried, goes to the new owner."""


# What says the pinned node is gone or no longer the key's: the Cluster's slot map is read again after it.
_NODE_LOST = (ConnectionError, TimeoutError, OSError)
_REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)


def pinned_pipeline(client: Any, key: str) -> Any:
    """A non-transactional pipeline whose commands all go to `key`'s node on one connection (see the module's
    docstring); on a plain or Sentinel client, its own pipeline. All the commands must be of `key`'s slot."""
    if not is_cluster(client):
        return client.pipeline(transaction=False)
    node = client.get_node_from_key(key)
    if isinstance(client, aioredis.RedisCluster):
        return _AsyncNodePipeline(client, node)
    return _SyncNodePipeline(client, client.get_redis_connection(node).pipeline(transaction=False))


class _AsyncNodePipeline(AsyncCoreCommands):
    """Commands queued for one node of an asyncio Cluster client, sent together on one of its connections."""

    def __init__(self, cluster: aioredis.RedisCluster, node: Any) -> None:
        self._cluster = cluster
        self._node = node
        self._queue: list[PipelineCommand] = []
        self._event_dispatcher = EventDispatcher()  # redis-py's commands protocol asks for one

    def execute_command(self, *args: Any, **options: Any) -> _AsyncNodePipeline:
        self._queue.append(PipelineCommand(len(self._queue), *args, **options))
        return self

    async def __aenter__(self) -> _AsyncNodePipeline:
        return self

    async def __aexit__(self, *_: object) -> None:
        self._queue.clear()

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        queue, self._queue = self._queue, []
        try:
            await self._node.execute_pipeline(queue)
        except _NODE_LOST:
            await self._relearn()
            raise
        results = [command.result for command in queue]
        redirect = next((result for result in results if isinstance(result, _REDIRECTS)), None)
        if redirect is not None:
            await self._relearn()
            raise Rerouted(f"{self._node.name} no longer serves this slot: {redirect}") from redirect
        return _raised_first(results) if raise_on_error else results

    async def _relearn(self) -> None:
        with contextlib.suppress(Exception):  # mid-failover the map may be unreadable: the retry reads it again
            await self._cluster.nodes_manager.initialize()


class _SyncNodePipeline:
    """The blocking twin of `_AsyncNodePipeline`: a node's own pipeline, and the Cluster's map read again after
    it fails the same ways."""

    def __init__(self, cluster: Any, pipe: Any) -> None:
        self._cluster = cluster
        self._pipe = pipe

    def execute_command(self, *args: Any, **options: Any) -> _SyncNodePipeline:
        self._pipe.execute_command(*args, **options)
        return self

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            results = self._pipe.execute(raise_on_error=False)
        except _NODE_LOST:
            self._relearn()
            raise
        redirect = next((result for result in results if isinstance(result, _REDIRECTS)), None)
        if redirect is not None:
            self._relearn()
            raise Rerouted(f"this node no longer serves the slot: {redirect}") from redirect
        return _raised_first(results) if raise_on_error else results

    def _relearn(self) -> None:
        with contextlib.suppress(Exception):
            self._cluster.nodes_manager.initialize()


def _raised_first(results: list[Any]) -> list[Any]:
    error = next((result for result in results if isinstance(result, Exception)), None)
    if error is not None:
        raise error
    return results


def add_wait(pipe: Any, replicas: int) -> None:
    """Appends `WAIT` to `pipe` (a `pinned_pipeline`), after the writes it is to cover."""
    pipe.execute_command("WAIT", replicas, WAIT_TIMEOUT_MS)


def check_acknowledged(reply: Any, replicas: int) -> None:
    """Raises the WAIT's own error, or `NotReplicated` for too few replicas."""
    if isinstance(reply, Exception):
        raise reply
    if int(reply) < replicas:
        raise NotReplicated(int(reply), replicas)


async def run_script_async(
    client: Any, script: RegisteredScript, keys: Sequence[Any], args: Sequence[Any], replicas: int
) -> Any:
    """`script(keys, args)` (a redis-py `AsyncScript`), then WAIT for `replicas` when there are any."""
    if replicas == 0:
        return await script(keys=keys, args=args)
    if is_cluster(client):
        await client.initialize()  # a new client knows no slot's node yet; once done, this returns at once
    for _ in range(2):  # a primary promoted since the script was loaded does not know it yet
        pipe = pinned_pipeline(client, keys[0])
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # evalsha(): refused by cluster pipelines
        add_wait(pipe, replicas)
        result, acknowledged = await pipe.execute(raise_on_error=False)
        if not isinstance(result, NoScriptError):
            break
        await client.script_load(script.script)
    return _checked(result, acknowledged, replicas)


def run_script_sync(
    client: Any, script: RegisteredScript, keys: Sequence[Any], args: Sequence[Any], replicas: int
) -> Any:
    """The blocking twin of `run_script_async`."""
    if replicas == 0:
        return script(keys=keys, args=args)
    for _ in range(2):
        pipe = pinned_pipeline(client, keys[0])
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)  # evalsha(): refused by cluster pipelines
        add_wait(pipe, replicas)
        result, acknowledged = pipe.execute(raise_on_error=False)
        if not isinstance(result, NoScriptError):
            break
        client.script_load(script.script)
    return _checked(result, acknowledged, replicas)


def _checked(result: Any, acknowledged: Any, replicas: int) -> Any:
    if isinstance(result, Exception):
        raise result
    check_acknowledged(acknowledged, replicas)
    return result
