"""Real Redis topologies for tests: a Redis Cluster of masters with replicas, and a master/replica pair watched by
three sentinels.

Every node is a `redis-server` process on free 127.0.0.1 ports, in its own directory, started from a config file
kept there, so a node killed with SIGKILL can be started again as itself (a cluster node re-reads its nodes.conf).
Both sets are context managers: leaving the block stops every process they started (terminate, then kill), also
when the test or the start-up itself failed; an atexit hook kills whatever a caller forgot. Every wait polls with a
deadline and raises `TopologyTimeout` with what it last saw and the tails of the nodes' logs. The cluster is formed
with CLUSTER MEET / ADDSLOTSRANGE / REPLICATE through redis-py, so it needs nothing but `redis-server`.
"""

from __future__ import annotations

import atexit
import itertools
import os
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.cluster import key_slot
from redis.exceptions import RedisError
from redis.retry import Retry

from client.store import Keys
from testing.certificates import TLSFiles
from worker.embedded_redis import find_redis_server

HOST = "127.0.0.1"
SLOTS = 16384
# Shared by both sets: no persistence, no 5 s wait before a full sync, and SIGTERM does not wait for replicas.
DATA_NODE_CONF = ('save ""', "appendonly no", "repl-diskless-sync-delay 0", "shutdown-on-sigterm now")
T = TypeVar("T")
_RUNNING: set[subprocess.Popen[bytes]] = set()


class TopologyTimeout(TimeoutError):
    """A topology did not reach the state a test waits for; the message says what was last seen, with log tails."""


class NotYet(Exception):
    """Raised by a `wait_until` check to say why the state is not reached yet (shown if the wait times out)."""


class NoSlotOwner(LookupError):
    """No master owns the slot in the view read: the slot is unserved, or a failover is under way."""


def wait_until(check: Callable[[], T | None], *, timeout: float, what: str, nodes: Iterable[RedisNode] = ()) -> T:
    """Poll `check` until it returns something other than None; NotYet, Redis and socket errors mean "not yet"."""
    deadline = time.monotonic() + timeout
    last = "no check finished"
    while True:
        try:
            result = check()
            if result is not None:
                return result
            last = "not yet"
        except (NotYet, RedisError, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            logs = "\n".join(node.log_tail() for node in nodes)
            raise TopologyTimeout(f"{what}: not within {timeout:g} s (last: {last})\n{logs}")
        time.sleep(0.05)


# Node ports come from a band of this test process's own, below the kernel's ephemeral range (32768 and up on
# Linux): a node killed for a failover is started again on its port seconds later, and in the meantime neither a
# second test process (`make test` runs four topology tests at a time, one band each) nor an outgoing connection may
# take it.
_BAND_BASE, _BAND_SIZE, _BANDS = 20_000, 3_000, 4
_NEXT_IN_BAND = itertools.count(random.randrange(_BAND_SIZE))


def _band_start() -> int:
    """This process's band: by pytest-xdist's worker number (`gw0`, `gw1`, ...); a run without xdist takes the first."""
    number = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return _BAND_BASE + _BAND_SIZE * ((int(number) if number.isdigit() else 0) % _BANDS)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as redis-server binds
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def node_ports(count: int) -> list[int]:
    """`count` distinct ports for nodes this process may restart: from its own band, each free now, handed out in
    turn so a killed node's port is not handed out again while the band has others."""
    start, ports = _band_start(), []
    for _ in range(_BAND_SIZE):
        port = start + next(_NEXT_IN_BAND) % _BAND_SIZE
        if port not in ports and _bindable(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports in {start}-{start + _BAND_SIZE - 1}")


def conf_quote(value: str) -> str:
    """A value as one config-file token, whatever it contains (passwords)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parse_info(text: str) -> dict[str, str]:
    """`key:value` lines (CLUSTER INFO) as a dict."""
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class RedisNode:
    """One redis-server process (a sentinel with `sentinel=True`) on `port`, configured by `redis.conf` in `workdir`.

    The config file stays between runs, so `start()` after `kill()` brings the same node back on the same port.
    `password` is what clients of this node must send (a sentinel's own `requirepass`); with `tls` the port speaks
    TLS only, and so do replication, the cluster bus and sentinels."""

    def __init__(
        self,
        workdir: Path,
        port: int,
        conf: Iterable[str],
        *,
        sentinel: bool = False,
        password: str | None = None,
        tls: TLSFiles | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = port
        self.sentinel = sentinel
        self.password = password
        self.tls = tls
        self.log_path = workdir / "redis.log"
        self.conf_path = workdir / "redis.conf"
        workdir.mkdir(parents=True, exist_ok=True)
        ports = [f"port {port}"] if tls is None else ["port 0", f"tls-port {port}", *tls.server_conf()]
        head = [*ports, f"bind {HOST}", f"dir {conf_quote(str(workdir))}", f"logfile {conf_quote('redis.log')}"]
        self.conf_path.write_text("\n".join([*head, *conf]) + "\n")
        self._process: subprocess.Popen[bytes] | None = None
        self._client: redis.Redis | None = None

    def __repr__(self) -> str:
        return f"RedisNode({HOST}:{self.port}{', sentinel' if self.sentinel else ''})"

    @property
    def address(self) -> tuple[str, int]:
        return (HOST, self.port)

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"{'redis' if self.tls is None else 'rediss'}://{auth}{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> Self:
        """Launch the process without waiting for it (`wait_ready` does), so a set starts its nodes together."""
        if self.alive:
            raise RuntimeError(f"{self!r} is already running")
        args = [find_redis_server(), str(self.conf_path), *(["--sentinel"] if self.sentinel else [])]
        # Errors before the log file opens (a bad config) go to stdout; own session: a Ctrl-C is for pytest only.
        with open(self.workdir / "stdout.log", "ab") as out:
            self._process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _RUNNING.add(self._process)
        return self

    def wait_ready(self, timeout: float = 10) -> Self:
        """Until PING answers; raises at once with the log if the process exits instead."""

        def ping() -> bool | None:
            if not self.alive:
                raise RuntimeError(f"{self!r} exited during start-up:\n{self.log_tail()}")
            return True if self.client().ping() else None

        wait_until(ping, timeout=timeout, what=f"{self!r} answering PING", nodes=[self])
        return self

    def client(self) -> redis.Redis:
        """A cached client that fails fast (no retries, short timeouts), for polling; str replies."""
        if self._client is None:
            self._client = redis.Redis(
                host=HOST,
                port=self.port,
                password=self.password,
                decode_responses=True,
                socket_timeout=2,
                socket_connect_timeout=1,
                retry=Retry(NoBackoff(), 0),
                **({} if self.tls is None else {"ssl": True, "ssl_ca_certs": str(self.tls.ca)}),
            )
        return self._client

    def execute(self, *args: str | int) -> object:
        return self.client().execute_command(*args)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last save, like a crashed machine."""
        self._end(kill=True)

    def stop(self, timeout: float = 5) -> None:
        """SIGTERM, then SIGKILL if it is still running after `timeout`."""
        self._end(kill=False, timeout=timeout)

    def terminate(self) -> None:
        """Send SIGTERM without waiting, so a set stops its nodes together; `stop` then reaps them."""
        if self.alive:
            assert self._process is not None
            self._process.terminate()

    def _end(self, *, kill: bool, timeout: float = 5) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        process, self._process = self._process, None
        if process is None:
            return
        (process.kill if kill else process.terminate)()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        finally:
            _RUNNING.discard(process)

    def log_tail(self, lines: int = 15) -> str:
        text = "".join(
            path.read_text(errors="replace") for path in (self.workdir / "stdout.log", self.log_path) if path.exists()
        )
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- {self!r} {self.log_path} ---\n{tail}"


def stop_all(nodes: Iterable[RedisNode]) -> None:
    """Stop every node, SIGTERM to all first; one that will not stop is killed, and the rest are still stopped."""
    nodes = list(nodes)
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.stop()


@atexit.register
def _kill_leftovers() -> None:
    """Last resort for a set that was never closed (a crash between start and the `with`): no orphans."""
    for process in list(_RUNNING):
        process.kill()
        process.wait()


class _NodeSet:
    """Context-manager plumbing shared by both sets: `start` builds it, `close` stops every node."""

    nodes: list[RedisNode]

    def start(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        stop_all(self.nodes)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every node's log, for an assertion message that must say what the nodes did."""
        return "\n".join(node.log_tail(lines) for node in self.nodes)

    def node_at(self, port: int) -> RedisNode:
        for node in self.nodes:
            if node.port == port:
                return node
        raise KeyError(f"no node of this set on port {port}")


# -- Redis Cluster ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterNodeInfo:
    """One line of CLUSTER NODES: how one node sees another (or itself, with the `myself` flag)."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})

    def owns(self, slot: int) -> bool:
        return any(first <= slot <= last for first, last in self.slots)


def parse_cluster_nodes(text: str) -> list[ClusterNodeInfo]:
    """CLUSTER NODES lines: `<id> <ip:port@cport[,host]> <flags> <master|-> <ping> <pong> <epoch> <link> <slots>...`."""
    infos = []
    for line in text.splitlines():
        if not line.strip():
            continue
        node_id, address, flags, master, _ping, _pong, _epoch, _link, *slots = line.split()
        ranges = []
        for item in slots:
            if item.startswith("["):  # a slot being migrated or imported
                continue
            first, _, last = item.partition("-")
            ranges.append((int(first), int(last or first)))
        port = int(address.split("@")[0].rsplit(":", 1)[1])
        master_id = None if master == "-" else master
        infos.append(ClusterNodeInfo(node_id, port, frozenset(flags.split(",")), master_id, tuple(ranges)))
    return infos


def slot_ranges(masters: int) -> list[tuple[int, int]]:
    """Split the slots as `redis-cli --cluster create` does: contiguous, nearly equal ranges."""
    bounds = [round(i * SLOTS / masters) for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


class RedisClusterSet(_NodeSet):
    """A Redis Cluster on 127.0.0.1: `masters` masters (3) with `replicas` replicas (1) each.

    At start `nodes[:masters]` are the masters in slot order and the rest their replicas, but failovers change
    roles, so `masters()`, `replicas_of()` and `master_for_key()` ask the cluster instead of remembering.
    `node_timeout_ms` bounds how soon a dead master is failed over (about twice it in practice).
    """

    def __init__(
        self,
        root: Path,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        tls: TLSFiles | None = None,
    ) -> None:
        count = masters * (1 + replicas)
        ports = node_ports(2 * count)  # the cluster bus gets a port of its own, not port + 10000
        self.bus_ports = dict(zip(ports[:count], ports[count:], strict=True))
        self.initial_masters = masters
        self.nodes = [
            RedisNode(root / f"node{i}", port, self._conf(self.bus_ports[port], node_timeout_ms), tls=tls)
            for i, port in enumerate(ports[:count])
        ]
        self.ids: dict[int, str] = {}  # port -> node id (kept across restarts: it is in nodes.conf)
        self._slot_of_killed: dict[int, int] = {}
        self.tls = tls

    @staticmethod
    def _conf(bus_port: int, node_timeout_ms: int) -> list[str]:
        return [
            *DATA_NODE_CONF,
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-port {bus_port}",
            f"cluster-node-timeout {node_timeout_ms}",
            "cluster-replica-validity-factor 0",  # a replica may always take over, however long it was cut off
        ]

    @property
    def seed_url(self) -> str:
        """`redis+cluster://` URL of the first running node."""
        node = next((node for node in self.nodes if node.alive), self.nodes[0])
        return f"{'redis' if self.tls is None else 'rediss'}+cluster://{HOST}:{node.port}"

    @property
    def node_urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def _start(self) -> None:
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.wait_ready()
            self.ids[node.port] = str(node.execute("CLUSTER", "MYID"))
        masters, replicas = self.nodes[: self.initial_masters], self.nodes[self.initial_masters :]
        for epoch, (node, (first, last)) in enumerate(zip(masters, slot_ranges(len(masters)), strict=True), 1):
            node.execute("CLUSTER", "SET-CONFIG-EPOCH", epoch)  # distinct epochs, as redis-cli sets them
            node.execute("CLUSTER", "ADDSLOTSRANGE", first, last)
        for node in self.nodes[1:]:
            self.nodes[0].execute("CLUSTER", "MEET", HOST, node.port, self.bus_ports[node.port])
        wait_until(self._all_met, timeout=10, what="every cluster node knowing every other", nodes=self.nodes)
        for index, replica in enumerate(replicas):
            replica.execute("CLUSTER", "REPLICATE", self.ids[masters[index % len(masters)].port])
        self.wait_healthy(timeout=20)

    def _all_met(self) -> bool:
        for node in self.nodes:
            view = self.view(node)
            if len(view) != len(self.nodes) or any(info.failing for info in view):
                raise NotYet(f"{node!r} sees {[sorted(info.flags) for info in view]}")
        return True

    def view(self, node: RedisNode | None = None) -> list[ClusterNodeInfo]:
        """CLUSTER NODES as `node` (default: the first running node that answers) sees it."""
        if node is not None:
            return parse_cluster_nodes(str(node.execute("CLUSTER", "NODES")))
        for candidate in self.nodes:
            if candidate.alive:
                try:
                    return self.view(candidate)
                except RedisError:
                    continue
        raise redis.ConnectionError("no cluster node is answering")  # a RedisError: a wait polling a view retries it

    def wait_healthy(self, timeout: float = 15) -> None:
        """Until every running node says cluster_state:ok, agrees on who is master and every replica's link is up."""
        wait_until(self._healthy, timeout=timeout, what="cluster healthy", nodes=self.nodes)

    def _healthy(self) -> bool:
        running = [node for node in self.nodes if node.alive]
        reference = {info.port: info for info in self.view(running[0])}
        for node in running:
            state = parse_info(str(node.execute("CLUSTER", "INFO"))).get("cluster_state")
            if state != "ok":
                raise NotYet(f"{node!r} cluster_state:{state}")
            me = next(info for info in self.view(node) if "myself" in info.flags)
            seen = reference.get(node.port)
            if seen is None or seen.failing or (seen.is_master, seen.master_id) != (me.is_master, me.master_id):
                raise NotYet(f"{running[0]!r} does not yet see {node!r} as it sees itself")
            if not me.is_master and node.client().info("replication").get("master_link_status") != "up":
                raise NotYet(f"replica {node!r} link not up")
        return True

    def masters(self) -> list[RedisNode]:
        """Running masters that own slots, in slot order."""
        owners = [info for info in self.view() if info.is_master and info.slots and not info.failing]
        return [self.node_at(info.port) for info in sorted(owners, key=lambda info: info.slots[0])]

    def replicas_of(self, master: RedisNode) -> list[RedisNode]:
        master_id = self.ids[master.port]
        return [self.node_at(info.port) for info in self.view() if info.master_id == master_id and not info.failing]

    def master_for_slot(self, slot: int) -> RedisNode:
        for info in self.view():
            if info.is_master and info.owns(slot):
                return self.node_at(info.port)
        raise NoSlotOwner(f"no master owns slot {slot}")

    def master_for_key(self, key: str | bytes) -> RedisNode:
        return self.master_for_slot(key_slot(key.encode() if isinstance(key, str) else key))

    def queue_on(self, master: RedisNode, prefix: str = "q") -> str:
        """A queue name whose keys (`{llmq:<name>}:...`) live on `master`."""
        slots = next(info.slots for info in self.view() if info.port == master.port)
        for n in range(100_000):
            name = f"{prefix}{n}"
            if any(first <= key_slot(Keys(name).tag.encode()) <= last for first, last in slots):
                return name
        raise LookupError(f"no queue name for {master!r}")

    def queues_on_different_masters(self, prefix: str = "q") -> tuple[str, str]:
        """Two queue names whose keys live on two different masters (the first two in slot order)."""
        first, second = self.masters()[:2]
        return self.queue_on(first, prefix), self.queue_on(second, prefix)

    def kill_master(self, master: RedisNode) -> None:
        """SIGKILL a master; `wait_for_promotion(master)` then waits for its replica to take over."""
        info = next((info for info in self.view() if info.port == master.port), None)
        if info is None or not info.is_master or not info.slots:
            raise ValueError(f"{master!r} is not a master that owns slots")
        self._slot_of_killed[master.port] = info.slots[0][0]
        master.kill()

    def wait_for_promotion(self, old_master: RedisNode, timeout: float = 15) -> RedisNode:
        """Until a running node owns the old master's slots and calls itself master, cluster_state:ok everywhere;
        returns the new master."""
        slot = self._slot_of_killed.pop(old_master.port, None)
        if slot is None:
            slot = next(info.slots[0][0] for info in self.view() if info.port == old_master.port and info.slots)

        def promoted() -> RedisNode:
            try:
                owner = self.master_for_slot(slot)
            except NoSlotOwner as exc:  # mid-failover, a node's view can list the slot under no master yet
                raise NotYet(str(exc)) from exc
            if owner is old_master or not owner.alive:
                raise NotYet(f"slot {slot} still on {old_master!r}")
            self._healthy()
            return owner

        return wait_until(promoted, timeout=timeout, what=f"a replica of {old_master!r} promoted", nodes=self.nodes)

    def restart(self, node: RedisNode, timeout: float = 20) -> RedisNode:
        """Start a killed node again on its port; it rejoins (a failed-over master as a replica) and the cluster is
        healthy again when this returns."""
        node.start().wait_ready()
        self.wait_healthy(timeout)
        return node


# -- Sentinel -----------------------------------------------------------------------------------------------------


class SentinelSet(_NodeSet):
    """A master, one replica and three sentinels (quorum 2) watching them as `service_name`, on 127.0.0.1.

    `password` protects the data nodes (`requirepass`, `masterauth`, `sentinel auth-pass`); `sentinel_password`
    the sentinels themselves (`requirepass` in their config, and `sentinel sentinel-pass` to talk to each other).

    `down_after_ms` stays well above the sentinels' 1 s PING period: at 1000, a sentinel whose new link to a just
    promoted master had not answered its first PING within the second declared that master down, and the set
    failed over a second time, back to the killed node restarted as a replica (seen 1 run in 6 on a busy machine).
    """

    def __init__(
        self,
        root: Path,
        *,
        service_name: str = "llmq",
        password: str | None = None,
        sentinel_password: str | None = None,
        down_after_ms: int = 3000,
        failover_timeout_ms: int = 5000,
        tls: TLSFiles | None = None,
    ) -> None:
        self.service_name = service_name
        self.tls = tls
        self.password = password
        self.sentinel_password = sentinel_password
        master_port, replica_port, *sentinel_ports = node_ports(5)
        auth = [f"requirepass {conf_quote(password)}", f"masterauth {conf_quote(password)}"] if password else []
        self.data_nodes = [
            RedisNode(root / "master", master_port, [*DATA_NODE_CONF, *auth], password=password, tls=tls),
            RedisNode(
                root / "replica",
                replica_port,
                [*DATA_NODE_CONF, *auth, f"replicaof {HOST} {master_port}"],
                password=password,
                tls=tls,
            ),
        ]
        conf = self._sentinel_conf(master_port, down_after_ms, failover_timeout_ms)
        self.sentinels = [
            RedisNode(root / f"sentinel{i}", port, conf, sentinel=True, password=sentinel_password, tls=tls)
            for i, port in enumerate(sentinel_ports)
        ]
        self.nodes = [*self.data_nodes, *self.sentinels]

    def _sentinel_conf(self, master_port: int, down_after_ms: int, failover_timeout_ms: int) -> list[str]:
        name = self.service_name
        conf = [
            "sentinel resolve-hostnames no",
            f"sentinel monitor {name} {HOST} {master_port} 2",
            f"sentinel down-after-milliseconds {name} {down_after_ms}",
            f"sentinel failover-timeout {name} {failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
        ]
        if self.password:
            conf.append(f"sentinel auth-pass {name} {conf_quote(self.password)}")
        if self.sentinel_password:
            secret = conf_quote(self.sentinel_password)
            conf += [f"requirepass {secret}", f"sentinel sentinel-pass {secret}"]
        return conf

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [node.address for node in self.sentinels]

    @property
    def url(self) -> str:
        """`redis+sentinel://[:password@]h1:p1,h2:p2,h3:p3/<service>[?sentinel_password=...]`."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinel_addresses)
        query = f"?sentinel_password={quote(self.sentinel_password, safe='')}" if self.sentinel_password else ""
        return f"{'redis' if self.tls is None else 'rediss'}+sentinel://{auth}{hosts}/{self.service_name}{query}"

    def _start(self) -> None:
        for node in self.data_nodes:
            node.start()
        for node in self.data_nodes:
            node.wait_ready()
        # Linked before the sentinels' first INFO of the master, or they learn of the replica only at the next (10 s).
        master = self.data_nodes[0].address
        wait_until(lambda: self._linked(master), timeout=10, what="replica linked", nodes=self.data_nodes)
        for node in self.sentinels:
            node.start()
        for node in self.sentinels:
            node.wait_ready()
        self.wait_healthy(timeout=20)

    def wait_healthy(self, timeout: float = 20) -> tuple[str, int]:
        """Until every running replica is linked to the master the sentinels name, and every sentinel knows the
        other two and lists those replicas as healthy; returns the master's address.

        After a failover the sentinels turn the old master into a replica only ~10 s later (they first wait for
        it to report its role for a while), so wait for this before failing over a second time."""
        what = "sentinels watching master and replicas"
        return wait_until(self._watching, timeout=timeout, what=what, nodes=self.nodes)

    def _watching(self) -> tuple[str, int]:
        address = self.master_address()
        replicas = self._linked(address)
        for sentinel in self.sentinels:
            state = sentinel.client().sentinel_master(self.service_name)
            assert isinstance(state, dict)
            if state["flags"] != "master" or state["num-other-sentinels"] != len(self.sentinels) - 1:
                raise NotYet(f"{sentinel!r}: flags {state['flags']}, {state['num-other-sentinels']} other sentinels")
            listed = {r["port"] for r in sentinel.client().sentinel_slaves(self.service_name) if r["flags"] == "slave"}
            if not {node.port for node in replicas} <= listed:
                raise NotYet(f"{sentinel!r} lists healthy replicas {sorted(listed)}")
        return address

    def _linked(self, master: tuple[str, int]) -> list[RedisNode]:
        """The running data nodes other than `master`, once each is its replica with the link up."""
        replicas = [node for node in self.data_nodes if node.alive and node.port != master[1]]
        for node in replicas:
            info = node.client().info("replication")
            if (info["role"], info.get("master_port"), info.get("master_link_status")) != ("slave", master[1], "up"):
                raise NotYet(f"{node!r} is not linked to {master}: {info['role']} {info.get('master_link_status')}")
        return replicas

    def master_address(self) -> tuple[str, int]:
        """The master as the running sentinels name it (SENTINEL GET-MASTER-ADDR-BY-NAME); they must agree."""
        answers = set()
        for sentinel in self.sentinels:
            if sentinel.alive:
                reply = sentinel.execute("SENTINEL GET-MASTER-ADDR-BY-NAME", self.service_name)
                if not isinstance(reply, tuple):
                    raise NotYet(f"{sentinel!r} names no master for {self.service_name}: {reply!r}")
                answers.add((str(reply[0]), int(reply[1])))
        if len(answers) != 1:
            raise NotYet(f"sentinels disagree on the master: {sorted(answers)}")
        return answers.pop()

    def master(self) -> RedisNode:
        """The data node the sentinels name master."""
        return self.node_at(self.master_address()[1])

    def failover(self, timeout: float = 20, *, settle: bool = False) -> tuple[str, int]:
        """SENTINEL FAILOVER, then wait until the sentinels name another master that takes writes; returns it.

        The old master still calls itself master, and takes writes on connections it already has, until the
        sentinels turn it into a replica ~10 s later; `settle` also waits for that (see `wait_healthy`)."""
        old = self.master_address()
        self.sentinels[0].execute("SENTINEL", "FAILOVER", self.service_name)
        new = self.wait_for_new_master(old, timeout)
        if settle:
            self.wait_healthy(timeout)
        return new

    def kill_master(self) -> tuple[str, int]:
        """SIGKILL the current master; returns its address for `wait_for_new_master`."""
        old = self.master_address()
        self.node_at(old[1]).kill()
        return old

    def wait_for_new_master(self, old: tuple[str, int], timeout: float = 20) -> tuple[str, int]:
        """Until every running sentinel names a master other than `old`, and that node takes a write."""

        def promoted() -> tuple[str, int]:
            address = self.master_address()
            if address == old:
                raise NotYet(f"sentinels still name {old}")
            with self.node_at(address[1]).client().pipeline(transaction=True) as pipe:
                pipe.set("__topology_probe__", 1)  # a replica answers READONLY
                pipe.delete("__topology_probe__")
                pipe.execute()
            return address

        return wait_until(promoted, timeout=timeout, what=f"a new master instead of {old}", nodes=self.nodes)

    def restart(self, node: RedisNode, timeout: float = 20) -> RedisNode:
        """Start a killed data node again on its port, and wait until the sentinels have made it a replica."""
        node.start().wait_ready()
        self.wait_healthy(timeout)
        return node

    def close(self) -> None:
        # Sentinels first, so none acts on the data nodes going away.
        stop_all(self.sentinels)
        stop_all(self.data_nodes)
