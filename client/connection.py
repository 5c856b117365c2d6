"""One way to connect: a Redis URL turned into a redis-py client, sync or asyncio, for every component.

    redis://[[user]:password@]host[:port][/db]          rediss://...  (TLS)       unix://[[user]:password@]/path?db=N
    redis+cluster://[user:password@]host:port[,host:port...][/0]                    rediss+cluster://...
    redis+sentinel://[user:password@]host[:port][,host[:port]...]/service[/db]      rediss+sentinel://...
        [?sentinel_username=U&sentinel_password=P]   (the sentinels' own credentials; their default port is 26379)

The worker, both clients, the CLI and the gateway connect through here, so they accept the same URLs. A Cluster URL
gives redis-py's cluster client (keys routed by slot; MOVED and ASK followed); a Sentinel URL gives a client whose
connections ask the sentinels for the master of `service` each time they connect, so after a failover a reconnect
finds the new master. Every connection treats a READONLY reply ("the primary moved": a demoted master, a managed
endpoint that flipped) as a lost connection: it reconnects and the command is retried. Passwords never appear in
messages (`redact_url`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import MasterNotFoundError as AsyncMasterNotFoundError
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode
from redis.exceptions import AskError, AuthenticationError, ReadOnlyError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from client.errors import LLMQError

Kind = Literal["standalone", "cluster", "sentinel"]
SENTINEL_PORT = 26379
_SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("standalone", False),
    "rediss": ("standalone", True),
    "unix": ("standalone", False),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
# What `redact_text` takes for a URL: a scheme as RFC 3986 spells it (any case), then anything up to whitespace.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")
_SENTINEL_PASSWORD = re.compile(r"(?i)(sentinel_password=)((?:(?!&sentinel_username=)\S)*)")
# A blocking pool's options: a bound callers wait under. redis-py's cluster and sentinel pools do not block; with
# a bound, the call past it fails (MaxConnectionsError) instead of waiting, so there they hold what they need.
_BLOCKING_POOL_ONLY = ("timeout", "max_connections")
_UNBOUNDED = 2**31
# redis-py's MasterNotFoundError says "No master found for 'svc' : <client repr> - auth:AuthenticationError, ..."
# with every sentinel's client in full (3 KB for three); this finds the error names in it.
_SENTINEL_ERROR = re.compile(r">\)> - (?:[a-z]+:)?([A-Za-z]\w*)")


class WrongDeployment(LLMQError, ValueError):
    """The URL's scheme does not match what answered: a Cluster node or a Sentinel behind a plain `redis://` URL."""


@dataclass(frozen=True)
class RedisAddress:
    """A parsed Redis URL: the kind of deployment, where it is and how to authenticate."""

    url: str
    kind: Kind
    tls: bool
    hosts: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = None
    db: int = 0
    service_name: str = ""  # Sentinel URLs only
    sentinel_credentials: Mapping[str, str] = field(default_factory=dict)

    @property
    def redacted(self) -> str:
        return redact_url(self.url)


def parse_url(url: str) -> RedisAddress:
    """Reads any URL of the module's grammar; raises ValueError (never showing the password) for anything else."""
    scheme, _, rest = url.partition("://")
    if scheme not in _SCHEMES or not rest:
        known = ", ".join(f"{name}://" for name in _SCHEMES)
        raise ValueError(f"not a Redis URL: {redact_url(url)} (expected one of {known})")
    kind, tls = _SCHEMES[scheme]
    if kind == "standalone":
        return RedisAddress(url, kind, tls)
    parts = _split(scheme, rest, url)
    shown = redact_url(url)
    userinfo, _, netloc = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    default_port = SENTINEL_PORT if kind == "sentinel" else None
    hosts = tuple(_host_port(part, default_port, shown) for part in netloc.split(","))
    options = _options(kind, parts.query, shown)
    path = [unquote(piece) for piece in parts.path.split("/") if piece]
    service_name, db = _path(kind, path, shown)
    return RedisAddress(
        url,
        kind,
        tls,
        hosts=hosts,
        username=unquote(username) or None,
        password=unquote(password) if userinfo and ":" in userinfo else None,
        db=db,
        service_name=service_name,
        sentinel_credentials={key.removeprefix("sentinel_"): value for key, value in options.items()},
    )


def _split(scheme: str, rest: str, url: str) -> SplitResult:
    """The URL's parts, as redis-py would read them; refused where a password's unencoded characters would cut
    it into pieces: a '#' starts a fragment (no Redis URL has one), a space ends the URL in a log line."""
    if any(char.isspace() for char in rest):
        raise ValueError(f"{scheme}://***: a space in a Redis URL (percent-encode it in a password: %20)")
    if "#" in rest:
        raise ValueError(f"{redact_url(url)}: a '#' in a Redis URL (percent-encode it in a password: %23)")
    try:
        return urlsplit(f"redis://{rest}")
    except ValueError as error:  # an unclosed [ of an IPv6 address; a netloc NFKC changes, which the error quotes
        reason = "a host that Unicode normalization changes" if "NFKC" in str(error) else str(error)
        raise ValueError(f"{redact_url(url)}: {reason}") from None


def _named(piece: str, shown: str) -> str:
    """`piece` quoted where the redacted URL `shown` shows it; else hidden: the parser may have cut it out of a
    password with an unencoded '/', '?' or '&' in it (`u:pa/ss@h:1` reads as host `u`, port `pa`)."""
    if piece and piece in shown:
        return repr(piece)
    return "<hidden: percent-encode any '/', '?', '&' or '@' in a password>"


def _is_number(text: str) -> bool:
    """ASCII digits only: `int()` also reads other scripts' digits ('٦٣٧٩'), which no Redis URL means."""
    return text.isascii() and text.isdigit()


def _host_port(text: str, default_port: int | None, shown: str) -> tuple[str, int]:
    """`host[:port]` or `[v6 address][:port]`."""
    if text.startswith("["):
        host, _, after = text[1:].partition("]")
        port = after.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError(f"{shown}: a host is empty")
    if not port:
        if default_port is None:
            raise ValueError(f"{shown}: host {_named(host, shown)} needs a port")
        return host, default_port
    if not _is_number(port) or not 0 < int(port) < 65536:
        raise ValueError(f"{shown}: bad port {_named(port, shown)}: a port is 1 to 65535, in ASCII digits")
    return host, int(port)


def _options(kind: Kind, query: str, shown: str) -> dict[str, str]:
    """The query's options (a Sentinel URL's only): unknown ones are named where `shown` shows them, which it does
    not after `sentinel_password=`, as an unencoded '&' in that password reads as the start of another option."""
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(options) - set(_SENTINEL_OPTIONS if kind == "sentinel" else ())
    if unknown:
        visible = sorted(unknown & set(dict(parse_qsl(shown.partition("?")[2], keep_blank_values=True))))
        names = ", ".join(visible) or "after sentinel_password (percent-encode any '&' in that password: %26)"
        raise ValueError(f"{shown}: unknown option(s) {names}")
    return options


def _path(kind: Kind, path: list[str], shown: str) -> tuple[str, int]:
    """(service name, db) from a cluster's (`/0` at most) or a sentinel's (`/service[/db]`) path."""
    if kind == "cluster":
        if path not in ([], ["0"]):
            raise ValueError(f"{shown}: a Redis Cluster has database 0 only")
        return "", 0
    if not 1 <= len(path) <= 2:
        raise ValueError(f"{shown}: a Sentinel URL names its service: redis+sentinel://host:port/<service>")
    if len(path) == 2 and not _is_number(path[1]):
        raise ValueError(f"{shown}: bad database {_named(path[1], shown)}")
    return path[0], int(path[1]) if len(path) == 2 else 0


def redact_url(url: str) -> str:
    """The URL with its passwords (the user's and the sentinels') replaced by `***`, for messages and logs.

    Read as conservatively as a password with unencoded characters needs: the user part runs from `://` to the
    last '@' (redis-py reads `redis://:p@ss@h` as the password `p@ss`), and a sentinel password to the next
    `&sentinel_username=` or the end. Where the two overlap (an '@' in a sentinel password) both are hidden
    whole. Any scheme, in any case: a typo in it must not show the password."""
    spans = [match.span(2) for match in _SENTINEL_PASSWORD.finditer(url)]
    spans.append(_user_password_span(url))
    pieces: list[str] = []
    shown_up_to = 0
    for begin, end in sorted(span for span in spans if span[0] < span[1]):
        if begin >= shown_up_to or not pieces:
            pieces += [url[shown_up_to:begin], "***"]
        shown_up_to = max(shown_up_to, end)
    return "".join([*pieces, url[shown_up_to:]])


def _user_password_span(url: str) -> tuple[int, int]:
    """Where the user part's password is: from the ':' after the user name to the last '@'; all of the user part
    where that name holds a '/', '?' or '#' (it is then a path or a query before a password's '@'). Empty if
    there is no '@', or no ':' before it (a user name alone)."""
    at = url.rfind("@")
    scheme_end = url.find("://")
    begin = scheme_end + 3 if 0 <= scheme_end < at else 0
    user, colon, _ = url[begin : max(at, begin)].partition(":")
    if set(user) & set("/?#"):
        return begin, at
    return (begin + len(user) + 1, at) if colon else (0, 0)


def redact_text(text: str) -> str:
    """`redact_url` for every URL in free text (a log line, a library's message): a URL ends at whitespace."""
    return _SENTINEL_PASSWORD.sub(r"\1***", _URL_IN_TEXT.sub(lambda url: redact_url(url[0]), text))


def secrets_of(url: str) -> list[str]:
    """The passwords a URL holds (the user's, the sentinels'), to scrub from a library's message that echoes them.
    None for a URL `parse_url` refuses: its own message shows none, and `llmq` scrubs that message too."""
    try:
        address = parse_url(url)
        if address.kind == "standalone":
            address = replace(address, password=urlsplit(url).password)
    except ValueError:
        return []
    found = [address.password, address.sentinel_credentials.get("password")]
    return [secret for secret in found if secret]


def is_cluster(client: Any) -> bool:
    """A redis-py Cluster client (sync or asyncio): cancels then go by sharded pub/sub."""
    return isinstance(client, redis.RedisCluster | aioredis.RedisCluster)


def connection_options(client: Any) -> Mapping[str, Any]:
    """The keyword arguments a client's connections are made with, whatever its kind."""
    return client.get_connection_kwargs() if is_cluster(client) else client.connection_pool.connection_kwargs


def explain(error: Exception, url: str) -> str:
    """A redis-py error in words a user can act on: a MOVED reply to a plain URL means a Redis Cluster, and a
    master no sentinel would name is told in one line, not redis-py's 3 KB of sentinel clients."""
    if isinstance(error, AskError) and parse_url(url).kind == "standalone":  # MovedError is an AskError
        return (
            f"a Redis Cluster node answered that this queue's keys live on {error.host}:{error.port}: "
            f"connect with redis+cluster://<host>:<port> (any node)"
        )
    if isinstance(error, MasterNotFoundError | AsyncMasterNotFoundError):
        return _no_master(str(error), parse_url(url))
    return str(error)


def _no_master(message: str, address: RedisAddress) -> str:
    """redis-py's message shortened: which service, through which sentinels, and why (its first sentinel error).
    Any other message (this one's own, once shortened) is returned as it is."""
    head = f"No master found for {address.service_name!r}"
    if address.kind != "sentinel" or (message != head and not message.startswith(f"{head} : ")):
        return message
    sentinels = ", ".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in address.hosts)
    errors = _SENTINEL_ERROR.findall(message)
    if not errors:
        return f"{head} through the sentinels at {sentinels}: none knows a master of that name that is up"
    hint = " (a wrong sentinel_username or sentinel_password?)" if errors[0] == AuthenticationError.__name__ else ""
    return f"{head} through the sentinels at {sentinels}: {len(errors)} failed, the first with {errors[0]}{hint}"


def _connection_kwargs(address: RedisAddress, ssl_ca_certs: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What every connection gets: READONLY retried as a lost connection, and the CA file (TLS only)."""
    extra: dict[str, Any] = {"retry_on_error": [ReadOnlyError]}
    if ssl_ca_certs is not None:
        if not address.tls:
            raise ValueError(f"ssl_ca_certs needs a TLS URL (rediss://...), not {address.redacted}")
        extra["ssl_ca_certs"] = ssl_ca_certs
    return {**extra, **kwargs}


def _credentials(address: RedisAddress) -> dict[str, Any]:
    return {"username": address.username, "password": address.password}


def _sentinel_kwargs(address: RedisAddress, connection: dict[str, Any], retry: Any) -> dict[str, Any]:
    """The sentinels' own connections: their credentials, the TLS settings of the data nodes, and redis-py's
    default retries (10, from 10 ms doubling to 1 s) but none of a refused password (`_RefusalIsFinal`)."""
    tls = {key: value for key, value in connection.items() if key.startswith("ssl")}
    retries = {"retry": retry(ExponentialWithJitterBackoff(base=0.01, cap=1), 10)}
    return {**({"ssl": True} if address.tls else {}), **tls, **retries, **address.sentinel_credentials}


class _RefusalIsFinal:
    """Mixed into redis-py's `Retry` (sync or asyncio) for the sentinels' connections. A refused password will not
    heal, yet redis-py retried it as a lost connection: 10 times (about 4.5 s) on each sentinel, and all again on
    each retry of the master's connection, so a wrong `sentinel_password` took 25 to 50 s to fail. The master's
    connection still retries MasterNotFoundError (a failover in progress) as before."""

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None, with_failure_count: bool = False) -> Any:
        def heals(error: Exception) -> bool:
            return not isinstance(error, AuthenticationError) and (is_retryable is None or is_retryable(error))

        return super().call_with_retry(do, fail, heals, with_failure_count)  # type: ignore[misc]


class _SentinelRetry(_RefusalIsFinal, Retry):
    pass


class _AsyncSentinelRetry(_RefusalIsFinal, AsyncRetry):
    pass


@dataclass(frozen=True)
class _Flavour:
    """redis-py's classes for one I/O model: the two trees mirror each other."""

    redis: Any
    blocking_pool: Any
    pool: Any
    cluster: Any
    cluster_node: Any
    sentinel: Any
    sentinel_retry: Any


_ASYNC = _Flavour(
    aioredis.Redis,
    aioredis.BlockingConnectionPool,
    aioredis.ConnectionPool,
    aioredis.RedisCluster,
    AsyncClusterNode,
    AsyncSentinel,
    _AsyncSentinelRetry,
)
_SYNC = _Flavour(
    redis.Redis,
    redis.BlockingConnectionPool,
    redis.ConnectionPool,
    redis.RedisCluster,
    ClusterNode,
    Sentinel,
    _SentinelRetry,
)


def open_async(url: str, *, ssl_ca_certs: str | None = None, **kwargs: Any) -> Any:
    """An asyncio client for `url`: `redis.asyncio.Redis` (over a blocking pool when `max_connections` is given,
    so callers wait for a free connection; a Cluster's and a Sentinel's pools are unbounded instead, as redis-py's
    cannot wait), or `redis.asyncio.RedisCluster`. `kwargs` go to the connections."""
    return _open(_ASYNC, url, ssl_ca_certs, kwargs)


def open_sync(url: str, *, ssl_ca_certs: str | None = None, **kwargs: Any) -> Any:
    """The blocking twin of `open_async`: `redis.Redis` or `redis.RedisCluster`."""
    return _open(_SYNC, url, ssl_ca_certs, kwargs)


def _open(flavour: _Flavour, url: str, ssl_ca_certs: str | None, kwargs: dict[str, Any]) -> Any:
    try:
        return _opened(flavour, url, ssl_ca_certs, kwargs)
    except ValueError as error:  # Python's URL parser quotes what it could not read: a password's unencoded part
        begin, end = _user_password_span(url)
        message = str(error)
        for piece in re.split(r"[:/?#@]", url[begin:end]):
            if piece:
                message = message.replace(piece, "***")
        raise ValueError(message) from None


def _opened(flavour: _Flavour, url: str, ssl_ca_certs: str | None, kwargs: dict[str, Any]) -> Any:
    address = parse_url(url)
    options = _connection_kwargs(address, ssl_ca_certs, kwargs)
    if address.kind == "standalone":
        pool_class = flavour.blocking_pool if "max_connections" in options else flavour.pool
        return flavour.redis.from_pool(pool_class.from_url(url, **options))
    options = {key: value for key, value in options.items() if key not in _BLOCKING_POOL_ONLY}
    options["max_connections"] = _UNBOUNDED  # redis-py's asyncio default (100) would fail the 101st concurrent call
    if address.kind == "cluster":
        nodes = [flavour.cluster_node(host, port) for host, port in address.hosts]
        return flavour.cluster(startup_nodes=nodes, ssl=address.tls, **_credentials(address), **options)
    sentinel_kwargs = _sentinel_kwargs(address, options, flavour.sentinel_retry)
    sentinel = flavour.sentinel(list(address.hosts), sentinel_kwargs=sentinel_kwargs, ssl=address.tls, **options)
    return sentinel.master_for(address.service_name, db=address.db, **_credentials(address))


async def check_async(client: Any, url: str) -> None:
    """Fails fast, before any real work, where `url` cannot serve: unreachable, refused credentials (redis-py's
    errors, a Sentinel's MasterNotFoundError in one line), or a deployment of another kind than the URL says
    (`WrongDeployment`)."""
    with _one_line(url):
        if is_cluster(client) or parse_url(url).kind != "standalone":
            await client.ping()
            return
        _refuse_wrong_deployment(url, await client.info("server"))


def check_sync(client: Any, url: str) -> None:
    """The blocking twin of `check_async`."""
    with _one_line(url):
        if is_cluster(client) or parse_url(url).kind != "standalone":
            client.ping()
            return
        _refuse_wrong_deployment(url, client.info("server"))


@contextmanager
def _one_line(url: str) -> Iterator[None]:
    """A MasterNotFoundError raised again, of its own class, with `explain`'s one line for a message."""
    try:
        yield
    except (MasterNotFoundError, AsyncMasterNotFoundError) as error:
        raise type(error)(explain(error, url)) from None


def _refuse_wrong_deployment(url: str, server_info: Mapping[str, Any]) -> None:
    """A plain URL that reaches a Cluster node would fail later with MOVED on every other shard's keys, and one that
    reaches a Sentinel with unknown commands: both are refused up front, naming the URL that works."""
    mode, port = server_info.get("redis_mode", "standalone"), server_info.get("tcp_port", "<port>")
    if mode == "cluster":
        raise WrongDeployment(
            f"{redact_url(url)} reaches a Redis Cluster node: connect with redis+cluster://<host>:{port}"
        )
    if mode == "sentinel":
        raise WrongDeployment(
            f"{redact_url(url)} reaches a Sentinel, not a Redis: connect with redis+sentinel://<host>:{port}/<service>"
        )
