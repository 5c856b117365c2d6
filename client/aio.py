"""`AsyncClient` and `AsyncJob`, the asyncio twin: Redis calls only, the logic lives in `client._core`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry

from client._core import (
    DEFAULT_URL,
    BaseChoices,
    BaseClient,
    BaseJob,
    Delta,
    Outcome,
    Result,
    choices_result,
    pool_kwargs,
    queue_full_delays,
    submit_arguments_error,
)
from client._mux import BLOCK_S, ENTRIES_PER_STREAM, WAKE_DELAY_S, Follower, MuxCore, is_wrong_type, max_block_ms
from client.connection import check_async, is_cluster, open_async
from client.errors import ClientClosed, LLMQError, QueueFull, ResultTimeout
from client.failover import (
    FAILOVER_TIMEOUT_S,
    REDIS_FAILURES,
    refused,
    reraise_lost_cancellation,
    retry_async,
    unavailable,
)
from client.protocol import (
    DEFAULT_PREFIX,
    DEFAULT_TENANT,
    ChatMessage,
    GenerateRequest,
    Lane,
    RequestLimits,
    Tool,
    ToolChoice,
)
from client.store import Keys, QueueStatus, Scripts, queue_cancel_commands, queue_status_commands, status_from_replies


class AsyncClient(BaseClient):
    """Submits requests to one queue (default) and follows their results, over redis-py's asyncio client.

    :param url: `redis://` or `rediss://` URL, credentials included (they never appear in messages).
    :param queue: default queue for `submit`; each call may name another.
    :param max_queue_len: a lane's backlog at which `submit` raises `QueueFull` (0 = no limit).
    :param result_ttl: seconds a result (and the idempotency marker) outlives the last write.
    :param limits: checked before submitting (default `RequestLimits()`); workers enforce their own too.
    :param redis: an existing `redis.asyncio.Redis` (decode_responses=False) to use instead of `url`;
        it is not closed by `aclose`.
    :param failover_timeout: seconds a call (submit, cancel, status) keeps retrying while Redis is away (a primary
        being replaced, a dropped connection) before it raises `RedisUnavailable`; 0 fails at once.
    :param wait_replicas: replicas that must acknowledge each submission (`WAIT`) before `submit` returns, so a
        failover cannot lose it; 0 (default) returns once the primary has it.
    :param partitions: the queues' `LLMQ_QUEUE_PARTITIONS`: each request goes to the partition of its id, and
        `max_queue_len` is shared out over them (every process of a deployment must use the same count).
    :param redis_kwargs: passed to `redis.asyncio.BlockingConnectionPool.from_url`; by default the client
        holds at most 4 connections (`max_connections`) for all its work: one reader follows every awaited
        job's result stream, and calls wait for a free connection rather than fail. On a Cluster or Sentinel URL
        (redis-py's pools there cannot wait) the pools open what the calls need.
    """

    _redis: aioredis.Redis

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        queue: str = "default",
        prefix: str = DEFAULT_PREFIX,
        max_queue_len: int = 10000,
        result_ttl: int = 3600,
        limits: RequestLimits | None = None,
        redis: aioredis.Redis | None = None,
        ssl_ca_certs: str | None = None,
        failover_timeout: float = FAILOVER_TIMEOUT_S,
        wait_replicas: int = 0,
        partitions: int = 1,
        tenant: str = DEFAULT_TENANT,
        **redis_kwargs: Any,
    ) -> None:
        own = redis is None
        # where the client owns its pool: how to open another, for a client moved to another event loop
        self._pool_args = (url, ssl_ca_certs, pool_kwargs(redis_kwargs, AsyncRetry)) if own else None
        self._loop: asyncio.AbstractEventLoop | None = None
        conn = redis if self._pool_args is None else _open(*self._pool_args)
        super().__init__(
            conn,
            url=url if own else None,
            owns_conn=own,
            queue=queue,
            prefix=prefix,
            max_queue_len=max_queue_len,
            result_ttl=result_ttl,
            limits=limits,
            failover_timeout=failover_timeout,
            wait_replicas=wait_replicas,
            partitions=partitions,
            tenant=tenant,
        )
        self._muxes: dict[str, AsyncResultMux] = {}

    async def aclose(self) -> None:
        """Closes the connections; jobs still awaiting their results here raise `ClientClosed`."""
        self._follow_loop()  # a loop that has stopped cannot close its connections any more
        self._closed = True
        for mux in self._muxes.values():
            await mux.aclose()
        if self._owns_conn:
            await self._redis.aclose()

    def ensure_open(self) -> None:
        super().ensure_open()
        self._follow_loop()

    def _follow_loop(self) -> None:
        """redis-py's asyncio connections belong to the event loop that opened them. A client used on a new loop
        after its last one stopped (one `asyncio.run` after another) opens a new pool and result readers there;
        the old loop's idle sockets are left to the garbage collector, as that loop can no longer close them. A
        client in use on two running loops at once is refused: each loop needs its own client."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        previous = self._loop
        if loop is previous:
            return
        if previous is not None and previous.is_running():
            raise RuntimeError("this AsyncClient is in use on another running event loop: make one client per loop")
        self._loop = loop
        if previous is not None and self._pool_args is not None:
            self._redis = _open(*self._pool_args)
            self._scripts = Scripts.register(self._redis)
            self._muxes = {}

    def _mux(self, keys: Keys) -> AsyncResultMux:
        """The result reader of a queue (its keys share one hash slot, so one XREAD reads them all)."""
        self.ensure_open()
        mux = self._muxes.get(keys.tag)
        if mux is None:
            mux = self._muxes[keys.tag] = AsyncResultMux(
                self._redis, keys, self.client_id, self.socket_timeout, self._url
            )
        return mux

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[ChatMessage | dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        response_format: Mapping[str, Any] | None = None,
        tools: list[Tool | dict[str, Any]] | None = None,
        tool_choice: ToolChoice | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        n: int = 1,
        queue: str | None = None,
        deadline: float | timedelta | datetime | None = None,
        request_id: str | None = None,
        reply_to: str | None = None,
        priority: Lane = "default",
        tenant: str | None = None,
    ) -> AsyncJob:
        """Queue one request (exactly one of `prompt`, `messages`, `input_ids`) and return its job.

        Sampling parameters left at None take the wire defaults and ranges (`client.protocol.SamplingParams`,
        `BOUNDS`). Validation happens here, before Redis is touched (`InvalidRequest`, a ValueError). Submitting
        an id again is a no-op that returns a job following the first submission. `deadline` is seconds
        from now, a timedelta or a datetime; past it, workers answer `expired` instead of generating.
        `reply_to` names a shared stream (`Keys.reply(name)`) that also receives the final result, for a
        pipeline stage that reads completions with its own consumer group. `response_format` constrains the
        output: `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`, `{"type":
        "json_object"}` or `{"type": "regex", "regex": ...}`; `logprobs` adds each token's log-probability (and
        `top_logprobs` alternatives) to the deltas and the result; `tools` (OpenAI's function shape) are offered to
        a chat request through the model's chat template, and `tool_choice` (`auto` by default with tools,
        `none`, `required` or `{"type": "function", "function": {"name": ...}}`) says whether the answer may or
        must call them: calls come back as `Result.tool_calls` (their arguments generated under each function's
        schema) and streamed as `Delta.tool_calls`, `parallel_tool_calls=False` allows at most one;
        `prompt_logprobs=k` scores the prompt (each token's log-probability given those before it, and `k`
        alternatives: `Result.prompt_logprobs`, and a first delta without tokens), and allows `max_new_tokens=0`,
        to score only. `n` (1 to 16) asks for that many sampled answers: they are `n` requests, `<id>-0` to
        `<id>-<n-1>`, choice `i` seeded `seed + i`, submitted together (one script call, all or none, per
        partition), and the job returned is an `AsyncChoices` (`Result.choices`, deltas with their `index`); a failure
        part way (a partitioned queue's later partition) cancels the choices submitted, unless `request_id` was
        given (then submitting again attaches to them and submits the rest). `priority` is the lane:
        `interactive` (served first, and may preempt lower lanes), `default` or `batch`; `tenant` (the client's
        `tenant` when None) owns it: workers share the fleet between tenants by their weights (`docs/tenants.md`).
        Raises `QueueFull` when the lane has no room for the request (or for all `n`) within `max_queue_len`.
        """
        self.ensure_open()
        self.keys_for(queue)  # a bad queue name is refused first
        base, requests = self.build_choices(
            n,
            prompt,
            messages=messages,
            input_ids=input_ids,
            deadline=deadline,
            request_id=request_id,
            reply_to=reply_to,
            tools=tools,
            params={
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "stop": stop,
                "seed": seed,
                "ignore_eos": ignore_eos,
                "logprobs": logprobs,
                "top_logprobs": top_logprobs,
                "prompt_logprobs": prompt_logprobs,
                "repetition_penalty": repetition_penalty,
                "presence_penalty": presence_penalty,
                "frequency_penalty": frequency_penalty,
                "response_format": response_format,
                "tool_choice": tool_choice,
                "parallel_tool_calls": parallel_tool_calls,
            },
        )
        jobs: list[AsyncJob] = []
        try:
            for keys, group in self.partition_groups(requests, queue):
                jobs += await self._submit_group(group, keys, priority, tenant)
        except BaseException:
            if request_id is None:  # nobody can submit again into the choices submitted: stop them
                for submitted in jobs:
                    with contextlib.suppress(LLMQError):
                        await submitted.cancel()
            raise
        if n == 1:
            return jobs[0]
        return AsyncChoices(self, base, self.keys_for(queue, base), jobs)

    async def _submit_group(
        self, requests: list[GenerateRequest], keys: Keys, priority: Lane, tenant: str | None
    ) -> list[AsyncJob]:
        """One script call for a call's requests of one partition (`Submit`: all or nothing)."""
        with self.submitting(requests, keys, priority, tenant) as call:
            outcomes = await self._retry(
                "a submit", lambda: self._scripts.submit.run_async(self._redis, call, self.wait_replicas)
            )
            self.check_submitted(outcomes, keys, priority, tenant)
        return [AsyncJob(self, request.id, keys) for request in requests]

    async def submit_many(
        self,
        requests: Iterable[Mapping[str, Any]],
        *,
        window: int = 64,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> AsyncIterator[Outcome]:
        """Submits `requests` (each the keyword arguments of `submit`) with at most `window` in flight, and
        yields each one's `Outcome` as it completes, in completion order, in memory bounded by `window` for
        any input size (the iterable is read lazily). While the queue is full it waits, never fails; a request
        refused before submitting, or failing, is an outcome with its typed error, and the rest go on."""
        if window < 1:
            raise ValueError("window must be >= 1")
        pending: set[asyncio.Task[Outcome]] = set()
        try:
            for index, options in enumerate(requests):
                while len(pending) >= window:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        yield task.result()
                pending.add(asyncio.create_task(self._one(index, options, timeout)))
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield task.result()
        finally:
            for task in pending:  # the caller stopped early: stop following (the requests themselves go on)
                task.cancel()

    async def _one(self, index: int, options: Mapping[str, Any], timeout: float | None) -> Outcome:  # noqa: ASYNC109
        refused = submit_arguments_error(options, type(self).submit)
        if refused is not None:
            return Outcome(index, None, error=refused)
        for delay in queue_full_delays():
            try:
                job = await self.submit(**options)
                break
            except QueueFull:
                await asyncio.sleep(delay)
            except LLMQError as error:
                return Outcome(index, options.get("request_id"), error=error)
        try:
            return Outcome(index, job.id, result=await job.result(timeout))
        except LLMQError as error:
            return Outcome(index, job.id, error=error)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **options: Any) -> Result:  # noqa: ASYNC109
        """`submit(prompt, **options)`, then `result(timeout)`."""
        job = await self.submit(prompt, **options)
        return await job.result(timeout)

    async def check(self) -> None:
        """Fails fast where this client cannot work: Redis unreachable or credentials refused (`RedisUnavailable`), or
        a URL of the wrong kind for what answered (`WrongDeployment`: a Cluster node or a Sentinel behind `redis://`).
        A client handed `redis=` has no URL to compare: it is only pinged."""
        self.ensure_open()
        url = self._url
        await retry_async("a check", url, 0, lambda: check_async(self._redis, url) if url else self._redis.ping())

    async def status(self, *, queue: str | None = None, stale_after_s: float = 15.0) -> QueueStatus:
        """Backlog, pending and lag of the consumer group, dead letters, and workers seen in `stale_after_s`."""
        self.ensure_open()
        keys = self.keys_for(queue)
        status: QueueStatus = await self._retry("a status query", lambda: self._status(keys, stale_after_s))
        return status

    async def _status(self, keys: Keys, stale_after_s: float) -> QueueStatus:
        """The replies are read here, in the retried call: a reply that is an error (an ACL refusal, a key of the
        wrong type) becomes `RedisUnavailable` as any other failure does."""
        pipe = self._redis.pipeline(transaction=False)
        queue_status_commands(pipe, keys, self.partitions)
        return status_from_replies(keys.queue, await pipe.execute(raise_on_error=False), stale_after_s)

    async def _retry(self, what: str, call: Any) -> Any:
        """`call()`, repeated while Redis is away for less than `failover_timeout`; then `RedisUnavailable`."""
        return await retry_async(what, self._url, self.failover_timeout, call)


class AsyncJob(BaseJob):
    """One submitted request. Timeouts are loop bounds, never task cancellation: cancelling a redis-py
    asyncio call mid-reply can leave its connection out of step (redis/redis-py#2624)."""

    _client: AsyncClient

    @classmethod
    def attach(cls, client: AsyncClient, request_id: str, *, queue: str | None = None) -> AsyncJob:
        """Follow a request submitted elsewhere, reading its result stream from the start."""
        return cls(client, request_id, client.keys_for(queue, request_id))

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Delta]:  # noqa: ASYNC109
        """New output as it arrives. Ends after `done` (see `finish_reason`; a cancel just ends it),
        raises `RequestFailed` and subclasses on `error`, `ResultTimeout` after `timeout` seconds.
        The client's reader follows the stream (with every other awaited job's, over one connection); a lost
        connection is retried with backoff for about 30 s, resuming after the last entry read."""
        reader = self._reader
        if reader.builder.finished:  # read to its end already (`result()` after `stream()`): nothing to follow
            reader.builder.raise_for_error()
            return
        mux = self._client._mux(self.keys)
        follower = mux.follow(reader.key, reader.last_id)
        # One timer for the whole stream, not one per read: 10,000 streams' per-read timers were most of what
        # the garbage collector walked in a busy client.
        alarm = None if timeout is None else asyncio.get_running_loop().call_later(timeout, follower.inbox.expire)
        try:
            while not reader.builder.finished:
                item = await follower.inbox.get()
                if item is None:  # the alarm
                    raise ResultTimeout(reader.request_id, timeout or 0.0, len(reader.builder.token_ids))
                if isinstance(item, BaseException):
                    raise item
                delta = reader.consume(*item)
                if delta is not None:
                    yield delta
        finally:
            if alarm is not None:
                alarm.cancel()
            mux.unfollow(follower)
        reader.builder.raise_for_error()

    async def result(self, timeout: float | None = None) -> Result:  # noqa: ASYNC109
        """The whole output; raises `Cancelled` (with the partial result) if the request was cancelled."""
        async for _ in self.stream(timeout):
            pass
        return self._reader.builder.outcome(raise_cancelled=True)

    async def cancel(self) -> None:
        """Ask the workers to stop this request; the stream then ends with `finish_reason == "cancelled"`."""
        self._client.ensure_open()
        await self._client._retry("a cancel", self._send_cancel)

    async def _send_cancel(self) -> None:
        # The mark, then the message: an order, not an atomicity. (A transaction on a Cluster URL as a client's first
        # call makes redis-py 8.1's asyncio ClusterPipeline set up its connections on a throwaway loop.)
        pipe = self._client._redis.pipeline(transaction=False)
        queue_cancel_commands(
            pipe, self.keys, self.id, self._client.result_ttl, sharded=is_cluster(self._client._redis)
        )
        await pipe.execute()


class AsyncChoices(BaseChoices, AsyncJob):
    """`submit(n=...)`'s job: `n` sampled answers to one prompt, each a request of its own (`jobs`, ids `<id>-<i>`).
    Its stream interleaves theirs, each delta with its choice's `index`; its result holds them all
    (`Result.choices`). One choice failing stops the others."""

    jobs: list[AsyncJob]

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Delta]:  # noqa: ASYNC109
        """Every choice's new output as it arrives (`Delta.index`), until all have ended; a choice's error stops
        the others and is raised."""
        arrivals: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def follow(index: int, job: AsyncJob) -> None:
            try:
                async for delta in job.stream(timeout):
                    arrivals.put_nowait((index, delta))
                arrivals.put_nowait((index, None))
            except Exception as error:  # handed to the stream's reader, which raises it
                arrivals.put_nowait((index, error))

        tasks = [asyncio.create_task(follow(index, job)) for index, job in enumerate(self.jobs)]
        try:
            following = len(tasks)
            while following:
                index, item = await arrivals.get()
                if item is None:
                    following -= 1
                elif isinstance(item, BaseException):
                    await self._stop_others(index)
                    raise item
                else:
                    yield replace(item, index=index)
        finally:
            for task in tasks:
                task.cancel()

    async def result(self, timeout: float | None = None) -> Result:  # noqa: ASYNC109
        """Every choice's output (`Result.choices`); raises `Cancelled` if one was cancelled."""
        async for _ in self.stream(timeout):
            pass
        return choices_result(self.id, [await job.result() for job in self.jobs])

    async def cancel(self) -> None:
        for job in self.jobs:
            await job.cancel()

    async def _stop_others(self, failed: int) -> None:
        for index, job in enumerate(self.jobs):
            if index != failed and job.finish_reason is None:
                with contextlib.suppress(LLMQError):
                    await job.cancel()


class Inbox:
    """A follower's entries, awaited by its job: a list and, while the job waits, one future. 10,000 of these
    live at once in a busy client, and asyncio.Queue's three deques and bookkeeping made its garbage
    collections long enough to show in the delivery lag."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def expire(self) -> None:
        """Wakes the waiting job with None: its time is up."""
        self.put_nowait(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.pop(0)


def _open(url: str, ssl_ca_certs: str | None, kwargs: dict[str, Any]) -> aioredis.Redis:
    client: aioredis.Redis = open_async(url, ssl_ca_certs=ssl_ca_certs, **kwargs)
    return client


class AsyncResultMux:
    """One task reads the result streams of every job this client awaits on one queue, over one connection at
    a time (`client._mux.MuxCore` decides what to read and routes it). Started by the first follower."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, client_id: str, socket_timeout: float | None, url: str | None = None
    ) -> None:
        self._redis = redis
        self._url = url
        self._core = MuxCore(keys, client_id, max_block_ms(socket_timeout))
        self._followed = asyncio.Event()
        self._blocked = False  # in a blocking read: a new follower must wake it
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    def follow(self, key: str, last_id: bytes | str) -> Follower:
        follower = self._core.follow(key, last_id, Inbox())
        self._followed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._read_forever(), name=f"llmq-results-{self._core.wake_key}")
        elif self._blocked:  # one wake for every job followed within WAKE_DELAY_S
            self._blocked = False
            wake = asyncio.create_task(self._wake())
            wake.add_done_callback(lambda task: task.cancelled() or task.exception())
        return follower

    def unfollow(self, follower: Follower) -> None:
        self._core.unfollow(follower)

    async def aclose(self) -> None:
        """Stops the reader and tells the jobs still waiting. Bounded: redis-py may turn a cancelled blocking
        read into another error."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=BLOCK_S + 1)
        for follower in self._core.followers():
            follower.inbox.put_nowait(ClientClosed("the client was closed while this job awaited its result"))

    async def _wake(self) -> None:
        await asyncio.sleep(WAKE_DELAY_S)
        async with self._redis.pipeline(transaction=False) as pipe:
            self._core.wake_commands(pipe)
            await pipe.execute()

    async def _read_forever(self) -> None:
        core = self._core
        while not self._closing:
            reraise_lost_cancellation()  # else asyncio.run() hangs at exit for a client never closed
            if core.idle:
                self._followed.clear()
                await self._followed.wait()
                continue
            try:
                await self._read_round()
            except REDIS_FAILURES as exc:
                if self._closing:
                    return
                if await self._drop_wrong_types(exc):
                    continue
                delay = None if refused(exc) else core.retry_delay(exc)
                if delay is None:
                    failure = unavailable("reading results", self._url, exc)
                    failure.__cause__ = exc
                    self._fail_all(failure)
                    return
                await asyncio.sleep(delay)
            except Exception as exc:  # a bug: the jobs must hear it, not hang until their timeouts
                self._fail_all(exc)
                raise

    def _fail_all(self, error: Exception) -> None:
        for follower in self._core.followers():
            follower.inbox.put_nowait(error)

    async def _drop_wrong_types(self, exc: Exception) -> bool:
        """After a `WRONGTYPE` reply, fails the jobs whose result key holds another type than a stream; True when
        there were any (the others read on at once)."""
        if not is_wrong_type(exc):
            return False
        keys = self._core.followed_keys()
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.type(key)
                kinds = await pipe.execute()
        except REDIS_FAILURES:
            return False  # retried as any failure is
        failed = self._core.drop_wrong_types(dict(zip(keys, kinds, strict=True)))
        for follower, error in failed:
            follower.inbox.put_nowait(error)
        return bool(failed)

    async def _read_round(self) -> None:
        core = self._core
        plan = core.plan(time.monotonic())
        if plan.block_ms is not None:
            self._blocked = True
            try:
                replies = [await self._redis.xread(plan.chunks[0], count=ENTRIES_PER_STREAM, block=plan.block_ms)]
            finally:
                self._blocked = False
        else:
            async with self._redis.pipeline(transaction=False) as pipe:
                for chunk in plan.chunks:
                    pipe.xread(chunk, count=ENTRIES_PER_STREAM)
                replies = await pipe.execute()
        self._deliver([item for reply in replies for item in core.route(reply)])

    @staticmethod
    def _deliver(routed: list[tuple[Follower, bytes, dict[bytes, bytes]]]) -> None:
        for follower, entry_id, fields in routed:
            follower.inbox.put_nowait((entry_id, fields))
