"""`Client` and `Job`, the blocking twin of `client.aio`: Redis calls only, the logic lives in `client._core`.

Thread-safe as redis-py's client is: one `Client` may serve many threads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from client._core import DEFAULT_URL, BaseClient, BaseJob, Delta, Result, connect_kwargs
from client.protocol import DEFAULT_PREFIX, ChatMessage, RequestLimits
from client.store import QueueStatus, queue_cancel_commands, queue_status_commands, status_from_replies

_RECONNECTABLE = (RedisConnectionError, RedisTimeoutError)


class Client(BaseClient):
    """Submits requests to one queue (default) and follows their results, over redis-py's blocking client.

    :param url: `redis://` or `rediss://` URL, credentials included (they never appear in messages).
    :param queue: default queue for `submit`; each call may name another.
    :param max_queue_len: backlog at which `submit` raises `QueueFull` (0 = no limit).
    :param result_ttl: seconds a result (and the idempotency marker) outlives the last write.
    :param limits: checked before submitting (default `RequestLimits()`); workers enforce their own too.
    :param redis: an existing `redis.Redis` (decode_responses=False) to use instead of `url`;
        it is not closed by `close`.
    :param redis_kwargs: passed to `redis.Redis.from_url`.
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
        **redis_kwargs: Any,
    ) -> None:
        own = redis is None
        conn = Redis.from_url(url, **connect_kwargs(url, ssl_ca_certs, redis_kwargs)) if own else redis
        super().__init__(
            conn,
            url=url if own else None,
            owns_conn=own,
            queue=queue,
            prefix=prefix,
            max_queue_len=max_queue_len,
            result_ttl=result_ttl,
            limits=limits,
        )

    def close(self) -> None:
        if self._owns_conn:
            self._redis.close()

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
        messages: list[ChatMessage | dict[str, str]] | None = None,
        input_ids: list[int] | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
        ignore_eos: bool | None = None,
        queue: str | None = None,
        deadline: float | timedelta | datetime | None = None,
        request_id: str | None = None,
    ) -> Job:
        """Queue one request (exactly one of `prompt`, `messages`, `input_ids`) and return its job.

        Sampling parameters left at None take the wire defaults and ranges (`client.protocol.SamplingParams`,
        `BOUNDS`). Validation happens here, before Redis is touched (`InvalidRequest`, a ValueError). Submitting
        an id again is a no-op that returns a job following the first submission. `deadline` is seconds
        from now, a timedelta or a datetime; past it, workers answer `expired` instead of generating.
        Raises `QueueFull` when the queue's backlog is at `max_queue_len`.
        """
        keys = self.keys_for(queue)
        request = self.build_request(
            prompt,
            messages=messages,
            input_ids=input_ids,
            deadline=deadline,
            request_id=request_id,
            params={
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "stop": stop,
                "seed": seed,
                "ignore_eos": ignore_eos,
            },
        )
        script_keys, args = self.submit_args(request, keys)
        self.check_submitted(self._scripts.submit(keys=script_keys, args=args), keys)
        return Job(self, request.id, keys)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **options: Any) -> Result:
        """`submit(prompt, **options)`, then `result(timeout)`."""
        return self.submit(prompt, **options).result(timeout)

    def status(self, *, queue: str | None = None, stale_after_s: float = 15.0) -> QueueStatus:
        """Backlog, pending and lag of the consumer group, dead letters, and workers seen in `stale_after_s`."""
        keys = self.keys_for(queue)
        pipe = self._redis.pipeline(transaction=False)
        queue_status_commands(pipe, keys)
        return status_from_replies(keys.queue, pipe.execute(raise_on_error=False), stale_after_s)


class Job(BaseJob):
    """One submitted request."""

    _client: Client

    @classmethod
    def attach(cls, client: Client, request_id: str, *, queue: str | None = None) -> Job:
        """Follow a request submitted elsewhere, reading its result stream from the start."""
        return cls(client, request_id, client.keys_for(queue))

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """New output as it arrives. Ends after `done` (see `finish_reason`; a cancel just ends it),
        raises `RequestFailed` and subclasses on `error`, `ResultTimeout` after `timeout` seconds.
        A lost connection is retried with backoff for about 30 s, resuming after the last entry read."""
        reader, started = self._reader, time.monotonic()
        while not reader.builder.finished:
            block = reader.block_ms(started, timeout, self._client.socket_timeout)
            try:
                reply = self._client._redis.xread({reader.key: reader.last_id}, block=block)
            except _RECONNECTABLE as exc:
                delay = reader.retry_delay(exc)
                if delay is None:
                    raise
                time.sleep(delay)
                continue
            yield from reader.consume(reply)
        reader.builder.raise_for_error()

    def result(self, timeout: float | None = None) -> Result:
        """The whole output; raises `Cancelled` (with the partial result) if the request was cancelled."""
        for _ in self.stream(timeout):
            pass
        return self._reader.builder.outcome(raise_cancelled=True)

    def cancel(self) -> None:
        """Ask the workers to stop this request; the stream then ends with `finish_reason == "cancelled"`."""
        pipe = self._client._redis.pipeline(transaction=True)
        queue_cancel_commands(pipe, self.keys, self.id, self._client.result_ttl)
        pipe.execute()
