"""Sans-I/O core shared by `AsyncClient` and `Client`: everything but the Redis calls.

Like httpx's `BaseClient`, this builds requests, holds configuration, accumulates result events and
decides when to wait, retry or stop; `aio.py` and `sync.py` only perform the calls it asks for.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from redis.backoff import ExponentialWithJitterBackoff

from client import tracing
from client.affinity import affinity_key
from client.backoff import Backoff
from client.connection import connection_options, redact_url
from client.errors import (
    Cancelled,
    ClientClosed,
    InvalidRequest,
    LLMQError,
    MalformedEntry,
    QueueFull,
    ResultTimeout,
    TenantQuotaExceeded,
)
from client.protocol import (
    DEFAULT_TENANT,
    ENTRY_FIELD,
    LANES,
    MAX_EPOCH_MS,
    MAX_N,
    MAX_RESULT_TTL_S,
    PROTOCOL_VERSION,
    DoneEvent,
    ErrorEvent,
    FinishReason,
    GenerateRequest,
    PromptEvent,
    RequestLimits,
    Timings,
    TokensEvent,
    Usage,
    choice_ids,
    decode_event,
    encode,
    error_from_event,
    is_valid_name,
    ms_now,
    parse_request,
    total_usage,
)
from client.scripts import ScriptCall, Submit, SubmitOutcome
from client.store import Keys, Scripts, partition_of
from client.tool_calls import SYNTAXES, ToolCall, ToolCallDelta, ToolCallParser

log = logging.getLogger("llmq.client")
# A library logs, the application decides where to: without this, logging's last resort printed the retry warnings
# on stderr of every program (`llmq` too) that had not configured logging.
log.addHandler(logging.NullHandler())

DEFAULT_URL = "redis://localhost:6379/0"
DEFAULT_MAX_CONNECTIONS = 4  # for all of a client's work: one reader, submits, cancels
POOL_WAIT_S = 60.0  # how long a call waits for a free connection before it fails
# A pooled connection that Redis closed (a restart, a failover, an idle timeout) fails the next command sent on
# it. Each command is retried on a new connection, up to 3 times 0.1-0.25 s apart, so that a Redis which came
# back serves it while one that is down still fails it within a second. Retrying is safe: submits are idempotent
# by request id (the `SUBMIT` script's marker), the other writes are idempotent too, and reads are reads.
RETRIES = 3
RETRY_BACKOFF_S = (0.05, 0.25)  # base and cap of the exponential backoff


MAX_FAILOVER_TIMEOUT_S = 3600.0
MAX_REPLICAS = 64  # a WAIT for more replicas than this waits for ones no deployment has


def _is_seconds(value: object, most: float) -> bool:
    """A number of seconds in [0, most]: not a bool, and finite (an int too large for a float is not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return 0 <= float(value) <= most
    except OverflowError:
        return False


def pool_kwargs(redis_kwargs: dict[str, Any], retry_type: Callable[..., Any]) -> dict[str, Any]:
    """Keyword arguments for `client.connection.open_async`/`open_sync`: a small bounded pool whose callers wait
    for a free connection, each command retried on a lost connection (`retry_type`: redis-py's `Retry`, sync or
    asyncio; a pool built this way has none otherwise)."""
    base, cap = RETRY_BACKOFF_S
    retry = retry_type(ExponentialWithJitterBackoff(cap=cap, base=base), RETRIES)
    return {"max_connections": DEFAULT_MAX_CONNECTIONS, "timeout": POOL_WAIT_S, "retry": retry, **redis_kwargs}


def deadline_ms(deadline: float | timedelta | datetime | None, now_ms: int) -> int | None:
    """Epoch ms from seconds-from-now, a timedelta, or an absolute datetime (naive = local time)."""
    if deadline is None:
        return None
    if isinstance(deadline, datetime):
        return int(deadline.timestamp() * 1000)
    seconds = deadline.total_seconds() if isinstance(deadline, timedelta) else deadline
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"deadline must be seconds, a timedelta or a datetime, not {type(deadline).__name__}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidRequest(f"a relative deadline must be a positive number of seconds, got {seconds}")
    if seconds * 1000 > MAX_EPOCH_MS - now_ms:
        raise InvalidRequest(f"deadline: {seconds} s from now is past the largest deadline (epoch ms {MAX_EPOCH_MS})")
    return now_ms + math.ceil(seconds * 1000)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and text, and the most likely alternatives if asked, as (id, log-probability,
    text): a generated token's, or a prompt token's given the tokens before it. A token's text is its own
    decoding: part of a multi-byte character is U+FFFD."""

    token_id: int
    logprob: float
    text: str = ""
    top: list[tuple[int, float, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    """New output: `seq` is the index of its first token in the whole output; `logprobs` (one per token) when
    the request asked for them. A request with `prompt_logprobs` first gets one delta without tokens that
    carries its prompt's ids, texts and scores (as `Result.prompt_token_ids`, `prompt_tokens` and
    `prompt_logprobs`). With tools, `text` is the answer's content and `tool_calls` the calls' new output (a
    call's first delta names it, later ones add to its arguments); content held back while it might have opened
    a call comes, if it did not, in a last delta without tokens."""

    text: str
    token_ids: list[int]
    seq: int
    logprobs: list[TokenLogprob] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_tokens: list[str] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    tool_calls: list[ToolCallDelta] | None = None
    index: int = 0  # which choice it belongs to, with `submit(n=...)`


@dataclass(frozen=True)
class Result:
    """A request's output. `text` is what the model answered; with tools, its content without the calls, which
    are `tool_calls` (None for a request without tools, or with `tool_choice` `none`)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    # With `prompt_logprobs`: per prompt token its id, its text and its score given the tokens before it (the
    # first's None: nothing predicts it), as vLLM's and OpenAI's `echo` return them.
    prompt_token_ids: list[int] | None = None
    prompt_tokens: list[str] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    tool_calls: list[ToolCall] | None = None
    # With `submit(n=...)`: every choice's own result, in order (the fields above are the first's, but `request_id`,
    # the call's, and `usage`, the prompt once and the completions of all, as OpenAI counts them).
    choices: list[Result] | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (for `llmq submit --json`)."""
        return {**asdict(self), "usage": self.usage.model_dump(), "timings": self.timings.model_dump()}


def choices_result(request_id: str, results: list[Result]) -> Result:
    """The `Result` of a call's `n` choices (`Result.choices`)."""
    return replace(results[0], request_id=request_id, usage=total_usage([r.usage for r in results]), choices=results)


@dataclass(frozen=True)
class Outcome:
    """One request of `submit_many`: its position in the input, its id, and its result or its typed error
    (`InvalidRequest` for a request refused before submitting, `RequestFailed`, `Cancelled`, `ResultTimeout`)."""

    index: int
    request_id: str | None
    result: Result | None = None
    error: LLMQError | None = None


def submit_arguments_error(options: object, submit: Callable[..., Any]) -> InvalidRequest | None:
    """Why `options` cannot be the keyword arguments of `submit` (a client class's method: not a mapping, or names
    it does not take), or None. `submit_many` answers such a request with this error as its outcome and goes on."""
    if not isinstance(options, Mapping):
        kind = type(options).__name__
        return InvalidRequest(f"a request must be a mapping of submit's keyword arguments, not {kind}")
    taken = _keyword_names(submit)
    unknown = [name for name in options if name not in taken]
    if unknown:
        return InvalidRequest(f"submit() takes no argument {', '.join(repr(name) for name in unknown)}")
    return None


@functools.cache
def _keyword_names(method: Callable[..., Any]) -> frozenset[str]:
    """A method's parameter names but `self`, read once per method instead of once per request."""
    return frozenset(inspect.signature(method).parameters) - {"self"}


QUEUE_FULL_BACKOFF_S = (0.05, 2.0)  # submit_many waits, doubling, while the queue is full


def queue_full_delays() -> Iterator[float]:
    """Seconds to wait before each retry of a submit refused with `QueueFull`: doubling, capped, jittered
    (`client.backoff`), unending."""
    backoff = Backoff(*QUEUE_FULL_BACKOFF_S)
    while True:
        yield backoff.next()


class ResultBuilder:
    """Accumulates one request's events into deltas and a `Result`, dropping what was seen by `seq`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self._texts: list[str] = []
        self._text_len = 0
        # Token count and text length after each chunk, as two lists of ints: nothing per event for the garbage
        # collector to track (a client awaiting 10,000 jobs pays for every tracked object in its pauses).
        self._bound_tokens: list[int] = [0]
        self._bound_chars: list[int] = [0]
        self.done: DoneEvent | None = None
        self.error: ErrorEvent | None = None
        self.prompt: PromptEvent | None = None
        self.tools: ToolCallParser | None = None  # from the first chunk that names a tool syntax
        self._content: list[str] = []  # with tools: the text without the calls

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    def feed(self, event: PromptEvent | TokensEvent | DoneEvent | ErrorEvent) -> Delta | None:
        """Take one event; return the new output it brings, if any."""
        if self.finished:  # only a stale writer adds after the terminal event
            return None
        if isinstance(event, TokensEvent):
            return self._tokens(event)
        if isinstance(event, PromptEvent):
            if self.prompt is not None:  # written again by an attempt restarted before its first token
                return None
            self.prompt = event
            return Delta(text="", token_ids=[], seq=len(self.token_ids), **self._prompt_fields())
        if isinstance(event, DoneEvent):
            self.done = event
            held = self.tools.finish() if self.tools is not None else ""
            if held:
                self._content.append(held)
                return Delta(text=held, token_ids=[], seq=len(self.token_ids))
        else:
            self.error = event
        return None

    def _tokens(self, event: TokensEvent) -> Delta | None:
        seen = len(self.token_ids)
        if event.seq > seen:
            raise MalformedEntry(f"gap in the result stream: expected seq <= {seen}, got {event.seq}", self.request_id)
        skip = seen - event.seq
        if skip >= len(event.ids):
            return None
        text = event.text if skip == 0 else self._unseen_text(event, skip)
        ids = event.ids[skip:]
        logprobs = None
        if event.logprobs is not None and len(event.logprobs) == len(event.ids):
            logprobs = [
                TokenLogprob(token, lp, text, [(alt, alt_lp, alt_text) for alt, alt_lp, alt_text in top])
                for token, (lp, text, top) in zip(ids, event.logprobs[skip:], strict=True)
            ]
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        self.token_ids.extend(ids)
        self._texts.append(text)
        self._text_len += len(text)
        self._bound_tokens.append(len(self.token_ids))
        self._bound_chars.append(self._text_len)
        if event.tool_syntax is not None and len(self._texts) == 1:  # every chunk of a tool request names it
            self.tools = self._parser(event.tool_syntax)
        if self.tools is None:
            return Delta(text=text, token_ids=ids, seq=seen, logprobs=logprobs)
        content, calls = self.tools.feed(text)
        self._content.append(content)
        return Delta(text=content, token_ids=ids, seq=seen, logprobs=logprobs, tool_calls=calls)

    def _parser(self, syntax: str) -> ToolCallParser | None:
        if syntax not in SYNTAXES:  # a newer worker's: its text comes as it is, calls included
            log.warning("request %s: unknown tool syntax %r, calls are left in the text", self.request_id, syntax)
            return None
        return ToolCallParser(SYNTAXES[syntax], self.request_id)

    def _unseen_text(self, event: TokensEvent, skip: int) -> str:
        """Text of a partly seen chunk beyond what we hold.

        Text cannot be split by token, so align it: the chunk's text starts with the tail of ours, from
        an offset inside our accepted chunk holding token `seq` (exactly its start if `seq` is one of our
        chunk boundaries). Take the longest such overlap: an unlucky repetition may lose characters, but
        text is never shown twice. A chunk whose seen tokens differ from ours, or whose text lines up
        nowhere, comes from a stale writer: keep its new tokens, drop its text.
        """
        text = self.text
        at = bisect.bisect_right(self._bound_tokens, event.seq)
        count, lo = self._bound_tokens[at - 1], self._bound_chars[at - 1]
        hi = lo if count == event.seq else self._bound_chars[at]
        if event.ids[:skip] == self.token_ids[event.seq :]:
            for start in range(lo, hi + 1):
                if event.text.startswith(text[start:]):
                    return event.text[len(text) - start :]
        log.warning("request %s: dropped the text of a conflicting chunk at seq %d", self.request_id, event.seq)
        return ""

    @property
    def text(self) -> str:
        return "".join(self._texts)

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise error_from_event(self.error, self.request_id)

    def outcome(self, *, raise_cancelled: bool) -> Result:
        """The final `Result`, or the typed error for an `error` event (or a cancel, if asked)."""
        self.raise_for_error()
        assert self.done is not None, "outcome() before the terminal event"
        result = Result(
            request_id=self.request_id,
            text=self.text if self.tools is None else "".join(self._content),
            token_ids=list(self.token_ids),
            finish_reason=self.done.finish_reason,
            usage=self.done.usage,
            timings=self.done.timings,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            **self._prompt_fields(),
            tool_calls=None if self.tools is None else self.tools.tool_calls(),
        )
        if raise_cancelled and result.finish_reason == "cancelled":
            raise Cancelled(result)
        return result

    def _prompt_fields(self) -> dict[str, Any]:
        prompt = self.prompt
        if prompt is None:
            return {}
        return {
            "prompt_token_ids": list(prompt.ids),
            "prompt_tokens": list(prompt.texts),
            "prompt_logprobs": _prompt_logprobs(prompt),
        }


def _prompt_logprobs(event: PromptEvent) -> list[TokenLogprob | None]:
    return [
        None
        if entry is None
        else TokenLogprob(token, entry[0], text, [(alt, lp, alt_text) for alt, lp, alt_text in entry[1]])
        for token, text, entry in zip(event.ids, event.texts, event.logprobs, strict=True)
    ]


class ResultReader:
    """Read state of one result stream: where the next read starts, what was seen, and the caller's time."""

    def __init__(self, request_id: str, key: str) -> None:
        self.key = key
        self.last_id: bytes | str = b"0-0"
        self.builder = ResultBuilder(request_id)

    @property
    def request_id(self) -> str:
        return self.builder.request_id

    def remaining_s(self, started: float, timeout: float | None) -> float | None:
        """Seconds left of the caller's `timeout` (None: no limit); raises `ResultTimeout` once it is spent."""
        if timeout is None:
            return None
        remaining = timeout - (time.monotonic() - started)
        if remaining <= 0:
            raise ResultTimeout(self.request_id, timeout, len(self.builder.token_ids))
        return remaining

    def consume(self, entry_id: bytes | str, fields: dict[bytes, bytes]) -> Delta | None:
        """Feed one entry; remember its id so a new follower resumes after it."""
        self.last_id = entry_id
        return self.builder.feed(decode_event(fields.get(ENTRY_FIELD)))  # type: ignore[arg-type]


class BaseClient:
    """Configuration and request building shared by both twins."""

    def __init__(
        self,
        conn: Any,
        *,
        url: str | None,
        owns_conn: bool,
        queue: str,
        prefix: str,
        max_queue_len: int,
        result_ttl: int,
        limits: RequestLimits | None,
        failover_timeout: float,
        wait_replicas: int,
        partitions: int,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        if not is_valid_name(tenant):
            raise ValueError(f"tenant {tenant!r} must be 1-128 characters of [A-Za-z0-9._:-]")
        if connection_options(conn).get("decode_responses"):
            raise ValueError("llmq needs a redis client with decode_responses=False (entries are msgpack)")
        if max_queue_len < 0:
            raise ValueError("max_queue_len must be >= 0 (0 = no limit)")
        if isinstance(result_ttl, bool) or not isinstance(result_ttl, int) or not 1 <= result_ttl <= MAX_RESULT_TTL_S:
            raise ValueError(f"result_ttl must be whole seconds in [1, {MAX_RESULT_TTL_S}], got {result_ttl!r}")
        if not _is_seconds(failover_timeout, MAX_FAILOVER_TIMEOUT_S):
            raise ValueError(
                f"failover_timeout must be seconds in [0, {MAX_FAILOVER_TIMEOUT_S}], got {failover_timeout!r}"
            )
        self._redis = conn
        self._url = url
        if (
            isinstance(wait_replicas, bool)
            or not isinstance(wait_replicas, int)
            or not 0 <= wait_replicas <= MAX_REPLICAS
        ):
            raise ValueError(f"wait_replicas must be a whole number in [0, {MAX_REPLICAS}], got {wait_replicas!r}")
        self.failover_timeout = failover_timeout
        self.wait_replicas = wait_replicas
        self._owns_conn = owns_conn
        self._closed = False
        self.queue = queue
        self.prefix = prefix
        self.max_queue_len = max_queue_len
        self.result_ttl = result_ttl
        self.limits = limits or RequestLimits()
        self.keys = Keys(queue, prefix)
        self.keys.partitioned(partitions)  # validates the count
        self.partitions = partitions
        self.tenant = tenant
        self._scripts = Scripts.register(conn)
        self.client_id = uuid.uuid4().hex  # names this client's private wake stream

    def __repr__(self) -> str:
        where = redact_url(self._url) if self._url else "<redis client>"
        return f"{type(self).__name__}({where!r}, queue={self.queue!r})"

    def ensure_open(self) -> None:
        if self._closed:
            raise ClientClosed("this client is closed: make a new one (requests it submitted go on)")

    def keys_for(self, queue: str | None, request_id: str | None = None) -> Keys:
        """A queue's keys: with `request_id`, those of the partition that holds that request."""
        keys = self.keys if queue is None or queue == self.queue else Keys(queue, self.prefix)
        if request_id is None or self.partitions == 1:
            return keys
        return Keys(keys.queue, keys.prefix, partition_of(request_id, self.partitions))

    @property
    def socket_timeout(self) -> float | None:
        timeout: float | None = connection_options(self._redis).get("socket_timeout")
        return timeout

    def build_request(
        self,
        prompt: str | None,
        *,
        messages: list[Any] | None,
        input_ids: list[int] | None,
        params: dict[str, Any],
        deadline: float | timedelta | datetime | None,
        request_id: str | None,
        reply_to: str | None = None,
        tools: list[Any] | None = None,
    ) -> GenerateRequest:
        """Validate locally (raising `InvalidRequest`, a ValueError) before anything touches Redis."""
        now = ms_now()
        fields = {
            "v": PROTOCOL_VERSION,
            "id": uuid.uuid4().hex if request_id is None else request_id,
            "prompt": prompt,
            "messages": messages,
            "input_ids": input_ids,
            "tools": tools,
            "params": {k: v for k, v in params.items() if v is not None},
            "deadline": deadline_ms(deadline, now),
            "result_ttl": self.result_ttl,
            "submitted": now,
            "reply_to": reply_to,
        }
        request = parse_request({k: v for k, v in fields.items() if v is not None})
        request.check_limits(self.limits)
        return request

    def build_choices(
        self, n: int, prompt: str | None, *, request_id: str | None, **fields: Any
    ) -> tuple[str, list[GenerateRequest]]:
        """The call's id and `build_request` for each of its `n` choices: the request itself for one, else one
        request per choice under `choice_ids`, choice `i` seeded `seed + i` (so sampled choices differ, yet each is
        the answer of one call seeded so; unseeded, each samples on its own)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise InvalidRequest(f"n must be a whole number from 1 to {MAX_N}, not {n!r}", request_id)
        base = uuid.uuid4().hex if request_id is None else request_id
        ids = choice_ids(base, n)
        last = ids[-1]
        if n > 1 and is_valid_name(base) and not is_valid_name(last):
            message = f"request id {base!r} is too long for n={n}: its last choice's id {last!r} is over 128 characters"
            raise InvalidRequest(message, request_id, param="id")
        params: dict[str, Any] = fields.pop("params")
        seed = params.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            seed = None  # none, or one the request's validation refuses: every choice carries it as it is
        return base, [
            self.build_request(
                prompt, request_id=choice_id, params=params if seed is None else params | {"seed": seed + i}, **fields
            )
            for i, choice_id in enumerate(ids)
        ]

    @property
    def partition_limit(self) -> int:
        """A lane's backlog limit in each partition: its share of `max_queue_len` (0 = no limit)."""
        return math.ceil(self.max_queue_len / self.partitions)

    def partition_groups(self, requests: list[GenerateRequest], queue: str | None) -> list[tuple[Keys, list[Any]]]:
        """A call's requests by the partition that holds each (one group unless the queue is partitioned), in
        order: each group is submitted in one script call."""
        groups: dict[int, tuple[Keys, list[GenerateRequest]]] = {}
        for request in requests:
            keys = self.keys_for(queue, request.id)
            groups.setdefault(keys.partition, (keys, []))[1].append(request)
        return list(groups.values())

    @contextmanager
    def submitting(
        self, requests: list[GenerateRequest], keys: Keys, lane: str, tenant: str | None = None
    ) -> Iterator[ScriptCall]:
        """The `Submit` script's call for `requests` (one call's, of one partition), owned by `tenant` (None: this
        client's), inside the submit's span when tracing records (`client.tracing`; the entries carry its context):
        `check_submitted` ends it with the script's answer, a failure that leaves the block ends it as failed.
        Raises `InvalidRequest` for an unknown lane or a tenant that is no name."""
        first = requests[0]
        if lane not in LANES:
            raise InvalidRequest(f"priority must be one of {', '.join(LANES)}, not {lane!r}", first.id)
        tenant = self.tenant if tenant is None else tenant
        if not is_valid_name(tenant):
            raise InvalidRequest(f"tenant {tenant!r} must be 1-128 characters of [A-Za-z0-9._:-]", first.id)
        trace = tracing.start_submit(first, keys, lane)
        try:
            yield Submit.pack(
                keys,
                [request.id for request in requests],
                lane,
                [encode(request) for request in requests],
                self.partition_limit,
                first.result_ttl,
                self.client_id,
                trace,
                [affinity_key(request) for request in requests],
                tenant,
                [request.estimated_tokens() for request in requests],
            )
        except BaseException as error:
            tracing.end_submit("failed", error=f"{type(error).__name__}: {error}")
            raise

    def check_submitted(self, outcomes: list[SubmitOutcome], keys: Keys, lane: str, tenant: str | None) -> None:
        refused = next((outcome for outcome in _REFUSALS if outcome in outcomes), None)
        if refused is None:
            tracing.end_submit(max(outcomes).name.lower())  # ADDED when any was
            return
        tracing.end_submit(refused.name.lower(), error=_REFUSALS[refused])
        where = f"lane {lane!r} of queue {keys.queue!r}"
        if self.partitions > 1:
            where += f", partition {keys.partition} of {self.partitions},"
        owner = self.tenant if tenant is None else tenant
        within = where.removesuffix(",")  # as the object of a sentence, not its subject
        if refused is SubmitOutcome.TENANT_TOO_LARGE:  # no retry helps: not a QueueFull
            raise InvalidRequest(
                f"this call passes tenant {owner!r}'s queued quota (max queued requests or tokens) in {within} even "
                "with nothing else queued: ask for fewer choices or tokens, or a larger quota"
            )
        if refused is SubmitOutcome.TENANTS_FULL:
            raise TenantQuotaExceeded(
                f"tenant {owner!r} is new to {within}, which serves its most tenants (those that submitted within the "
                "hour; LLMQ_MAX_TENANTS on the workers): retry once one has been quiet for an hour, or raise the bound",
                owner,
            )
        if refused is SubmitOutcome.TENANT_FULL:
            calls = f"{len(outcomes)} more requests" if len(outcomes) > 1 else "another request"
            raise TenantQuotaExceeded(
                f"tenant {owner!r} has no room for {calls} in {within}: its queued requests or tokens are at its quota",
                owner,
            )
        limit = f"{self.partition_limit} unfinished requests"
        if self.partitions > 1:
            limit += f" (its share of max_queue_len {self.max_queue_len})"
        if len(outcomes) > 1:
            raise QueueFull(f"{where} has no room for {len(outcomes)} more requests: it holds {limit} at most")
        raise QueueFull(f"{where} holds {limit}" + ("" if self.partitions > 1 else " (its limit)"))


# The submit script's refusals (every request of the call gets the same one), with what the submit's span says.
_REFUSALS = {
    SubmitOutcome.FULL: "the lane is full (QueueFull)",
    SubmitOutcome.TENANT_FULL: "TenantQuotaExceeded",
    SubmitOutcome.TENANT_TOO_LARGE: "larger than the tenant's queued quota (InvalidRequest)",
    SubmitOutcome.TENANTS_FULL: "a new tenant past the bound on tenants (TenantQuotaExceeded)",
}


class BaseJob:
    """State shared by `Job` and `AsyncJob`: the request id, its keys and the result reader."""

    def __init__(self, client: BaseClient, request_id: str, keys: Keys) -> None:
        if not is_valid_name(request_id):
            raise ValueError(f"request id {request_id!r} must be 1-128 characters of [A-Za-z0-9._:-]")
        self._client = client
        self.id = request_id
        self.keys = keys
        self._reader = ResultReader(request_id, keys.result(request_id))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, queue={self.keys.queue!r}, finish_reason={self.finish_reason!r})"

    @property
    def finish_reason(self) -> FinishReason | None:
        """Set once the `done` event has been read."""
        done = self._reader.builder.done
        return None if done is None else done.finish_reason


class BaseChoices(BaseJob):
    """State shared by `Choices` and `AsyncChoices`: the call's id and its choices' jobs."""

    def __init__(self, client: BaseClient, request_id: str, keys: Keys, jobs: list[Any]) -> None:
        super().__init__(client, request_id, keys)
        self.jobs = jobs

    @property
    def finish_reason(self) -> FinishReason | None:
        """The first choice's, once every choice has ended."""
        reasons = [job.finish_reason for job in self.jobs]
        return None if None in reasons else reasons[0]
