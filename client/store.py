"""The Redis data model of a queue, in one place: key names, the fence hash's fields, every Lua script, and
the status query. Both sides import it (the worker too), so it depends on nothing but the protocol module.

Keys of a queue share the hash tag `{<prefix>:<queue>}` (one Redis Cluster slot); `Keys` names them all.
Scripts are registered once per connection (`Scripts.register`), as streaQ keeps its scripts in one module:

| script | run by | what it does |
| --- | --- | --- |
| `SUBMIT` | client | idempotency marker + queue limit + XADD, atomically |
| `RENEW` | worker | renews the leases of the entries the worker still owns |
| `HAND_BACK` | worker | makes owned entries claimable at once; counts hand-backs and engine failures |
| `PUBLISH` | worker | one flush of result events: fenced, idempotent, acknowledging, isolated per request |
| `READ` | worker | new requests from the lanes in order, as many as the free slots, each lane's share first |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from client.errors import MalformedEntry
from client.protocol import (
    DEFAULT_PREFIX,
    LANES,
    Lane,
    WorkerInfo,
    decode_request,
    decode_worker,
    is_valid_name,
    ms_now,
)

CONSUMER_GROUP = "workers"
WAKE_NOTICE = b"r"  # field of a wake stream entry: the result keys a worker just wrote to, space-separated
WAKE_MAXLEN = 1000  # entries a wake stream keeps (about); a client further behind is covered by its sweep
WAKE_TTL_S = 600


@dataclass(frozen=True)
class Keys:
    """Key names of one queue; all share the hash tag `{<prefix>:<queue>}`, so a queue is one shard."""

    queue: str
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        for what, name in (("queue", self.queue), ("prefix", self.prefix)):
            if not is_valid_name(name):
                raise ValueError(f"{what} {name!r} must be 1-128 characters of [A-Za-z0-9._:-]")

    @property
    def tag(self) -> str:
        return f"{{{self.prefix}:{self.queue}}}"

    @property
    def requests(self) -> str:
        """Stream of the default lane's unfinished requests, read by consumer group `CONSUMER_GROUP`."""
        return f"{self.tag}:requests"

    def lane(self, lane: str) -> str:
        """Stream of one lane's unfinished requests (`LANES`); the default lane's is `requests`, as before lanes."""
        return self.requests if lane == "default" else f"{self.requests}:{lane}"

    @property
    def lanes(self) -> dict[Lane, str]:
        """Every lane's request stream, highest lane first."""
        return {lane: self.lane(lane) for lane in LANES}

    @property
    def fleet_rate(self) -> str:
        """Tokens per second the fleet generated lately, as the workers' heartbeats measure it (with a TTL)."""
        return f"{self.tag}:tokens_per_s"

    @property
    def dead(self) -> str:
        """Stream of dead letters."""
        return f"{self.tag}:dead"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel; each message is the id of a request to cancel."""
        return f"{self.tag}:cancel"

    @property
    def workers(self) -> str:
        """Hash: worker id -> msgpack `WorkerInfo`."""
        return f"{self.tag}:workers"

    def result(self, request_id: str) -> str:
        """Stream of one request's events; every write refreshes its TTL."""
        return f"{self.tag}:result:{request_id}"

    def cancel(self, request_id: str) -> str:
        """Cancel mark (with a TTL), for a worker that missed the pub/sub message."""
        return f"{self.tag}:cancel:{request_id}"

    def submitted(self, request_id: str) -> str:
        """Idempotency marker set by the submit script; lives for the request's `result_ttl`."""
        return f"{self.tag}:id:{request_id}"

    def reply(self, name: str) -> str:
        """A shared stream of completions (`Completion`) of the requests submitted with `reply_to=name`."""
        return f"{self.tag}:reply:{name}"

    def wake(self, client_id: str) -> str:
        """A client's private stream: appending to it ends the client's blocking read of result streams."""
        return f"{self.tag}:wake:{client_id}"

    def fence(self, request_id: str) -> str:
        """Workers' hash of one request: the `Fence` fields."""
        return f"{self.tag}:fence:{request_id}"


class Fence:
    """Fields of a request's fence hash (`Keys.fence`), written by workers only, expiring with the request."""

    ATTEMPT = "a"  # raised by every claim; a write is accepted only from the current attempt
    WRITTEN = "n"  # tokens whose events are written: a retried write below it is skipped
    HANDED_BACK = "h"  # hand-backs (drains, engine failures): forgiven up to `max_hand_backs` deliveries
    ENGINE_FAILURES = "f"  # engine failures the request was implicated in: quarantined at `max_engine_failures`
    STARTED = "s"  # epoch ms the first attempt started (timings after a resume describe the whole request)
    PREEMPTED = "p"  # hand-backs to make room for an interactive request: all forgiven, limited by `max_preemptions`


# --- scripts ------------------------------------------------------------------------------------

# The client's submit: an atomic check-and-add. KEYS: the idempotency marker, the lane's request stream; ARGV:
# the entry, the lane's limit (0 = none), the result TTL, the client id (`NOTIFY_FIELD`). Answers 1 = added,
# 0 = duplicate id (nothing added), or `SUBMIT_FULL` (a full backlog: nothing added, not even the marker).
# Workers XDEL finished requests, so XLEN of the stream is the lane's backlog.
SUBMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local limit = tonumber(ARGV[2])
if limit > 0 and redis.call('XLEN', KEYS[2]) >= limit then
  return -1
end
redis.call('SET', KEYS[1], 1, 'EX', ARGV[3])
if ARGV[4] then
  redis.call('XADD', KEYS[2], '*', 'm', ARGV[1], 'n', ARGV[4])
else
  redis.call('XADD', KEYS[2], '*', 'm', ARGV[1])
end
return 1
"""
SUBMIT_FULL = -1


# Lease renewal: resets the idle time of the entries this consumer still owns. KEYS: the request stream; ARGV:
# group, consumer, then the entry ids. Returns the ids it no longer owns (claimed by another, or acknowledged).
RENEW = """
local lost = {}
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if entry[1] and entry[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# Hands back only entries this consumer still owns: sets their idle time past any lease, so any worker's next
# XAUTOCLAIM takes them, and counts the hand-back in the request's fence hash (`h`), so a request handed back
# at every rolling restart does not run into the delivery limit; after an engine failure that implicated the
# request it also counts that (`f`), which quarantines a request that keeps killing engines; a preemption counts
# `p` instead of `h`. KEYS: request stream, then one fence hash per entry; ARGV: group, consumer, idle ms, the
# reason (`HAND_BACK_DRAIN`, `HAND_BACK_ENGINE_FAILURE`, `HAND_BACK_PREEMPTION`), then the entry ids.
# The fence writes are per request (pcall): a key Redis refuses fails that count, never the other hand-backs.
HAND_BACK = """
local handed = 0
for i = 5, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if entry[1] and entry[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    local fence = KEYS[i - 3]
    if redis.pcall('EXISTS', fence) == 1 then
      if ARGV[4] == '2' then
        redis.pcall('HINCRBY', fence, 'p', 1)
      else
        redis.pcall('HINCRBY', fence, 'h', 1)
      end
      if ARGV[4] == '1' then
        redis.pcall('HINCRBY', fence, 'f', 1)
      end
    end
    handed = handed + 1
  end
end
return handed
"""


HAND_BACK_DRAIN, HAND_BACK_ENGINE_FAILURE, HAND_BACK_PREEMPTION = 0, 1, 2

# A worker's read, lanes in order: per step (lane, wanted) an XREADGROUP of at most `wanted` new entries, while
# `free` slots last, so a full worker takes nothing and the steps decide the lanes' shares. KEYS: the lanes'
# request streams; ARGV: group, consumer, free, then pairs of (1-based lane index, wanted). Returns the entries
# read as {lane index, id, fields} and, when there were none, each lane's last entry id: an XREAD BLOCK from
# those ids wakes on the next entry without missing one added meanwhile.
READ = """
local free, read = tonumber(ARGV[3]), {}
for i = 4, #ARGV - 1, 2 do
  local lane, wanted = tonumber(ARGV[i]), math.min(tonumber(ARGV[i + 1]), free)
  if wanted > 0 then
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', wanted, 'STREAMS', KEYS[lane], '>')
    if reply then
      for _, entry in ipairs(reply[1][2]) do
        read[#read + 1] = {lane, entry[1], entry[2]}
      end
      free = free - #reply[1][2]
    end
  end
end
local last = {}
if #read == 0 then
  for lane = 1, #KEYS do
    local newest = redis.call('XREVRANGE', KEYS[lane], '+', '-', 'COUNT', 1)
    last[lane] = newest[1] and newest[1][1] or '0-0'
  end
end
return {read, last}
"""


# One call per flush, whatever it carries: packing and parsing a command per event was most of a busy
# worker's time. KEYS: per event its request stream (its lane's), result stream, fence hash, reply stream and
# its client's wake stream (the result stream again for none). ARGV: the group, the reply streams' MAXLEN, the wake
# streams' MAXLEN and TTL, then per event: attempt
# ('' = unfenced), ttl, event ('' = none: acknowledge only), seq, size, entry id to acknowledge ('' = none),
# completion for the reply stream ('' = none; appended with the event, so exactly when the event is).
# Returns per event 1 (written or already there), 0 (fenced), or the error Redis gave for that event's keys
# alone (pcall): one request's broken key fails that request, never the batch. An error that concerns the whole
# server (out of memory, read-only replica, loading...) fails the call instead, so the batch stays queued.
# Each wake stream then gets one notice naming the result streams written for its client (`client._mux`).
PUBLISH = """
local function publish(stream, result, fence, reply, attempt, ttl, event, seq, size, entry, completion)
  local ok, write = 1, event ~= ''
  if attempt ~= '' then
    local current = redis.call('HMGET', fence, 'a', 'n')
    if current[1] ~= attempt then
      ok, write, entry = 0, false, ''
    else
      write = write and tonumber(seq) >= tonumber(current[2] or '0')
      if write then
        redis.call('HSET', fence, 'n', tonumber(seq) + tonumber(size))
      end
      redis.call('EXPIRE', fence, ttl)
    end
  end
  if write then
    redis.call('XADD', result, '*', 'm', event)
    redis.call('EXPIRE', result, ttl)
    if completion ~= '' then
      redis.call('XADD', reply, 'MAXLEN', '~', ARGV[2], '*', 'm', completion)
    end
  end
  if entry ~= '' then
    redis.call('XACK', stream, ARGV[1], entry)
    redis.call('XDEL', stream, entry)
  end
  return ok
end
local server_wide = {'OOM', 'READONLY', 'LOADING', 'BUSY', 'MASTERDOWN', 'NOREPLICAS', 'MISCONF', 'CLUSTERDOWN'}
local written, refused, notices = {}, {}, {}
for i = 0, #KEYS / 5 - 1 do
  local result, a = KEYS[2 + 5 * i], 5 + 7 * i
  local outcome = refused[result]  -- a request refused once: its later events (and its ack) are not tried
  if not outcome then
    local done
    done, outcome = pcall(publish, KEYS[1 + 5 * i], result, KEYS[3 + 5 * i], KEYS[4 + 5 * i],
      ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6])
    if not done then
      local message = type(outcome) == 'table' and outcome.err or tostring(outcome)
      for _, prefix in ipairs(server_wide) do
        if string.sub(message, 1, #prefix) == prefix then
          return redis.error_reply(message)
        end
      end
      outcome = message
      refused[result] = message
    end
  end
  local wake = KEYS[5 + 5 * i]
  if outcome == 1 and wake ~= result then
    notices[wake] = notices[wake] or {}
    table.insert(notices[wake], result)
  end
  written[i + 1] = outcome
end
for wake, results in pairs(notices) do  -- a notice is a hint (the client sweeps too): a refused one is dropped
  pcall(function()
    redis.call('XADD', wake, 'MAXLEN', '~', ARGV[3], '*', 'r', table.concat(results, ' '))
    redis.call('EXPIRE', wake, ARGV[4])
  end)
end
return written
"""


@dataclass(frozen=True)
class Scripts:
    """Every script, registered on one Redis connection (sync or asyncio)."""

    submit: Any
    renew: Any
    hand_back: Any
    publish: Any
    read: Any

    @classmethod
    def register(cls, redis: Any) -> Scripts:
        return cls(*(redis.register_script(body) for body in (SUBMIT, RENEW, HAND_BACK, PUBLISH, READ)))


# --- status -------------------------------------------------------------------------------------


BACKLOG_SAMPLE = 100  # entries per lane whose size is averaged for `LaneStatus.backlog_tokens`


@dataclass(frozen=True)
class LaneStatus:
    """One lane of a queue: its stream's depth (waiting + running), the consumer group's pending (delivered,
    unacknowledged) and lag (undelivered; 0 while workers take all they can batch, so not a scaling signal on
    its own), and the backlog: requests, tokens (prompt + `max_new_tokens`, estimated from the oldest
    `BACKLOG_SAMPLE` entries; a prompt given as text counts 4 bytes a token) and seconds at the fleet's rate."""

    lane: str
    depth: int
    pending: int | None
    lag: int | None
    oldest_pending_age_s: float | None
    backlog_tokens: int
    backlog_seconds: float | None


@dataclass(frozen=True)
class QueueStatus:
    """A queue at a glance, summed over its lanes (`lanes` has each); `pending`/`lag` are None until a worker has
    created the consumer group."""

    queue: str
    depth: int
    pending: int | None
    lag: int | None
    dead: int
    workers: list[WorkerInfo] = field(default_factory=list)
    oldest_pending_age_s: float | None = None  # how long the oldest unacknowledged request has been delivered
    stale_workers: list[str] = field(default_factory=list)  # heartbeats older than `stale_after_s`, or unreadable
    lanes: list[LaneStatus] = field(default_factory=list)  # highest lane first
    tokens_per_s: float | None = None  # the fleet's recent generation rate, as the workers measure it

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "workers": [w.model_dump() for w in self.workers]}


def _group_stats(groups: Any, group: bytes) -> tuple[int | None, int | None]:
    if isinstance(groups, Exception):  # no stream yet: XINFO answers an error
        return None, None
    for info in groups:
        name = info.get("name")
        if (name.encode() if isinstance(name, str) else name) == group:
            return info.get("pending"), info.get("lag")
    return None, None


_PER_LANE = 4  # replies per lane in `queue_status_commands`


def queue_status_commands(pipe: Any, keys: Keys) -> None:
    """Queue on a pipeline the reads `status_from_replies` expects, in its order."""
    pipe.xlen(keys.dead)
    pipe.hgetall(keys.workers)
    pipe.get(keys.fleet_rate)
    for stream in keys.lanes.values():
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        pipe.xpending(stream, CONSUMER_GROUP)
        pipe.xrange(stream, count=BACKLOG_SAMPLE)


def queue_cancel_commands(pipe: Any, keys: Keys, request_id: str, ttl: int, *, sharded: bool) -> None:
    """Queue on a pipeline the cancel mark (for a worker that missed the message) and the message: `sharded` on a
    Redis Cluster (SPUBLISH reaches the channel's own shard; PUBLISH would be copied to every node)."""
    pipe.set(keys.cancel(request_id), 1, ex=ttl)
    (pipe.spublish if sharded else pipe.publish)(keys.cancel_channel, request_id)


def status_from_replies(queue: str, replies: list[Any], stale_after_s: float) -> QueueStatus:
    """Build `QueueStatus` from the replies to `queue_status_commands`."""
    dead, workers_hash, rate = replies[:3]
    for reply in (dead, workers_hash):
        if isinstance(reply, Exception):
            raise reply
    tokens_per_s = float(rate) if rate and not isinstance(rate, Exception) else None
    lanes = [
        _lane_status(lane, replies[3 + _PER_LANE * i : 3 + _PER_LANE * (i + 1)], tokens_per_s)
        for i, lane in enumerate(LANES)
    ]
    oldest = ms_now() - int(stale_after_s * 1000)
    workers, stale = [], []
    for worker_id, raw in workers_hash.items():
        try:
            info = decode_worker(raw)
        except MalformedEntry:
            info = None
        if info is not None and info.heartbeat >= oldest:
            workers.append(info)
        else:
            stale.append(worker_id.decode() if isinstance(worker_id, bytes) else worker_id)
    workers.sort(key=lambda w: w.id)
    known = [lane for lane in lanes if lane.pending is not None]
    ages = [lane.oldest_pending_age_s for lane in lanes if lane.oldest_pending_age_s is not None]
    return QueueStatus(
        queue=queue,
        depth=sum(lane.depth for lane in lanes),
        pending=sum(lane.pending or 0 for lane in known) if known else None,
        lag=sum(lane.lag or 0 for lane in known) if known else None,
        dead=dead,
        workers=workers,
        oldest_pending_age_s=max(ages, default=None),
        stale_workers=sorted(stale),
        lanes=lanes,
        tokens_per_s=tokens_per_s,
    )


def _lane_status(lane: str, replies: list[Any], tokens_per_s: float | None) -> LaneStatus:
    depth, groups, pending_summary, sample = replies
    if isinstance(depth, Exception):
        raise depth
    pending, lag = _group_stats(groups, CONSUMER_GROUP.encode())
    sizes = [] if isinstance(sample, Exception) else [_entry_tokens(fields) for _, fields in sample]
    known = [size for size in sizes if size is not None]
    tokens = round(depth * sum(known) / len(known)) if known else 0
    return LaneStatus(
        lane=lane,
        depth=depth,
        pending=pending,
        lag=lag,
        oldest_pending_age_s=_oldest_pending_age_s(pending_summary),
        backlog_tokens=tokens,
        backlog_seconds=tokens / tokens_per_s if tokens_per_s else None,
    )


def _entry_tokens(fields: dict[bytes, bytes]) -> int | None:
    try:
        return decode_request(fields.get(b"m", b"")).estimated_tokens()
    except (MalformedEntry, ValueError):
        return None


def _oldest_pending_age_s(summary: Any) -> float | None:
    """Age of the oldest delivered, unacknowledged entry, from its id's millisecond part."""
    if isinstance(summary, Exception) or not summary or not summary.get("min"):
        return None
    oldest = summary["min"].decode() if isinstance(summary["min"], bytes) else summary["min"]
    return max(0.0, (ms_now() - int(oldest.split("-")[0])) / 1000)
