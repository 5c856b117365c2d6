"""`Client` and `Job`, the blocking twin of `client.aio`: Redis calls only, the logic lives in `client._core`.

Thread-safe as redis-py's client is: one `Client` may serve many threads.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self

from redis import Redis, RedisCluster
from redis.exceptions import RedisError
from redis.retry import Retry
from redis.typing import KeyT, StreamIdT

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
from client._mux import ENTRIES_PER_STREAM, WAKE_DELAY_S, Follower, MuxCore, is_wrong_type, max_block_ms
from client.connection import check_sync, is_cluster, open_sync
from client.errors import ClientClosed, LLMQError, QueueFull
from client.failover import FAILOVER_TIMEOUT_S, REDIS_FAILURES, refused, retry_sync, unavailable
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
from client.store import Keys, QueueStatus, queue_cancel_commands, queue_status_commands, status_from_replies


class Client(BaseClient):
    """Submits requests to one queue (default) and follows their results, over redis-py's blocking client.

    :param url: `redis://` or `rediss://` URL, credentials included (they never appear in messages).
    :param queue: default queue for `submit`; each call may name another.
    :param max_queue_len: a lane's backlog at which `submit` raises `QueueFull` (0 = no limit).
    :param result_ttl: seconds a result (and the idempotency marker) outlives the last write.
    :param limits: checked before submitting (default `RequestLimits()`); workers enforce their own too.
    :param redis: an existing `redis.Redis` (decode_responses=False) to use instead of `url`;
        it is not closed by `close`.
    :param failover_timeout: seconds a call (submit, cancel, status) keeps retrying while Redis is away (a primary
        being replaced, a dropped connection) before it raises `RedisUnavailable`; 0 fails at once.
    :param wait_replicas: replicas that must acknowledge each submission (`WAIT`) before `submit` returns, so a
        failover cannot lose it; 0 (default) returns once the primary has it.
    :param partitions: the queues' `LLMQ_QUEUE_PARTITIONS`: each request goes to the partition of its id, and
        `max_queue_len` is shared out over them (every process of a deployment must use the same count).
    :param redis_kwargs: passed to `redis.BlockingConnectionPool.from_url`; by default the client holds at
        most 4 connections (`max_connections`) for all its work, whatever the number of threads: one reader
        thread follows every awaited job's result stream, and calls wait for a free connection. On a Cluster or
        Sentinel URL (redis-py's pools there cannot wait) the pools open what the calls need.
    """

    _redis: Redis

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        queue: str = "default",
        prefix: str = DEFAULT_PREFIX,
        max_queue_len: int = 10000,
        result_ttl: int = 3600,
        limits: RequestLimits | None = None,
        redis: Redis | None = None,
        ssl_ca_certs: str | None = None,
        failover_timeout: float = FAILOVER_TIMEOUT_S,
        wait_replicas: int = 0,
        partitions: int = 1,
        tenant: str = DEFAULT_TENANT,
        **redis_kwargs: Any,
    ) -> None:
        own = redis is None
        if redis is None:
            redis = open_sync(url, ssl_ca_certs=ssl_ca_certs, **pool_kwargs(redis_kwargs, Retry))
        conn = redis
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
        self._muxes: dict[str, ResultMux] = {}
        self._muxes_lock = threading.Lock()

    def close(self) -> None:
        """Closes the connections; jobs still awaiting their results here (in any thread) raise `ClientClosed`."""
        self._closed = True
        for mux in self._muxes.values():
            mux.close()
        if self._owns_conn:
            self._redis.close()

    def _mux(self, keys: Keys) -> ResultMux:
        """The result reader of a queue (its keys share one hash slot, so one XREAD reads them all)."""
        self.ensure_open()
        with self._muxes_lock:
            mux = self._muxes.get(keys.tag)
            if mux is None:
                mux = self._muxes[keys.tag] = ResultMux(
                    self._redis, keys, self.client_id, self.socket_timeout, self._url
                )
            return mux

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def submit(
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
    ) -> Job:
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
        partition), and the job returned is a `Choices` (`Result.choices`, deltas with their `index`); a failure
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
        jobs: list[Job] = []
        try:
            for keys, group in self.partition_groups(requests, queue):
                jobs += self._submit_group(group, keys, priority, tenant)
        except BaseException:
            if request_id is None:  # nobody can submit again into the choices submitted: stop them
                for submitted in jobs:
                    with contextlib.suppress(LLMQError):
                        submitted.cancel()
            raise
        if n == 1:
            return jobs[0]
        return Choices(self, base, self.keys_for(queue, base), jobs)

    def _submit_group(
        self, requests: list[GenerateRequest], keys: Keys, priority: Lane, tenant: str | None
    ) -> list[Job]:
        """One script call for a call's requests of one partition (`Submit`: all or nothing)."""
        with self.submitting(requests, keys, priority, tenant) as call:
            outcomes = self._retry(
                "a submit", lambda: self._scripts.submit.run_sync(self._redis, call, self.wait_replicas)
            )
            self.check_submitted(outcomes, keys, priority, tenant)
        return [Job(self, request.id, keys) for request in requests]

    def submit_many(
        self, requests: Iterable[Mapping[str, Any]], *, window: int = 64, timeout: float | None = None
    ) -> Iterator[Outcome]:
        """Submits `requests` (each the keyword arguments of `submit`) with at most `window` in flight, and
        yields each one's `Outcome` as it completes, in completion order, in memory bounded by `window` for
        any input size (the iterable is read lazily; `window` threads wait on results). While the queue is full
        it waits, never fails; a request refused before submitting, or failing, is an outcome with its typed
        error, and the rest go on."""
        if window < 1:
            raise ValueError("window must be >= 1")
        with ThreadPoolExecutor(max_workers=window, thread_name_prefix="llmq-submit") as pool:
            pending: set[Future[Outcome]] = set()
            try:
                for index, options in enumerate(requests):
                    while len(pending) >= window:
                        done, pending = wait(pending, return_when=FIRST_COMPLETED)
                        yield from (future.result() for future in done)
                    pending.add(pool.submit(self._one, index, options, timeout))
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    yield from (future.result() for future in done)
            finally:
                for future in pending:  # the caller stopped early: stop following (the requests themselves go on)
                    future.cancel()

    def _one(self, index: int, options: Mapping[str, Any], timeout: float | None) -> Outcome:
        refused = submit_arguments_error(options, type(self).submit)
        if refused is not None:
            return Outcome(index, None, error=refused)
        for delay in queue_full_delays():
            try:
                job = self.submit(**options)
                break
            except QueueFull:
                time.sleep(delay)
            except LLMQError as error:
                return Outcome(index, options.get("request_id"), error=error)
        try:
            return Outcome(index, job.id, result=job.result(timeout))
        except LLMQError as error:
            return Outcome(index, job.id, error=error)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **options: Any) -> Result:
        """`submit(prompt, **options)`, then `result(timeout)`."""
        return self.submit(prompt, **options).result(timeout)

    def check(self) -> None:
        """The blocking twin of `AsyncClient.check`."""
        self.ensure_open()
        url = self._url
        retry_sync("a check", url, 0, lambda: check_sync(self._redis, url) if url else self._redis.ping())

    def status(self, *, queue: str | None = None, stale_after_s: float = 15.0) -> QueueStatus:
        """Backlog, pending and lag of the consumer group, dead letters, and workers seen in `stale_after_s`."""
        self.ensure_open()
        keys = self.keys_for(queue)
        status: QueueStatus = self._retry("a status query", lambda: self._status(keys, stale_after_s))
        return status

    def _status(self, keys: Keys, stale_after_s: float) -> QueueStatus:
        """The blocking twin of `AsyncClient._status`."""
        pipe = self._redis.pipeline(transaction=False)
        queue_status_commands(pipe, keys, self.partitions)
        return status_from_replies(keys.queue, pipe.execute(raise_on_error=False), stale_after_s)

    def _retry(self, what: str, call: Any) -> Any:
        """`call()`, repeated while Redis is away for less than `failover_timeout`; then `RedisUnavailable`."""
        return retry_sync(what, self._url, self.failover_timeout, call)


class Job(BaseJob):
    """One submitted request."""

    _client: Client

    @classmethod
    def attach(cls, client: Client, request_id: str, *, queue: str | None = None) -> Job:
        """Follow a request submitted elsewhere, reading its result stream from the start."""
        return cls(client, request_id, client.keys_for(queue, request_id))

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """New output as it arrives. Ends after `done` (see `finish_reason`; a cancel just ends it),
        raises `RequestFailed` and subclasses on `error`, `ResultTimeout` after `timeout` seconds.
        The client's reader thread follows the stream (with every other awaited job's, over one connection); a
        lost connection is retried with backoff for about 30 s, resuming after the last entry read."""
        reader, started = self._reader, time.monotonic()
        if reader.builder.finished:  # read to its end already (`result()` after `stream()`): nothing to follow
            reader.builder.raise_for_error()
            return
        mux = self._client._mux(self.keys)
        follower = mux.follow(reader.key, reader.last_id)
        try:
            while not reader.builder.finished:
                remaining = reader.remaining_s(started, timeout)
                try:
                    item = follower.inbox.get(timeout=remaining)
                except queue.Empty:
                    continue  # the next round raises ResultTimeout
                if isinstance(item, BaseException):
                    raise item
                delta = reader.consume(*item)
                if delta is not None:
                    yield delta
        finally:
            mux.unfollow(follower)
        reader.builder.raise_for_error()

    def result(self, timeout: float | None = None) -> Result:
        """The whole output; raises `Cancelled` (with the partial result) if the request was cancelled."""
        for _ in self.stream(timeout):
            pass
        return self._reader.builder.outcome(raise_cancelled=True)

    def cancel(self) -> None:
        """Ask the workers to stop this request; the stream then ends with `finish_reason == "cancelled"`."""
        self._client.ensure_open()
        self._client._retry("a cancel", self._send_cancel)

    def _send_cancel(self) -> None:
        pipe = self._client._redis.pipeline(transaction=False)  # the mark, then the message: an order, not an atomicity
        queue_cancel_commands(
            pipe, self.keys, self.id, self._client.result_ttl, sharded=is_cluster(self._client._redis)
        )
        pipe.execute()


class Choices(BaseChoices, Job):
    """`submit(n=...)`'s job: `n` sampled answers to one prompt, each a request of its own (`jobs`, ids `<id>-<i>`).
    Its stream interleaves theirs, each delta with its choice's `index`; its result holds them all
    (`Result.choices`). One choice failing stops the others."""

    jobs: list[Job]

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """Every choice's new output as it arrives (`Delta.index`), until all have ended; a choice's error stops
        the others and is raised."""
        arrivals: queue.Queue[tuple[int, Delta | BaseException | None]] = queue.Queue()

        def follow(index: int, job: Job) -> None:
            try:
                for delta in job.stream(timeout):
                    arrivals.put((index, delta))
                arrivals.put((index, None))
            except BaseException as error:  # handed to the caller's thread, which raises it
                arrivals.put((index, error))

        for index, job in enumerate(self.jobs):
            threading.Thread(target=follow, args=(index, job), name=f"llmq-choice-{index}", daemon=True).start()
        following = len(self.jobs)
        while following:
            index, item = arrivals.get()
            if item is None:
                following -= 1
            elif isinstance(item, BaseException):
                self._stop_others(index)
                raise item
            else:
                yield replace(item, index=index)

    def result(self, timeout: float | None = None) -> Result:
        """Every choice's output (`Result.choices`); raises `Cancelled` if one was cancelled."""
        for _ in self.stream(timeout):
            pass
        return choices_result(self.id, [job.result() for job in self.jobs])

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    def _stop_others(self, failed: int) -> None:
        for index, job in enumerate(self.jobs):
            if index != failed and job.finish_reason is None:
                with contextlib.suppress(LLMQError):
                    job.cancel()


class ResultMux:
    """One daemon thread reads the result streams of every job this client awaits on one queue, over one
    connection at a time (`client._mux.MuxCore` decides what to read and routes it). Started by the first
    follower; any thread may follow and unfollow."""

    def __init__(
        self, redis: Redis, keys: Keys, client_id: str, socket_timeout: float | None, url: str | None = None
    ) -> None:
        self._redis = redis
        self._url = url
        self._core = MuxCore(keys, client_id, max_block_ms(socket_timeout))
        self._lock = threading.Lock()  # guards the core: followers come and go from any thread
        self._followed = threading.Condition(self._lock)
        self._blocked = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def follow(self, key: str, last_id: bytes | str) -> Follower:
        with self._lock:
            follower = self._core.follow(key, last_id, queue.Queue())
            self._followed.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._read_forever, name="llmq-results", daemon=True)
                self._thread.start()
            wake, self._blocked = self._blocked, False
        if wake:  # one wake for every job followed within WAKE_DELAY_S
            timer = threading.Timer(WAKE_DELAY_S, self._wake)
            timer.daemon = True
            timer.start()
        return follower

    def _wake(self) -> None:
        """Ends the reader's blocking read, best effort. A client closed meanwhile needs no wake, and closing its
        pool under a wake in flight makes redis-py fail in ways other than `RedisError`."""
        with self._redis.pipeline(transaction=False) as pipe:
            with self._lock:
                if self._closed:
                    return
                self._core.wake_commands(pipe)
            try:
                pipe.execute()
            except RedisError:
                pass
            except Exception:
                if not self._closed:
                    raise

    def unfollow(self, follower: Follower) -> None:
        with self._lock:
            self._core.unfollow(follower)

    def close(self) -> None:
        """Stops the reader and tells the jobs still waiting, before the connections close under them."""
        with self._lock:
            self._closed = True
            self._followed.notify()
            for follower in self._core.followers():
                follower.inbox.put(ClientClosed("the client was closed while this job awaited its result"))

    def _read_forever(self) -> None:
        core = self._core
        while True:
            with self._lock:
                while core.idle and not self._closed:
                    self._followed.wait()
                if self._closed:
                    return
            try:
                self._read_round()
            except REDIS_FAILURES as exc:
                if self._drop_wrong_types(exc):
                    continue
                with self._lock:
                    if self._closed:
                        return
                    delay = None if refused(exc) else core.retry_delay(exc)
                    if delay is None:
                        failure = unavailable("reading results", self._url, exc)
                        failure.__cause__ = exc
                        for follower in core.followers():
                            follower.inbox.put(failure)
                        self._thread = None
                        return
                time.sleep(delay)
            except Exception as exc:  # the pool was closed under us, say: tell every reader, then stop
                with self._lock:
                    if not self._closed:  # closed: the readers were told already
                        for follower in core.followers():
                            follower.inbox.put(exc)
                    self._thread = None
                return

    def _node(self) -> dict[str, Any]:
        """On a Cluster, the node of this queue's slot, named: redis-py 8.1's sync cluster client asks its default
        node (the first master it met) for XREAD's keys before each call, and never replaces a dead one."""
        if not isinstance(self._redis, RedisCluster):
            return {}
        return {"target_nodes": self._redis.get_node_from_key(self._core.wake_key)}

    def _drop_wrong_types(self, exc: Exception) -> bool:
        """After a `WRONGTYPE` reply, fails the jobs whose result key holds another type than a stream; True when
        there were any (the others read on at once)."""
        if not is_wrong_type(exc):
            return False
        with self._lock:
            keys = self._core.followed_keys()
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.type(key)
                kinds = pipe.execute()
        except REDIS_FAILURES:
            return False  # retried as any failure is
        with self._lock:
            failed = self._core.drop_wrong_types(dict(zip(keys, kinds, strict=True)))
        for follower, error in failed:
            follower.inbox.put(error)
        return bool(failed)

    def _read_round(self) -> None:
        core = self._core
        with self._lock:
            plan = core.plan(time.monotonic())
            self._blocked = plan.block_ms is not None
        node = self._node()
        try:
            if plan.block_ms is not None:
                replies = [self._redis.execute_command(*_xread(plan.chunks[0], plan.block_ms), **node)]
            else:
                with self._redis.pipeline(transaction=False) as pipe:
                    for chunk in plan.chunks:
                        pipe.execute_command(*_xread(chunk, None), **node)
                    replies = pipe.execute()
        finally:
            with self._lock:
                self._blocked = False
        with self._lock:
            routed = [item for reply in replies for item in core.route(reply)]
        for follower, entry_id, fields in routed:
            follower.inbox.put((entry_id, fields))


def _xread(streams: Mapping[KeyT, StreamIdT], block_ms: int | None) -> list[Any]:
    """XREAD's arguments, as redis-py's `xread` builds them."""
    block = [] if block_ms is None else ["BLOCK", block_ms]
    return ["XREAD", "COUNT", ENTRIES_PER_STREAM, *block, "STREAMS", *streams, *streams.values()]
