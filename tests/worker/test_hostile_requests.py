"""Black-box: hostile requests, through the client and straight onto the request stream, against a live worker.

The promise under test (README, "Use it from a backend" and "Wire protocol and guarantees"):

- every numeric request field has one range (`client.protocol.BOUNDS`, the README table); a value outside is
  refused with `invalid_request` by whichever side sees it first: the client raises `InvalidRequest` before it
  touches Redis, a raw entry gets an `error` event on its result stream;
- every entry whose request id can be read gets exactly one answer (`error` or `done`), whatever else is
  broken in it (version missing or not an int, strings that are not UTF-8, unknown fields, ...); only an
  entry without a readable id goes to the dead letters, and either way the entry is acknowledged;
- no request stalls the worker or restarts its engine: after each hostile case a control request is served
  exactly (greedy output equal to the idle worker's), and `engine.stats().restarts` stays 0.

The expected answer of each case comes from an oracle written here from the README alone (`expect_raw`,
`expect_client`), not from the product's validators.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from client import AsyncClient, Client, InvalidRequest, LimitExceeded, RequestFailed, Result
from client.protocol import BOUNDS, ENTRY_FIELD, DoneEvent, ErrorEvent, TokensEvent, decode_event, ms_now
from client.store import Keys
from testing.tiny_models import build_tokenizer
from tests.worker.live_worker import CONTROL_IDS, CONTROL_TOKENS, MAX_POSITIONS, LiveWorker

VOCAB = len(build_tokenizer())  # the tiny model's vocabulary (input ids must be below it)
KEYS = Keys("default")
UNREACHABLE = "redis://127.0.0.1:1/0"  # nothing listens: a client that reaches Redis fails with ConnectionError

# The README's bounds table, typed in from the README (not from client.protocol).
README_BOUNDS = {
    "params.max_new_tokens": (1, 1048576),
    "params.temperature": (0, 100),
    "params.top_p": (0, 1),  # > 0
    "params.top_k": (0, 2147483647),
    "params.seed": (-(2**63), 2**64 - 1),
    "params.top_logprobs": (0, 20),
    "params.prompt_logprobs": (0, 20),
    "params.repetition_penalty": (0.01, 10),
    "params.presence_penalty": (-2, 2),
    "params.frequency_penalty": (-2, 2),
    "params.response_format": (0, 65536),  # bytes of the schema or regex
    "tools": (1, 128),  # functions on a chat request
    "input_ids[]": (0, 2147483647),
    "deadline": (0, 253402300799999),
    "submitted": (0, 253402300799999),
    "result_ttl": (1, 2592000),
}
MAX_NEW_TOKENS = 1048576
WORKER_MAX_NEW_TOKENS = 8192  # LLMQ_MAX_NEW_TOKENS default, also the client's default limit
MAX_TOKEN_ID = 2147483647
MAX_TOP_K = 2147483647
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_EPOCH_MS = 253402300799999
MAX_RESULT_TTL = 2592000
MAX_STOP, MAX_STOP_BYTES = 8, 256
MAX_PROMPT_BYTES, MAX_INPUT_IDS = 1_000_000, 131072
GREEDY_BELOW = 0.01

INV, UNSUP, EXPIRED = "invalid_request", "unsupported_version", "expired"
BAD_UTF8 = "\udcff"  # packed with unicode_errors="surrogateescape" this is the byte 0xff inside a msgpack str
PAST_MS, FUTURE_MS = 1_000_000_000_000, 4_000_000_000_000  # 2001 and 2096
ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
TOP_KEYS = {"v", "id", "prompt", "messages", "input_ids", "params", "deadline", "result_ttl", "submitted"}
CASE_TIMEOUT_S = 10.0
_ids = itertools.count()


def unique_id(tag: str = "bb") -> str:
    return f"{tag}-{next(_ids)}-{uuid.uuid4().hex[:8]}"


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


DELETE = _Marker("DELETE")  # a mutation that removes the field


# --- the oracle ---------------------------------------------------------------------------------------------

OK, BAD, EITHER = "ok", "bad", "either"  # EITHER: a lenient reading (e.g. a msgpack bin that is valid UTF-8)


def worst(*verdicts: str) -> str:
    return BAD if BAD in verdicts else EITHER if EITHER in verdicts else OK


def has_bad_utf8(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(has_bad_utf8(k) or has_bad_utf8(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(has_bad_utf8(v) for v in value)
    return False


def int_in(x: Any, lo: int, hi: int) -> str:
    return OK if type(x) is int and lo <= x <= hi else BAD  # booleans are not numbers


def real_in(x: Any, lo: float, hi: float, *, lo_open: bool = False) -> str:
    if type(x) not in (int, float) or not math.isfinite(x):
        return BAD
    above = lo < x if lo_open else lo <= x
    return OK if above and x <= hi else BAD


def text(x: Any, *, nonempty: bool = True, max_bytes: int | None = None) -> str:
    if type(x) is bytes:  # a msgpack bin where a str goes: may be read leniently when it is UTF-8
        try:
            decoded = x.decode()
        except UnicodeDecodeError:
            return BAD
        return worst(EITHER, text(decoded, nonempty=nonempty, max_bytes=max_bytes))
    if type(x) is not str or has_bad_utf8(x) or (nonempty and not x):
        return BAD
    return BAD if max_bytes is not None and len(x.encode()) > max_bytes else OK


def stop_verdict(x: Any) -> str:
    if x is None:
        return BAD
    if type(x) is not list or len(x) > MAX_STOP:
        return BAD
    return worst(OK, *(text(s, max_bytes=MAX_STOP_BYTES) for s in x))


PARAM_CHECKS = {
    "max_new_tokens": lambda x: int_in(x, 1, MAX_NEW_TOKENS),
    "temperature": lambda x: real_in(x, 0, 100),
    "top_p": lambda x: real_in(x, 0, 1, lo_open=True),
    "top_k": lambda x: int_in(x, 0, MAX_TOP_K),
    "seed": lambda x: OK if x is None else int_in(x, MIN_SEED, MAX_SEED),
    "ignore_eos": lambda x: OK if type(x) is bool else BAD,
    "stop": stop_verdict,
}


def params_verdict(params: Any) -> str:
    if not isinstance(params, dict):
        return BAD
    verdicts = [PARAM_CHECKS[k](v) if k in PARAM_CHECKS else BAD for k, v in params.items()]
    return worst(OK, *verdicts)


def message_verdict(message: Any) -> str:
    if not isinstance(message, dict) or set(message) != {"role", "content"}:
        return BAD
    return worst(text(message["role"]), text(message["content"], nonempty=False))


def messages_verdict(x: Any) -> str:
    if type(x) is not list or not x:
        return BAD
    return worst(OK, *(message_verdict(m) for m in x))


def input_ids_verdict(x: Any, vocab: int | None) -> str:
    if type(x) is not list or not x:
        return BAD
    if any(int_in(i, 0, MAX_TOKEN_ID) == BAD for i in x):
        return BAD
    return BAD if vocab is not None and any(i >= vocab for i in x) else OK


FIELD_CHECKS = {
    "prompt": lambda x: OK if x is None else text(x),
    "messages": lambda x: OK if x is None else messages_verdict(x),
    "params": params_verdict,
    "deadline": lambda x: OK if x is None else int_in(x, 0, MAX_EPOCH_MS),
    "result_ttl": lambda x: int_in(x, 1, MAX_RESULT_TTL),
    "submitted": lambda x: int_in(x, 0, MAX_EPOCH_MS),
}


def utf8_size(value: Any) -> int:
    return len(value.encode()) if isinstance(value, str) else len(value) if isinstance(value, bytes) else 0


def limits_verdict(body: dict[Any, Any]) -> str:
    """`RequestLimits` (README: both sides enforce them; defaults on both here): prompt bytes, input_ids
    length, max_new_tokens. Stop limits are checked with the field."""
    new = body["params"].get("max_new_tokens", 256) if isinstance(body.get("params"), dict) else 256
    messages = body.get("messages") or []
    prompt_bytes = utf8_size(body.get("prompt")) + sum(utf8_size(m["role"]) + utf8_size(m["content"]) for m in messages)
    too_big = prompt_bytes > MAX_PROMPT_BYTES or len(body.get("input_ids") or ()) > MAX_INPUT_IDS
    return BAD if too_big or new > WORKER_MAX_NEW_TOKENS else OK


def context_verdict(body: dict[Any, Any]) -> str:
    """Only a worker knows its model: prompt + max_new_tokens must fit the context."""
    new = body["params"].get("max_new_tokens", 256) if isinstance(body.get("params"), dict) else 256
    prompt_len = len(body.get("input_ids") or ())  # text prompts here are a few tokens (or over the byte limit)
    return BAD if prompt_len + new > MAX_POSITIONS else OK


def request_verdict(body: dict[Any, Any], *, worker: bool) -> str:
    """Everything but `v` and `id`; `worker` adds what only a worker knows (vocabulary, context)."""
    if "submitted" not in body or any(k not in TOP_KEYS for k in body):
        return BAD
    sources = [body.get(k) is not None for k in ("prompt", "messages", "input_ids")]
    if sum(sources) != 1:
        return BAD
    verdicts = [check(body[k]) for k, check in FIELD_CHECKS.items() if k in body]
    if "input_ids" in body:
        verdicts.append(input_ids_verdict(body["input_ids"], VOCAB if worker else None))
    verdict = worst(OK, *verdicts)
    if verdict != BAD:
        verdict = worst(verdict, limits_verdict(body), context_verdict(body) if worker else OK)
    return verdict


@dataclass(frozen=True)
class Expect:
    """What a raw entry may be answered with: a dead letter, an `error` with one of `codes`, or `done`."""

    dead: bool = False
    codes: frozenset[str] = frozenset()
    done: bool = False


def version_codes(body: dict[Any, Any]) -> set[str]:
    v = body.get("v", DELETE)
    if type(v) is not int:  # missing or not an int: README allows either code
        return {INV, UNSUP}
    return {UNSUP} if v != 1 else set()


def expect_raw(body: Any, now_ms: int) -> Expect:
    if not isinstance(body, dict) or not (type(body.get("id")) is str and ID_RE.fullmatch(body["id"])):
        return Expect(dead=True)
    codes = version_codes(body)
    if has_bad_utf8(body):
        codes.add(INV)
    verdict = request_verdict(body, worker=True)
    if verdict == BAD:
        codes.add(INV)
    if codes:
        return Expect(codes=frozenset(codes))
    lenient = {INV} if verdict == EITHER else set()
    deadline = body.get("deadline")
    if type(deadline) is int and deadline <= now_ms:
        return Expect(codes=frozenset({EXPIRED} | lenient))
    return Expect(codes=frozenset(lenient), done=True)


def greedy_reference(body: dict[Any, Any], baseline: dict[bool, list[int]]) -> list[int] | None:
    """The exact output a `done` answer must carry, when the request is the control prompt decoded greedily."""
    params = body.get("params", {})
    if body.get("input_ids") != CONTROL_IDS or params.get("stop"):
        return None
    if params.get("temperature", 1.0) >= GREEDY_BELOW:
        return None
    return baseline[params.get("ignore_eos", False)][: params.get("max_new_tokens", 256)]


# --- talking to the live worker -----------------------------------------------------------------------------


def pack(body: Any) -> bytes:
    return msgpack.packb(body, unicode_errors="surrogateescape")


@dataclass
class RawAnswer:
    events: list[Any]  # decoded events of the result stream (empty for a dead letter)
    dead_letter: dict[Any, Any] | None
    dead_added: int  # dead letters written while this case ran


async def _backlog(live: LiveWorker) -> int:
    """Entries on the request stream plus entries delivered and not acknowledged."""
    pending = (await live.redis.xpending(KEYS.requests, "workers"))["pending"]
    return await live.redis.xlen(KEYS.requests) + pending


async def _terminal_events(live: LiveWorker, request_id: str) -> list[Any]:
    key, last, events = KEYS.result(request_id), b"0-0", []
    loop = asyncio.get_running_loop()
    give_up = loop.time() + CASE_TIMEOUT_S
    drained_at = None
    while not events or not isinstance(events[-1], DoneEvent | ErrorEvent):
        assert loop.time() < give_up, f"no answer for {request_id!r} within {CASE_TIMEOUT_S} s: {events}"
        for _, entries in await live.redis.xread({key: last}, block=100) or []:
            for entry_id, fields in entries:
                last = entry_id
                events.append(decode_event(fields[ENTRY_FIELD]))
        # The final event is written before the entry is acknowledged: once nothing is left, it must be there.
        if drained_at is None and await _backlog(live) == 0:
            drained_at = loop.time()
        assert drained_at is None or loop.time() < drained_at + 1.0 or events, (
            f"{request_id!r}: every entry was acknowledged, but its result stream has no answer"
        )
    await asyncio.sleep(0.02)  # nothing may follow the terminal event
    tail = await live.redis.xrange(key, min=b"(" + last)
    assert tail == [], f"events after the terminal one for {request_id!r}: {tail}"
    return events


async def _acknowledged(live: LiveWorker) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + CASE_TIMEOUT_S
    while True:
        backlog = await _backlog(live)
        if backlog == 0:
            return
        assert loop.time() < give_up, f"{backlog} entries not acknowledged"
        await asyncio.sleep(0.02)


async def _dead_letter_for(live: LiveWorker, entry_id: bytes, dead_before: int) -> dict[Any, Any]:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + CASE_TIMEOUT_S
    while await live.redis.xlen(KEYS.dead) <= dead_before:
        assert loop.time() < give_up, f"entry {entry_id!r} got no dead letter within {CASE_TIMEOUT_S} s"
        await asyncio.sleep(0.02)
    [(_, fields)] = await live.redis.xrevrange(KEYS.dead, count=1)
    return msgpack.unpackb(fields[ENTRY_FIELD], raw=False, strict_map_key=False)


async def _send_raw(
    live: LiveWorker, raw: bytes, request_id: str | None, dead: bool, field: bytes = ENTRY_FIELD
) -> RawAnswer:
    dead_before = await live.redis.xlen(KEYS.dead)
    entry_id = await live.redis.xadd(KEYS.requests, {field: raw})
    events: list[Any] = []
    letter = None
    if dead:
        letter = await _dead_letter_for(live, entry_id, dead_before)
    if request_id is not None and not dead:
        events = await _terminal_events(live, request_id)
    await _acknowledged(live)
    await asyncio.sleep(0.02)
    if letter is not None:
        assert letter.get("entry_id") == entry_id.decode() or letter.get("raw") == raw, letter
    return RawAnswer(events, letter, await live.redis.xlen(KEYS.dead) - dead_before)


async def _control(live: LiveWorker) -> list[int]:
    job = await live.client.submit(input_ids=CONTROL_IDS, max_new_tokens=CONTROL_TOKENS, temperature=0)
    return (await job.result(timeout=CASE_TIMEOUT_S)).token_ids


def assert_still_serving(live: LiveWorker, restarts_before: int = 0) -> None:
    """The control request is served exactly and the engine was never restarted."""
    assert live.worker_alive(), "the worker's main task ended"
    assert live.call(_control(live), timeout=CASE_TIMEOUT_S + 5) == live.baseline[False]
    assert live.restarts() == restarts_before == 0, "the engine restarted"


def check_done(events: list[Any], max_new_tokens: int, reference: list[int] | None) -> None:
    """A `done` answer is a correct generation: tokens in the vocabulary, as many as allowed, usage adds up."""
    assert all(isinstance(e, TokensEvent) for e in events[:-1]), events
    done = events[-1]
    assert isinstance(done, DoneEvent), events
    ids = [i for e in events[:-1] for i in e.ids]
    assert all(0 <= i < VOCAB for i in ids)
    assert done.finish_reason in ("eos", "length", "stop")
    assert len(ids) <= max_new_tokens and done.usage.completion_tokens == len(ids)
    if done.finish_reason == "length":
        assert len(ids) == max_new_tokens
    if reference is not None:
        assert ids == reference, f"greedy output {ids} differs from the idle worker's {reference}"


def run_raw(live: LiveWorker, body: Any, *, raw: bytes | None = None) -> RawAnswer:
    """Send one raw entry, check its answer against the oracle, then check the worker still serves."""
    now = ms_now()
    expect = expect_raw(body, now)
    request_id = body["id"] if not expect.dead else None
    raw = pack(body) if raw is None else raw
    answer = live.call(_send_raw(live, raw, request_id, expect.dead), timeout=3 * CASE_TIMEOUT_S)
    if expect.dead:
        assert answer.dead_added == 1 and answer.dead_letter is not None
    else:
        assert answer.dead_added == 0, "an entry with a readable id went to the dead letters"
        last = answer.events[-1]
        if isinstance(last, ErrorEvent):
            assert last.code in expect.codes, f"{body!r}: got error {last.code} ({last.message}), expected {expect}"
            assert len(answer.events) == 1, answer.events
        else:
            assert expect.done, f"{body!r} was generated ({last}), expected an error with one of {set(expect.codes)}"
            params = body.get("params", {})
            max_new = params.get("max_new_tokens", 256)
            check_done(answer.events, max_new, greedy_reference(body, live.baseline))
    assert_still_serving(live)
    return answer


def base_body(request_id: str | None = None, **params: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "id": request_id or unique_id(),
        "input_ids": list(CONTROL_IDS),
        "params": {"max_new_tokens": 6, "temperature": 0.0, **params},
        "submitted": ms_now(),
    }


# --- value catalogues ---------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
SPECIAL_FLOATS = [NAN, INF, -INF, -0.0, 0.0, 5e-324, -5e-324, 1e-300, -1e-300, 1.7976931348623157e308]
HUGE_INTS = [2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**31), -(2**63)]
WRONG_TYPES = [None, True, False, "1", "", [], [1], {}, {"a": 1}, b"\x01", BAD_UTF8, "ok" + BAD_UTF8,
               msgpack.ExtType(5, b"ab"), msgpack.Timestamp(1, 0)]  # fmt: skip

TEMPERATURES = [
    0, 0.0, -0.0, 5e-324, 1e-300, math.nextafter(GREEDY_BELOW, 0), GREEDY_BELOW, 0.7, 1, 100, 100.0,
    math.nextafter(100.0, INF), 101, -5e-324, -1e-300, -1, NAN, INF, -INF, 2**63, True, False, "0.5", None,
]  # fmt: skip
TOP_PS = [
    5e-324, 1e-300, 0.5, math.nextafter(1.0, 0), 1, 1.0, math.nextafter(1.0, 2), 2, 0, 0.0, -0.0, -5e-324,
    NAN, INF, -INF, True, "1", None,
]  # fmt: skip
TOP_KS = [0, 1, VOCAB - 1, VOCAB, VOCAB + 1, MAX_TOP_K - 1, MAX_TOP_K, MAX_TOP_K + 1, -1, 2**63, 2**64 - 1,
          -(2**63), 1.0, 5e-324, True, "5", None]  # fmt: skip
SEEDS = [None, 0, 1, -1, MIN_SEED, MAX_SEED, 2**63, 1.5, NAN, True, "7", [1]]
MAX_NEWS = [1, 2, 8, 600, WORKER_MAX_NEW_TOKENS, WORKER_MAX_NEW_TOKENS + 1, MAX_NEW_TOKENS, MAX_NEW_TOKENS + 1,
            0, -1, 2**31, 2**63, 2**64 - 1, -(2**63), 1.0, 4.0, NAN, True, "4", None]  # fmt: skip
IGNORE_EOS = [True, False, 0, 1, None, "true", 1.0]
STOPS = [
    [], ["x"], ["ab", "cd"], ["a"] * MAX_STOP, ["a"] * (MAX_STOP + 1), ["a" * MAX_STOP_BYTES],
    ["a" * (MAX_STOP_BYTES + 1)], ["é" * (MAX_STOP_BYTES // 2)], ["é" * (MAX_STOP_BYTES // 2 + 1)], [""],
    [BAD_UTF8], ["ok", "x" + BAD_UTF8], "x", [1], [None], None, [b"ab"], [b"\xff"],
]  # fmt: skip
INPUTS = [
    {"input_ids": [0]}, {"input_ids": [VOCAB - 1]}, {"input_ids": [VOCAB]}, {"input_ids": [3, MAX_TOKEN_ID]},
    {"input_ids": [MAX_TOKEN_ID + 1]}, {"input_ids": [-1]}, {"input_ids": [2**64 - 1]}, {"input_ids": [3, True]},
    {"input_ids": [3, 4.0]}, {"input_ids": []}, {"input_ids": "345"}, {"input_ids": [[3]]}, {"input_ids": [3] * 600},
    {"prompt": "hello"}, {"prompt": "é😀 日本"}, {"prompt": ""}, {"prompt": BAD_UTF8}, {"prompt": "ok" + BAD_UTF8},
    {"prompt": b"hello"}, {"prompt": b"\xff\xfe"}, {"prompt": 5}, {"prompt": ["hello"]},
    {"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "user", "content": ""}]},
    {"messages": []}, {"messages": [{"role": "", "content": "hi"}]}, {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": "hi", "name": "x"}]}, {"messages": [{"role": BAD_UTF8, "content": "x"}]},
    {"messages": [{"role": "user", "content": "a" + BAD_UTF8}]}, {"messages": ["hi"]},
    {"messages": {"role": "user", "content": "hi"}}, {"prompt": "hi", "input_ids": [3]}, {},
    {"input_ids": None, "prompt": None},
]  # fmt: skip
EPOCHS = [0, 1, PAST_MS, FUTURE_MS, MAX_EPOCH_MS, MAX_EPOCH_MS + 1, -1, 2**63, 2**64 - 1, 1.5e12, NAN, True,
          "soon", None]  # fmt: skip
RESULT_TTLS = [1, 60, MAX_RESULT_TTL, MAX_RESULT_TTL + 1, 0, -1, 2**63, 60.0, NAN, True, None, "60"]
VERSIONS = [1, 2, 0, -1, 2**64 - 1, MIN_SEED, DELETE, None, True, False, 1.0, "1", [1], {"v": 1}, BAD_UTF8]
IDS = ["ok", "max128", "too_long", "empty", "space", "brace", "non_ascii", "bad_utf8", "int", "none", "bytes",
       "missing"]  # fmt: skip
EXTRA_KEYS = ["colour", "V", "", 5, -1, 1.5, None, True, b"id", BAD_UTF8, "x" + BAD_UTF8]


def resolve_id(kind: str, request_id: str) -> Any:
    return {
        "ok": request_id,
        "max128": request_id.ljust(128, "x"),
        "too_long": request_id.ljust(129, "x"),
        "empty": "",
        "space": request_id + " x",
        "brace": "{" + request_id + "}",
        "non_ascii": request_id + "é",
        "bad_utf8": request_id + BAD_UTF8,
        "int": 7,
        "none": None,
        "bytes": request_id.encode(),
        "missing": DELETE,
    }[kind]


@dataclass(frozen=True)
class Mutation:
    path: str  # "v", "id", "submitted", ..., "input", "params.<name>", "extra", "params.extra"
    value: Any

    def apply(self, body: dict[Any, Any], request_id: str = "") -> None:
        if self.path == "input":
            for key in ("input_ids", "prompt", "messages"):
                body.pop(key, None)
            body.update(self.value)
        elif self.path in ("extra", "params.extra"):
            target = body if self.path == "extra" else body["params"]
            key, value = self.value
            if isinstance(target, dict):
                target[key] = value
        elif self.path == "id":
            self._set(body, "id", resolve_id(self.value, request_id))
        else:
            self._set(body, self.path, self.value)

    @staticmethod
    def _set(body: dict[Any, Any], path: str, value: Any) -> None:
        *parents, name = path.split(".")
        target = body
        for parent in parents:
            target = target.get(parent) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return
        if value is DELETE:
            target.pop(name, None)
        else:
            target[name] = value


def build_body(mutations: list[Mutation]) -> dict[Any, Any]:
    body = base_body()
    request_id = body["id"]
    for mutation in mutations:
        mutation.apply(body, request_id)
    return body


# --- strategies ---------------------------------------------------------------------------------------------

JUNK_VALUES = SPECIAL_FLOATS + HUGE_INTS + WRONG_TYPES
_junk_parts = [st.floats(), st.text(max_size=4), st.binary(max_size=4), st.lists(st.integers(-1, 600), max_size=3)]
junk = st.one_of(st.sampled_from(JUNK_VALUES), st.integers(min_value=MIN_SEED, max_value=MAX_SEED), *_junk_parts)
# max_new_tokens draws no arbitrary ints: an in-bounds 300 would only make the case slow
junk_not_int = st.one_of(st.sampled_from([v for v in JUNK_VALUES if type(v) is not int]), *_junk_parts)


NOTHING = st.nothing()


def field(
    path: str, catalogue: list[Any], valid: st.SearchStrategy[Any] = NOTHING, extra: st.SearchStrategy[Any] = junk
) -> st.SearchStrategy[Mutation]:
    return st.builds(Mutation, st.just(path), st.one_of(valid, st.sampled_from(catalogue), extra))


texts = st.text(max_size=6)
chat = st.lists(st.fixed_dictionaries({"role": texts, "content": texts}), max_size=2)
valid_chat = st.lists(st.fixed_dictionaries({"role": st.text(min_size=1, max_size=4), "content": texts}), min_size=1)
valid_inputs = st.one_of(
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)}),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=8)}),
    st.fixed_dictionaries({"messages": valid_chat.filter(lambda m: len(m) <= 2)}),
)
inputs = st.one_of(
    valid_inputs,
    st.sampled_from(INPUTS),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(-1, VOCAB + 1), max_size=4)}),
    st.fixed_dictionaries({"prompt": st.one_of(texts, junk)}),
    st.fixed_dictionaries({"messages": st.one_of(chat, junk)}),
)
extras = st.tuples(st.one_of(st.sampled_from(EXTRA_KEYS), texts.filter(lambda k: k not in TOP_KEYS)), junk)
VALID = {  # in-bounds values of each field, so that generated requests are also generated, not only refused
    "v": st.just(1),
    "submitted": st.integers(0, MAX_EPOCH_MS),
    "deadline": st.one_of(st.none(), st.integers(FUTURE_MS, MAX_EPOCH_MS)),
    "result_ttl": st.integers(1, MAX_RESULT_TTL),
    "params.max_new_tokens": st.integers(1, CONTROL_TOKENS),
    "params.temperature": st.floats(0, 100),
    "params.top_p": st.floats(0, 1, exclude_min=True),
    "params.top_k": st.integers(0, MAX_TOP_K),
    "params.seed": st.one_of(st.none(), st.integers(MIN_SEED, MAX_SEED)),
    "params.stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "params.ignore_eos": st.booleans(),
}
valid_mutations = st.one_of(
    st.builds(Mutation, st.just("input"), valid_inputs),
    *(st.builds(Mutation, st.just(path), values) for path, values in VALID.items()),
)
mutations = st.one_of(
    field("v", VERSIONS, VALID["v"]),
    field("id", IDS, extra=st.nothing()),
    field("submitted", [*EPOCHS, DELETE], VALID["submitted"]),
    field("deadline", [*EPOCHS, DELETE], VALID["deadline"]),
    field("result_ttl", [*RESULT_TTLS, DELETE], VALID["result_ttl"]),
    st.builds(Mutation, st.just("input"), inputs),
    field("params", [None, [], "x", {"max_new_tokens": 2}]),
    field("params.max_new_tokens", MAX_NEWS, VALID["params.max_new_tokens"], junk_not_int),
    *(field(p, [*c, DELETE], VALID[p]) for p, c in [("params.temperature", TEMPERATURES), ("params.top_p", TOP_PS)]),
    *(field(p, [*c, DELETE], VALID[p]) for p, c in [("params.top_k", TOP_KS), ("params.seed", SEEDS)]),
    *(field(p, [*c, DELETE], VALID[p]) for p, c in [("params.stop", STOPS), ("params.ignore_eos", IGNORE_EOS)]),
    st.builds(Mutation, st.just("extra"), extras),
    st.builds(Mutation, st.just("params.extra"), extras.filter(lambda kv: kv[0] not in PARAM_CHECKS)),
)
# A case: some fields set to in-bounds values, then 0-2 fields (often) made hostile; the last write wins.
cases = st.builds(lambda a, b: a + b, st.lists(valid_mutations, max_size=3), st.lists(mutations, max_size=2)).filter(
    bool
)
FAST = settings(max_examples=50, deadline=None, database=None, phases=[Phase.explicit, Phase.generate])


# --- the oracle's own sanity --------------------------------------------------------------------------------


def test_bounds_are_the_readme_table() -> None:
    """`client.protocol.BOUNDS` is the README's table, one row per numeric field."""
    assert {b.field: (b.minimum, b.maximum) for b in BOUNDS} == README_BOUNDS


def test_live_worker_is_the_model_the_oracle_assumes(live: LiveWorker) -> None:
    assert live.vocab_size == VOCAB
    assert len(live.baseline[True]) == CONTROL_TOKENS
    assert live.baseline[False] == live.baseline[True][: len(live.baseline[False])]
    assert_still_serving(live)


# --- (a) through the client ---------------------------------------------------------------------------------


def client_body(kwargs: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The wire request the client should build for `submit(**kwargs)` (None means "not given")."""
    params = {k: kwargs[k] for k in PARAM_CHECKS if kwargs.get(k) is not None}
    params.setdefault("max_new_tokens", 256)
    body = {"v": 1, "id": request_id, "params": params, "submitted": ms_now()}
    body.update({k: kwargs[k] for k in ("prompt", "messages", "input_ids") if kwargs.get(k) is not None})
    return body


def deadline_verdict(deadline: Any) -> str:
    """OK, BAD (beyond the bound: InvalidRequest) or "refused" (not a usable relative deadline: a ValueError or
    TypeError; an `InvalidRequest` is one too)."""
    if deadline is None:
        return OK
    if isinstance(deadline, timedelta):
        deadline = deadline.total_seconds()
    if type(deadline) not in (int, float) or not math.isfinite(deadline) or deadline <= 0:
        return "refused"
    ms = deadline * 1000  # inf for the largest finite floats: still a finite deadline, far beyond the bound
    return BAD if not math.isfinite(ms) or ms_now() + math.ceil(ms) > MAX_EPOCH_MS else OK


def expect_client(kwargs: dict[str, Any], request_id: str) -> tuple[str, str]:
    """(local, worker): what `submit` does locally (OK, BAD = InvalidRequest, EITHER, "refused") and, if it
    submits, what the worker answers (OK = a generation, BAD = invalid_request)."""
    body = client_body(kwargs, request_id)
    deadline = deadline_verdict(kwargs.get("deadline"))
    if deadline == "refused":
        return "refused", BAD
    valid_id = type(request_id) is str and ID_RE.fullmatch(request_id) is not None
    local = worst(request_verdict(body, worker=False), deadline, OK if valid_id else BAD)
    return local, request_verdict(body, worker=True)


def submit_locally(kwargs: dict[str, Any], use_async: bool) -> BaseException | None:
    """`submit` on a client whose Redis cannot be reached: InvalidRequest = refused before touching Redis."""
    try:
        if use_async:

            async def submit() -> None:
                async with AsyncClient(UNREACHABLE, failover_timeout=0) as client:  # validation, not retries
                    await client.submit(**kwargs)

            asyncio.run(submit())
        else:
            with Client(UNREACHABLE, failover_timeout=0) as client:
                client.submit(**kwargs)
    except Exception as error:
        return error
    return None


def assert_local_outcome(kwargs: dict[str, Any], error: BaseException | None) -> None:
    local, _ = expect_client(kwargs, kwargs["request_id"])
    reached_redis = error is not None and "connect" in str(error).lower() and not isinstance(error, ValueError)
    if local == OK:
        assert reached_redis, f"submit({kwargs!r}) should pass validation, got {error!r}"
    elif local == BAD:
        assert isinstance(error, InvalidRequest), f"submit({kwargs!r}) should raise InvalidRequest, got {error!r}"
        assert isinstance(error, ValueError)
    elif local == "refused":
        assert isinstance(error, ValueError | TypeError), f"submit({kwargs!r}) should be refused, got {error!r}"
    else:
        assert reached_redis or isinstance(error, InvalidRequest), f"submit({kwargs!r}): {error!r}"


request_ids = st.one_of(
    st.just("ok"),
    st.sampled_from(["", "a b", "x" * 129, "{x}", "é", "x\n", BAD_UTF8]),
    st.text(max_size=6),
)
client_values = {
    "max_new_tokens": st.one_of(st.sampled_from(MAX_NEWS), junk_not_int, st.sampled_from([2**64, 2**100])),
    "temperature": st.one_of(VALID["params.temperature"], st.sampled_from(TEMPERATURES), junk),
    "top_p": st.one_of(VALID["params.top_p"], st.sampled_from(TOP_PS), junk),
    "top_k": st.one_of(VALID["params.top_k"], st.sampled_from(TOP_KS), junk, st.just(2**64)),
    "seed": st.one_of(VALID["params.seed"], st.sampled_from(SEEDS), junk, st.sampled_from([2**64, MIN_SEED - 1])),
    "stop": st.one_of(VALID["params.stop"], st.sampled_from(STOPS), junk),
    "ignore_eos": st.one_of(VALID["params.ignore_eos"], st.sampled_from(IGNORE_EOS), junk),
    "deadline": st.one_of(
        st.sampled_from([None, 60, 0.5, 1e300, 1e13, -1, 0, NAN, INF, True, "60", timedelta(seconds=60)]),
        st.floats(1.0, 1e6),
        junk,
    ),
}
huge_ids = st.sampled_from([*HUGE_INTS, 2**64])
client_inputs = st.one_of(
    st.sampled_from([i for i in INPUTS if i]),
    valid_inputs,
    st.fixed_dictionaries({"input_ids": st.lists(st.one_of(st.integers(-1, VOCAB + 1), huge_ids), max_size=3)}),
    st.fixed_dictionaries({"prompt": texts}),
    st.fixed_dictionaries({"messages": chat}),
)


def client_kwargs(
    values: dict[str, st.SearchStrategy[Any]], ids: st.SearchStrategy[Any]
) -> st.SearchStrategy[dict[str, Any]]:
    optional = {k: v.filter(lambda x: x is not None) for k, v in values.items()}  # None = "not given"
    return st.builds(
        lambda given, options, request_id: {**given, **options, "request_id": request_id},
        client_inputs,
        st.fixed_dictionaries({}, optional=optional),
        ids,
    )


@settings(max_examples=100, deadline=None, database=None)
@given(kwargs=client_kwargs(client_values, request_ids), use_async=st.booleans())
@example(kwargs={"messages": [{"role": "user", "content": "a" + BAD_UTF8}], "request_id": "ok"}, use_async=False)
@example(kwargs={"input_ids": [3], "deadline": INF, "request_id": "ok"}, use_async=True)
@example(kwargs={"input_ids": [3], "deadline": 1.7976931348623157e308, "request_id": "ok"}, use_async=False)
def test_client_refuses_out_of_bounds_before_touching_redis(kwargs: dict[str, Any], use_async: bool) -> None:
    """Locally: every value outside its bound, wrong type or bad string raises InvalidRequest before any
    Redis call; every value inside gets as far as Redis (here: a ConnectionError, nothing listens)."""
    if kwargs["request_id"] == "ok":
        kwargs["request_id"] = unique_id()
    assert_local_outcome(kwargs, submit_locally(kwargs, use_async))


BOUND_FIELDS = {  # BOUNDS row -> how to give that field to submit()
    "params.max_new_tokens": lambda v: {"input_ids": [3], "max_new_tokens": v},
    "params.temperature": lambda v: {"input_ids": [3], "temperature": v},
    "params.top_p": lambda v: {"input_ids": [3], "top_p": v},
    "params.top_k": lambda v: {"input_ids": [3], "top_k": v},
    "params.seed": lambda v: {"input_ids": [3], "seed": v},
    "input_ids[]": lambda v: {"input_ids": [3, v]},
}


def outside(bound_field: str) -> list[Any]:
    [bound] = [b for b in BOUNDS if b.field == bound_field]
    lo, hi = bound.minimum, bound.maximum
    if bound_field.endswith(("temperature", "top_p")):
        return [math.nextafter(float(lo), -INF), float(lo) - 1, math.nextafter(float(hi), INF), hi + 1, NAN, INF]
    return [lo - 1, hi + 1, lo - 2**64, hi + 2**64, float(lo), True]


@pytest.mark.parametrize("bound_field", sorted(BOUND_FIELDS))
def test_client_refuses_every_documented_bound(bound_field: str) -> None:
    """Just outside each row of BOUNDS (and top_p exactly 0): InvalidRequest, and Redis is never reached."""
    values = outside(bound_field) + ([0.0, -0.0] if bound_field == "params.top_p" else [])
    for value in values:
        for use_async in (False, True):
            kwargs = {**BOUND_FIELDS[bound_field](value), "request_id": unique_id()}
            error = submit_locally(kwargs, use_async)
            assert isinstance(error, InvalidRequest), f"{bound_field}={value!r}: {error!r}"


@pytest.mark.parametrize("deadline", [1e300, 1.7976931348623157e308, timedelta(days=3_000_000)], ids=repr)
def test_client_refuses_a_deadline_beyond_the_bound(deadline: Any) -> None:
    """A relative deadline that lands after year 9999 is outside the `deadline` bound: InvalidRequest."""
    for use_async in (False, True):
        error = submit_locally({"input_ids": [3], "deadline": deadline, "request_id": unique_id()}, use_async)
        assert isinstance(error, InvalidRequest), f"deadline={deadline!r}: {error!r}"


async def _client_case(live: LiveWorker, kwargs: dict[str, Any]) -> Result | BaseException:
    try:
        job = await live.client.submit(**kwargs)
        return await job.result(timeout=CASE_TIMEOUT_S)
    except Exception as error:
        return error


live_client_values = {
    **client_values,
    "max_new_tokens": st.one_of(st.integers(1, CONTROL_TOKENS), st.sampled_from(MAX_NEWS), junk_not_int),
    "deadline": st.sampled_from([None, 60, 1e300, -1, NAN, INF, timedelta(minutes=5)]),
}


@FAST
@given(kwargs=client_kwargs(live_client_values, st.just("ok")))
@example(kwargs={"input_ids": list(CONTROL_IDS), "max_new_tokens": 8, "temperature": 1e-300, "request_id": "ok"})
@example(kwargs={"input_ids": [3, VOCAB], "max_new_tokens": 4, "request_id": "ok"})
@example(kwargs={"input_ids": [3], "max_new_tokens": 600, "request_id": "ok"})
def test_client_submissions_are_refused_answered_or_generated(live: LiveWorker, kwargs: dict[str, Any]) -> None:
    """Through AsyncClient: InvalidRequest locally, a typed RequestFailed(invalid_request) from the worker
    (ids outside the vocabulary, too long for the context), or a correct generation; then the control."""
    kwargs.setdefault("max_new_tokens", 4)
    kwargs["request_id"] = unique_id("cl")
    local, worker = expect_client(kwargs, kwargs["request_id"])
    outcome = live.call(_client_case(live, kwargs), timeout=3 * CASE_TIMEOUT_S)
    if isinstance(outcome, InvalidRequest | TypeError) or (local == "refused" and isinstance(outcome, ValueError)):
        assert local in (BAD, EITHER, "refused"), f"submit({kwargs!r}) refused locally: {outcome!r}"
    elif isinstance(outcome, RequestFailed):
        assert local != BAD, f"submit({kwargs!r}) reached the worker: {outcome!r}"
        assert outcome.code == INV and worker in (BAD, EITHER), f"submit({kwargs!r}): {outcome!r}"
    else:
        assert isinstance(outcome, Result), f"submit({kwargs!r}): {outcome!r}"
        assert local != BAD and worker != BAD, f"submit({kwargs!r}) was generated: {outcome}"
        body = client_body(kwargs, kwargs["request_id"])
        reference = greedy_reference(body, live.baseline)
        assert outcome.finish_reason in ("eos", "length", "stop")
        assert all(0 <= i < VOCAB for i in outcome.token_ids)
        assert len(outcome.token_ids) <= body["params"]["max_new_tokens"]
        assert reference is None or outcome.token_ids == reference
    assert_still_serving(live)


# --- (b) raw entries on the request stream ------------------------------------------------------------------


@FAST
@given(muts=cases)
@example(muts=[Mutation("params.temperature", 1e-300)])
@example(muts=[Mutation("params.top_p", 5e-324), Mutation("params.temperature", 1.0)])
@example(muts=[Mutation("params.top_k", MAX_TOP_K), Mutation("params.temperature", 100.0)])
@example(muts=[Mutation("v", DELETE), Mutation("params.temperature", NAN)])
@example(muts=[Mutation("extra", (BAD_UTF8, 1))])
def test_raw_entries_are_answered_by_the_oracle(live: LiveWorker, muts: list[Mutation]) -> None:
    """A valid request with a few fields set in bounds and 0-2 made hostile, XADDed as is: the answer is the
    oracle's (a dead letter only without a readable id; an error code; or a correct generation), and the control
    is served after it."""
    run_raw(live, build_body(muts))


SINGLE_CASES = (
    [Mutation("v", v) for v in VERSIONS]
    + [Mutation("id", kind) for kind in IDS]
    + [Mutation(path, v) for path in ("submitted", "deadline") for v in EPOCHS]
    + [Mutation("result_ttl", v) for v in RESULT_TTLS]
    + [Mutation("input", v) for v in INPUTS]
    + [Mutation("params.max_new_tokens", v) for v in MAX_NEWS]
    + [Mutation("params.temperature", v) for v in TEMPERATURES]
    + [Mutation("params.top_p", v) for v in TOP_PS]
    + [Mutation("params.top_k", v) for v in TOP_KS]
    + [Mutation("params.seed", v) for v in SEEDS]
    + [Mutation("params.stop", v) for v in STOPS]
    + [Mutation("params.ignore_eos", v) for v in IGNORE_EOS]
    + [Mutation("extra", (k, 1)) for k in EXTRA_KEYS]
    + [Mutation("params.extra", (k, 1)) for k in EXTRA_KEYS]
)


def _short_lived(body: dict[str, Any]) -> bool:
    ttl = body.get("result_ttl")
    return isinstance(ttl, int) and not isinstance(ttl, bool) and ttl < 10


async def _burst(live: LiveWorker, bodies: list[dict[str, Any]]) -> tuple[list[list[Any]], list[list[int]], int]:
    """XADD every body, each followed by a control request, in one go; then collect every answer."""
    dead_before = await live.redis.xlen(KEYS.dead)

    async def answer(body: dict[str, Any]) -> list[Any]:
        return await _terminal_events(live, body["id"]) if not expect_raw(body, ms_now()).dead else []

    # A stream with a result_ttl of a few seconds may expire before the burst is over on a loaded machine:
    # those are read as soon as they are queued; the others after the burst, one after the other.
    early: dict[int, asyncio.Task[list[Any]]] = {}
    controls = []
    for body in bodies:
        await live.redis.xadd(KEYS.requests, {ENTRY_FIELD: pack(body)})
        if _short_lived(body):  # read from now on (with its entry queued, it cannot look drained)
            early[id(body)] = asyncio.create_task(answer(body))
        controls.append(await live.client.submit(input_ids=CONTROL_IDS, max_new_tokens=CONTROL_TOKENS, temperature=0))
    answers = [await early[id(body)] if id(body) in early else await answer(body) for body in bodies]
    outputs = [(await job.result(timeout=4 * CASE_TIMEOUT_S)).token_ids for job in controls]
    await _acknowledged(live)
    await asyncio.sleep(0.05)
    return answers, outputs, await live.redis.xlen(KEYS.dead) - dead_before


def test_every_catalogued_value_in_one_burst(live: LiveWorker) -> None:
    """Every catalogued hostile value of every field at once, interleaved with control requests: each entry
    gets the oracle's answer, each control its exact greedy output, dead letters only for unreadable ids."""
    bodies = [build_body([m]) for m in SINGLE_CASES]
    now = ms_now()
    expects = [expect_raw(body, now) for body in bodies]
    answers, outputs, dead_added = live.call(_burst(live, bodies), timeout=100)
    assert outputs == [live.baseline[False]] * len(bodies)
    assert dead_added == sum(e.dead for e in expects)
    problems = []
    for mutation, body, expect, events in zip(SINGLE_CASES, bodies, expects, answers, strict=True):
        if expect.dead:
            continue
        last = events[-1]
        if isinstance(last, ErrorEvent) and last.code not in expect.codes:
            problems.append(f"{mutation}: error {last.code} ({last.message}), expected {set(expect.codes)}")
        elif isinstance(last, DoneEvent) and not expect.done:
            problems.append(f"{mutation}: generated, expected an error with one of {set(expect.codes)}")
        elif isinstance(last, DoneEvent):
            max_new = body["params"].get("max_new_tokens", 256) if isinstance(body.get("params"), dict) else 256
            check_done(events, max_new, greedy_reference(body, live.baseline))
    assert problems == []
    assert_still_serving(live)


# --- named promises -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "greedy"),
    [
        ({"temperature": 1e-300}, True),
        ({"temperature": 5e-324}, True),
        ({"temperature": -0.0}, True),
        ({"temperature": math.nextafter(GREEDY_BELOW, 0)}, True),
        ({"temperature": 100.0}, False),
        ({"temperature": 100}, False),
        ({"temperature": 1.0, "top_p": 5e-324}, False),
        ({"temperature": 1.0, "top_p": 1e-300}, False),
        ({"temperature": 100.0, "top_k": MAX_TOP_K}, False),
        ({"temperature": 100.0, "top_k": MAX_TOP_K, "top_p": 5e-324}, False),
        ({"temperature": 100.0, "top_k": 1}, True),  # one candidate: the argmax, whatever the temperature
        ({"temperature": 0.0, "top_k": MAX_TOP_K, "top_p": 5e-324}, True),
        ({"temperature": 1.0, "seed": MAX_SEED}, False),
        ({"temperature": 1.0, "seed": MIN_SEED}, False),
        ({"temperature": 0.0, "max_new_tokens": 1}, True),
    ],
)
def test_values_at_the_bounds_run_without_restart(live: LiveWorker, params: dict[str, Any], greedy: bool) -> None:
    """The bounds themselves are accepted and run to a correct generation, through the client and raw."""
    kwargs = {"input_ids": list(CONTROL_IDS), "max_new_tokens": CONTROL_TOKENS, **params}
    outcome = live.call(_client_case(live, {**kwargs, "request_id": unique_id("edge")}), timeout=30)
    assert isinstance(outcome, Result), f"{params}: {outcome!r}"
    assert outcome.finish_reason in ("eos", "length") and all(0 <= i < VOCAB for i in outcome.token_ids)
    if greedy:
        assert outcome.token_ids == live.baseline[False][: kwargs["max_new_tokens"]], params
    assert_still_serving(live)
    answer = run_raw(live, base_body(**{"max_new_tokens": CONTROL_TOKENS, **params}))
    assert isinstance(answer.events[-1], DoneEvent), answer.events


@pytest.mark.parametrize(
    "fields",
    [
        {"deadline": MAX_EPOCH_MS},
        {"submitted": 0},
        {"submitted": MAX_EPOCH_MS},
        {"result_ttl": MAX_RESULT_TTL},
        {"result_ttl": 1},
        {"input_ids": [0, VOCAB - 1]},
    ],
)
def test_raw_fields_at_their_bounds_are_generated(live: LiveWorker, fields: dict[str, Any]) -> None:
    body = {**base_body(), **fields}
    answer = run_raw(live, body)
    assert isinstance(answer.events[-1], DoneEvent), answer.events


@pytest.mark.parametrize("bound_field", sorted(README_BOUNDS))
def test_raw_values_just_outside_each_bound_get_invalid_request(live: LiveWorker, bound_field: str) -> None:
    """The worker side of the one set of bounds: just outside each row, an `invalid_request` error event."""
    [bound] = [b for b in BOUNDS if b.field == bound_field]
    lo, hi = bound.minimum, bound.maximum
    floaty = bound_field.endswith(("temperature", "top_p"))
    values = [math.nextafter(float(lo), -INF), math.nextafter(float(hi), INF)] if floaty else [lo - 1, hi + 1]
    values = [v for v in values if -(2**63) <= v <= 2**64 - 1] + ([0.0] if bound_field.endswith("top_p") else [])
    for value in values:
        body = base_body()
        if bound_field.startswith("params."):
            body["params"][bound_field.removeprefix("params.")] = value
        elif bound_field == "tools":
            del body["input_ids"]
            body["messages"] = [{"role": "user", "content": "hi"}]
            body["tools"] = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(value)]
        elif bound_field == "input_ids[]":
            body["input_ids"] = [3, value]
        else:
            body[bound_field] = value
        answer = run_raw(live, body)
        last = answer.events[-1]
        assert isinstance(last, ErrorEvent) and last.code == INV, f"{bound_field}={value!r}: {answer.events}"


@pytest.mark.parametrize(
    ("version", "codes"),
    [
        (DELETE, {INV, UNSUP}),
        (None, {INV, UNSUP}),
        ("1", {INV, UNSUP}),
        (1.0, {INV, UNSUP}),
        (True, {INV, UNSUP}),
        ([1], {INV, UNSUP}),
        (2, {UNSUP}),
        (0, {UNSUP}),
        (-1, {UNSUP}),
        (2**64 - 1, {UNSUP}),
    ],
)
def test_any_version_gets_an_answer(live: LiveWorker, version: Any, codes: set[str]) -> None:
    body = base_body()
    Mutation("v", version).apply(body)
    answer = run_raw(live, body)
    assert [type(e) for e in answer.events] == [ErrorEvent] and answer.events[0].code in codes


@pytest.mark.parametrize(
    "where",
    ["prompt", "stop", "role", "content", "extra value", "extra key", "params key", "version", "seed"],
)
def test_non_utf8_string_anywhere_gets_invalid_request(live: LiveWorker, where: str) -> None:
    bad = "x" + BAD_UTF8
    body = base_body()
    if where == "prompt":
        del body["input_ids"]
        body["prompt"] = bad
    elif where in ("role", "content"):
        del body["input_ids"]
        body["messages"] = [{"role": "user", "content": "hi", where: bad}]
    elif where in ("stop", "seed"):
        body["params"][where] = [bad] if where == "stop" else bad
    elif where == "version":
        body["v"] = bad
    else:
        target = body["params"] if where == "params key" else body
        target[bad if where.endswith("key") else "note"] = bad
    raw = pack(body)
    with pytest.raises(UnicodeDecodeError):
        msgpack.unpackb(raw, raw=False)
    answer = run_raw(live, body)
    assert [type(e) for e in answer.events] == [ErrorEvent] and answer.events[0].code == INV, answer.events


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x00\xffnot msgpack",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb(7),
        msgpack.packb("a string"),
        msgpack.packb({"v": 1, "input_ids": [3], "submitted": 1}),
        msgpack.packb({"v": 1, "id": "a b", "input_ids": [3], "submitted": 1}),
        msgpack.packb({"v": 1, "id": 7, "input_ids": [3], "submitted": 1}),
        msgpack.packb({"v": 1, "id": b"bytes-id", "input_ids": [3], "submitted": 1}),
        pack({"v": 1, "id": "bad" + BAD_UTF8, "input_ids": [3], "submitted": 1}),
        pack({"id": BAD_UTF8, "v": BAD_UTF8}),
        b"\x91" * 100_000,  # nested far too deep
    ],
    ids=lambda raw: repr(raw[:24]),
)
def test_entries_without_a_readable_id_go_to_the_dead_letters(live: LiveWorker, raw: bytes) -> None:
    answer = live.call(_send_raw(live, raw, None, dead=True), timeout=3 * CASE_TIMEOUT_S)
    assert answer.dead_added == 1
    assert_still_serving(live)


def test_entry_without_the_m_field_goes_to_the_dead_letters(live: LiveWorker) -> None:
    body = pack(base_body())
    answer = live.call(_send_raw(live, body, None, dead=True, field=b"x"), timeout=3 * CASE_TIMEOUT_S)
    assert answer.dead_added == 1
    assert_still_serving(live)


def raw_map(pairs: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map written pair by pair, so keys may be what a Python dict cannot hold (arrays, maps)."""
    return msgpack.Packer().pack_map_header(len(pairs)) + b"".join(pack(k) + pack(v) for k, v in pairs)


@pytest.mark.parametrize(
    ("where", "key"),
    [("top level", [1, 2]), ("top level", {"k": 1}), ("params", [1, 2])],
    ids=["array-key", "map-key", "array-key-in-params"],
)
def test_entry_with_an_unhashable_map_key_is_answered(live: LiveWorker, where: str, key: Any) -> None:
    """msgpack allows any value as a map key. An array or map key is an unknown field like any other: the id
    is right there, so the reader must get `invalid_request`, not silence plus a dead letter."""
    body = base_body()
    params = list(body.pop("params").items()) + ([(key, 1)] if where == "params" else [])
    top = list(body.items()) + ([(key, 1)] if where == "top level" else [])
    head = msgpack.Packer().pack_map_header(len(top) + 1)
    raw = head + b"".join(pack(k) + pack(v) for k, v in top) + pack("params") + raw_map(params)
    answer = live.call(_send_raw(live, raw, body["id"], dead=False), timeout=3 * CASE_TIMEOUT_S)
    assert answer.dead_added == 0, "an entry with a readable id went to the dead letters"
    assert [type(e) for e in answer.events] == [ErrorEvent] and answer.events[0].code == INV, answer.events
    assert_still_serving(live)


@pytest.mark.parametrize(
    ("kwargs", "limit"),
    [
        ({"prompt": "a" * 1_000_001}, "max_prompt_bytes"),
        ({"prompt": "é" * 500_001}, "max_prompt_bytes"),
        ({"messages": [{"role": "user", "content": "a" * 1_000_000}]}, "max_prompt_bytes"),
        ({"input_ids": [3] * 131_073}, "max_input_ids"),
        ({"input_ids": [3], "stop": ["a"] * 9}, "max_stop"),
        ({"input_ids": [3], "stop": ["é" * 129]}, "max_stop_bytes"),
        ({"input_ids": [3], "max_new_tokens": 8193}, "max_new_tokens"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_request_limits_are_enforced_on_both_sides(live: LiveWorker, kwargs: dict[str, Any], limit: str) -> None:
    """README: both the client and the worker enforce the size limits; over one: InvalidRequest locally
    (`LimitExceeded`, naming the limit), `invalid_request` for the same request sent raw."""
    error = submit_locally({**kwargs, "request_id": unique_id()}, use_async=False)
    assert isinstance(error, LimitExceeded) and error.limit == limit, repr(error)[:300]
    body = base_body()
    params = {k: kwargs[k] for k in ("stop", "max_new_tokens") if k in kwargs}
    body["params"].update(params)
    Mutation("input", {k: v for k, v in kwargs.items() if k not in params}).apply(body)
    answer = run_raw(live, body)
    assert [type(e) for e in answer.events] == [ErrorEvent] and answer.events[0].code == INV


def test_engine_never_restarted_over_the_module(live: LiveWorker) -> None:
    """Runs last in this file: after everything above, the engine has still not restarted once."""
    assert live.restarts() == 0
    stats = live.call(_stats(live))
    assert stats.restarts == 0
    assert_still_serving(live)


async def _stats(live: LiveWorker) -> Any:
    return live.engine.stats()
