"""How a call to Redis rides out a failover: which of redis-py's exceptions mean "Redis is away for now" (a primary
being replaced, a connection dropped) and which never heal, and the bounded backoff that turns an outage longer
than the caller's window into `RedisUnavailable`.

Repeating a client call is safe: a submit is idempotent by request id (the `SUBMIT` script's marker), a cancel is
idempotent and a status query is a read. Workers use `REDIS_FAILURES` in their loops, which retry forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio.sentinel import MasterNotFoundError as AsyncMasterNotFoundError
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    ConnectionError,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TimeoutError,
    TryAgainError,
)
from redis.sentinel import MasterNotFoundError

from client.backoff import Backoff
from client.connection import explain, redact_url
from client.errors import RedisUnavailable
from client.replication import NotReplicated, Rerouted

log = logging.getLogger("llmq.client")

T = TypeVar("T")

# What a call to Redis can raise besides its answer. redis-py's cluster client raises two kinds that are no
# `RedisError`: `RedisClusterException` (`SlotNotCoveredError` while a shard has no master, or no seed node
# reachable), and, from its asyncio client (8.1), `AttributeError` ("'NoneType' object has no attribute
# 'writelines'") when a failure on one command tears down a node's connections that other commands are using.
REDIS_FAILURES: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError, AttributeError)

# Failures that say the primary is moving or briefly gone: a dropped or refused connection (which includes a
# Sentinel naming no master yet and a replica still loading), CLUSTERDOWN while a replica is promoted, TRYAGAIN
# during a slot migration, READONLY from a primary demoted under us, a slot no master covers, a torn connection,
# replicas slow to acknowledge a write (`NotReplicated`: they catch up, or a replica is promoted or replaced), and
# a pinned pipeline's node no longer owning its slot (`Rerouted`).
_HEALS: tuple[type[Exception], ...] = (ConnectionError, TimeoutError, ClusterDownError, TryAgainError, ReadOnlyError)
_HEALS += (SlotNotCoveredError, OSError, AttributeError, NotReplicated, Rerouted)
_NEVER_HEALS = (AuthenticationError, AuthorizationError, NoPermissionError)  # credentials and ACLs stay wrong

FAILOVER_TIMEOUT_S = 20.0  # default window: a Cluster or Sentinel promotion plus its clients' rediscovery
BACKOFF_S = (0.05, 1.0)  # base and cap of the doubling delay between attempts


def refused(error: BaseException) -> bool:
    """Credentials or an ACL refused: no retry changes that."""
    return isinstance(error, _NEVER_HEALS) or _refused_by_sentinels(error)


def heals(error: BaseException) -> bool:
    """True for a failure that a failover or a reconnection ends; False for one that repeats until someone acts."""
    if refused(error):
        return False
    if isinstance(error, RedisClusterException) and "cannot be connected" in str(error):
        return True  # no node of the Cluster reachable (redis-py names no class for it)
    return isinstance(error, _HEALS)


def _refused_by_sentinels(error: BaseException) -> bool:
    """A Sentinel URL whose sentinels refused the password: redis-py reports it as no master found, which during a
    failover heals, but with the refusal named in its message (`client.connection.explain` keeps it)."""
    return isinstance(error, MasterNotFoundError | AsyncMasterNotFoundError) and AuthenticationError.__name__ in str(
        error
    )


def reraise_lost_cancellation() -> None:
    """Raises `CancelledError` in a task that was cancelled but runs on. redis-py can lose a cancellation: one
    landing mid-read can surface as a connection error, and on Python 3.11 its send path runs under
    `asyncio.wait_for`, which returns the send's result instead of raising when the cancel lands as the send
    completes (CPython gh-86296, fixed in 3.12). A loop of Redis calls checks here each round, so a cancelled
    worker or reader ends instead of serving on."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class FailoverBackoff:
    """The delays between attempts of one call, sans I/O: doubling from `BACKOFF_S[0]`, jittered
    (`client.backoff`), while the failures heal and the first is less than `window_s` old; then `RedisUnavailable`
    (naming `what` and the redacted URL)."""

    def __init__(self, what: str, url: str | None, window_s: float) -> None:
        self._what = what
        self._url = url
        self._window_s = window_s
        self._since: float | None = None
        self._delays = Backoff(*BACKOFF_S)

    def delay_after(self, error: Exception) -> float:
        now = time.monotonic()
        self._since = now if self._since is None else self._since
        delay = self._delays.next()
        if not heals(error) or now + delay - self._since > self._window_s:
            raise unavailable(self._what, self._url, error) from error
        log.warning("%s failed (%s); retrying in %.2f s", self._what, type(error).__name__, delay)
        return delay


def unavailable(what: str, url: str | None, error: Exception) -> RedisUnavailable:
    """The typed error for a call that failed for good, in words a user can act on (`explain`), without secrets."""
    if url is None:
        return RedisUnavailable(f"Redis did not serve {what}: {error or type(error).__name__}")
    reason = (explain(error, url) or type(error).__name__).replace(url, redact_url(url))
    return RedisUnavailable(f"Redis at {redact_url(url)} did not serve {what}: {reason}")


async def retry_async(what: str, url: str | None, window_s: float, call: Callable[[], Awaitable[T]]) -> T:
    """`await call()`, repeated across a failover (see `FailoverBackoff`)."""
    backoff = FailoverBackoff(what, url, window_s)
    while True:
        try:
            return await call()
        except REDIS_FAILURES as error:
            await asyncio.sleep(backoff.delay_after(error))


def retry_sync(what: str, url: str | None, window_s: float, call: Callable[[], T]) -> T:
    """The blocking twin of `retry_async`."""
    backoff = FailoverBackoff(what, url, window_s)
    while True:
        try:
            return call()
        except REDIS_FAILURES as error:
            time.sleep(backoff.delay_after(error))
