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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.cluster import ClusterNode
from redis.exceptions import AskError, ReadOnlyError
from redis.sentinel import Sentinel

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
# A blocking pool's options: a bound callers wait under. redis-py's cluster and sentinel pools do not block; with
# a bound, the call past it fails (MaxConnectionsError) instead of waiting, so there they hold what they need.
_BLOCKING_POOL_ONLY = ("timeout", "max_connections")
_UNBOUNDED = 2**31


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
    try:
        parts = urlsplit(f"redis://{rest}")
    except ValueError as error:  # an unclosed [ of an IPv6 address
        raise ValueError(f"{redact_url(url)}: {error}") from None
    userinfo, _, netloc = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    default_port = SENTINEL_PORT if kind == "sentinel" else None
    hosts = tuple(_host_port(part, default_port, url) for part in netloc.split(","))
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_SENTINEL_OPTIONS if kind == "sentinel" else ()))
    if unknown:
        raise ValueError(f"{redact_url(url)}: unknown option(s) {', '.join(unknown)}")
    path = [unquote(piece) for piece in parts.path.split("/") if piece]
    service_name, db = _path(kind, path, url)
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


def _host_port(text: str, default_port: int | None, url: str) -> tuple[str, int]:
    """`host[:port]` or `[v6 address][:port]`."""
    if text.startswith("["):
        host, _, after = text[1:].partition("]")
        port = after.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError(f"{redact_url(url)}: a host is empty")
    if not port:
        if default_port is None:
            raise ValueError(f"{redact_url(url)}: {host} needs a port")
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{redact_url(url)}: bad port {port!r}")
    return host, int(port)


def _path(kind: Kind, path: list[str], url: str) -> tuple[str, int]:
    """(service name, db) from a cluster's (`/0` at most) or a sentinel's (`/service[/db]`) path."""
    if kind == "cluster":
        if path not in ([], ["0"]):
            raise ValueError(f"{redact_url(url)}: a Redis Cluster has database 0 only")
        return "", 0
    if not 1 <= len(path) <= 2:
        raise ValueError(f"{redact_url(url)}: a Sentinel URL names its service: redis+sentinel://host:port/<service>")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"{redact_url(url)}: bad database {path[1]!r}")
    return path[0], int(path[1]) if len(path) == 2 else 0


def redact_url(url: str) -> str:
    """The URL with its passwords (the user's and the sentinels') replaced by `***`, for messages and logs."""
    scheme, _, rest = url.partition("://")
    try:
        parts = urlsplit(f"redis://{rest}")
    except ValueError:
        return f"{scheme}://***"  # unreadable: show nothing that could be a password
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = f"{userinfo.partition(':')[0]}:***"
    query = "&".join(
        f"{key}=***" if key == "sentinel_password" else f"{key}={value}"
        for key, value in parse_qsl(parts.query, keep_blank_values=True)
    )
    netloc = f"{userinfo}@{hosts}" if at else hosts
    return f"{scheme}://" + urlunsplit(("", netloc, parts.path, query, parts.fragment)).removeprefix("//")


def secrets_of(url: str) -> list[str]:
    """The passwords a URL holds (the user's, the sentinels'), to scrub from a library's message that echoes them."""
    address = parse_url(url)
    if address.kind == "standalone":
        address = replace(address, password=urlsplit(url).password)
    found = [address.password, address.sentinel_credentials.get("password")]
    return [secret for secret in found if secret]


def is_cluster(client: Any) -> bool:
    """A redis-py Cluster client (sync or asyncio): cancels then go by sharded pub/sub."""
    return isinstance(client, redis.RedisCluster | aioredis.RedisCluster)


def connection_options(client: Any) -> Mapping[str, Any]:
    """The keyword arguments a client's connections are made with, whatever its kind."""
    return client.get_connection_kwargs() if is_cluster(client) else client.connection_pool.connection_kwargs


def explain(error: Exception, url: str) -> str:
    """A redis-py error in words a user can act on: a MOVED reply to a plain URL means a Redis Cluster."""
    if isinstance(error, AskError) and parse_url(url).kind == "standalone":  # MovedError is an AskError
        return (
            f"a Redis Cluster node answered that this queue's keys live on {error.host}:{error.port}: "
            f"connect with redis+cluster://<host>:<port> (any node)"
        )
    return str(error)


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


def _sentinel_kwargs(address: RedisAddress, connection: dict[str, Any]) -> dict[str, Any]:
    """The sentinels' own connections: their credentials, and the TLS settings of the data nodes."""
    tls = {key: value for key, value in connection.items() if key.startswith("ssl")}
    return {**({"ssl": True} if address.tls else {}), **tls, **address.sentinel_credentials}


@dataclass(frozen=True)
class _Flavour:
    """redis-py's classes for one I/O model: the two trees mirror each other."""

    redis: Any
    blocking_pool: Any
    pool: Any
    cluster: Any
    cluster_node: Any
    sentinel: Any


_ASYNC = _Flavour(
    aioredis.Redis,
    aioredis.BlockingConnectionPool,
    aioredis.ConnectionPool,
    aioredis.RedisCluster,
    AsyncClusterNode,
    AsyncSentinel,
)
_SYNC = _Flavour(
    redis.Redis, redis.BlockingConnectionPool, redis.ConnectionPool, redis.RedisCluster, ClusterNode, Sentinel
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
    sentinels = list(address.hosts)
    sentinel = flavour.sentinel(
        sentinels, sentinel_kwargs=_sentinel_kwargs(address, options), ssl=address.tls, **options
    )
    return sentinel.master_for(address.service_name, db=address.db, **_credentials(address))


async def check_async(client: Any, url: str) -> None:
    """Fails fast, before any real work, where `url` cannot serve: unreachable, refused credentials (redis-py's
    errors), or a deployment of another kind than the URL says (`WrongDeployment`)."""
    if is_cluster(client) or parse_url(url).kind != "standalone":
        await client.ping()
        return
    _refuse_wrong_deployment(url, await client.info("server"))


def check_sync(client: Any, url: str) -> None:
    """The blocking twin of `check_async`."""
    if is_cluster(client) or parse_url(url).kind != "standalone":
        client.ping()
        return
    _refuse_wrong_deployment(url, client.info("server"))


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
