"""Intake decisions are pure: every kind of entry maps to accept, answer (an event) or dead letter, and every
accepted request, with what Redis knows of it, to start, answer or dead letter (`admit`)."""

from __future__ import annotations

import msgpack
import pytest

from client.protocol import DoneEvent, ErrorCode, ErrorEvent, GenerateRequest, RequestLimits, encode, ms_now
from worker.intake import Accepted, Answer, Letter, Policy, Ready, Start, admit, decide

LIMITS = RequestLimits()


def entry(data: dict | bytes) -> dict[bytes, bytes]:
    return {b"m": data if isinstance(data, bytes) else msgpack.packb(data)}


def valid(fields: dict | None = None, **named: object) -> dict:
    base = {"v": 1, "id": "req-1", "prompt": "hi", "params": {"max_new_tokens": 4}, "submitted": ms_now()}
    return {**base, **(fields or {}), **named}


def code_of(answer: Answer) -> object:
    assert isinstance(answer.event, ErrorEvent)
    return answer.event.code


def message_of(answer: Answer) -> str:
    assert isinstance(answer.event, ErrorEvent)
    return answer.event.message


def test_valid_request_is_accepted() -> None:
    decision = decide(b"1-0", entry(valid()), LIMITS)
    assert isinstance(decision, Accepted) and decision.request.id == "req-1"


def test_round_trip_through_the_client_encoder() -> None:
    request = GenerateRequest(id="abc", input_ids=[1, 2], submitted=ms_now())
    assert isinstance(decide(b"1-0", {b"m": encode(request)}, LIMITS), Accepted)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\xc1\xff garbage", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "map"),
        (msgpack.packb({"v": 1, "prompt": "no id"}), "id"),
        (msgpack.packb({"v": 1, "id": "bad\udcff", "prompt": "x"}, unicode_errors="surrogateescape"), "UTF-8"),
    ],
)
def test_unreadable_entries_become_dead_letters(raw: bytes, reason: str) -> None:
    decision = decide(b"1-0", entry(raw), LIMITS)
    assert isinstance(decision, Letter) and reason in decision.reason and decision.raw == raw


def test_the_submitting_client_is_read_from_the_entry_and_answered_too() -> None:
    notified = {**entry(valid()), b"n": b"client-7"}
    accepted = decide(b"1-0", notified, LIMITS)
    assert isinstance(accepted, Accepted) and accepted.notify == "client-7"
    rejected = decide(b"1-0", {**entry(valid(deadline=1)), b"n": b"client-7"}, LIMITS)
    assert isinstance(rejected, Answer) and rejected.target.notify == "client-7"
    for hint in (b"a b", b"{x}", b"\xff", b""):  # only a hint: an unusable one is ignored, the request runs
        decision = decide(b"1-0", {**entry(valid()), b"n": hint}, LIMITS)
        assert isinstance(decision, Accepted) and decision.notify is None


def test_entry_without_the_m_field_is_a_dead_letter() -> None:
    assert isinstance(decide(b"1-0", {b"x": b"1"}, LIMITS), Letter)


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"v": 2}, ErrorCode.UNSUPPORTED_VERSION),
        ({"colour": "blue"}, ErrorCode.INVALID_REQUEST),
        ({"params": {"temperature": -1.0}}, ErrorCode.INVALID_REQUEST),
        ({"params": {"temperature": "hot"}}, ErrorCode.INVALID_REQUEST),
        ({"prompt": None}, ErrorCode.INVALID_REQUEST),
        ({"prompt": "x", "input_ids": [1]}, ErrorCode.INVALID_REQUEST),
        ({"params": {"max_new_tokens": 10**6}}, ErrorCode.INVALID_REQUEST),
        ({"params": {"stop": ["a"] * 20}}, ErrorCode.INVALID_REQUEST),
        # Each of these once passed the checks and then killed the engine or a Redis batch.
        ({"params": {"top_k": 2**31}}, ErrorCode.INVALID_REQUEST),
        ({"params": {"temperature": 1e300}}, ErrorCode.INVALID_REQUEST),
        ({"result_ttl": 2**62}, ErrorCode.INVALID_REQUEST),
        ({"deadline": 2**63 - 1}, ErrorCode.INVALID_REQUEST),
        ({"input_ids": [2**31], "prompt": None}, ErrorCode.INVALID_REQUEST),
        # A readable id is answered, however broken the rest.
        ({"v": None}, ErrorCode.INVALID_REQUEST),
        ({"v": "1"}, ErrorCode.INVALID_REQUEST),
        ({"v": 1.0}, ErrorCode.INVALID_REQUEST),
        ({"v": 2**64 - 1}, ErrorCode.UNSUPPORTED_VERSION),
        ({7: "an int key"}, ErrorCode.INVALID_REQUEST),
    ],
)
def test_invalid_requests_are_answered_with_an_error(fields: dict, code: ErrorCode) -> None:
    decision = decide(b"1-0", entry(valid(fields)), LIMITS)
    assert isinstance(decision, Answer) and code_of(decision) == code and decision.target.request_id == "req-1"
    assert decision.rejected and decision.target.attempt is None  # unfenced: no attempt of it started


def test_an_array_for_a_map_key_is_answered_when_the_id_is_readable() -> None:
    raw = msgpack.packb(valid()).replace(b"\x85", b"\x86", 1) + msgpack.packb([1, 2]) + msgpack.packb("x")
    decision = decide(b"1-0", entry(raw), LIMITS)
    assert isinstance(decision, Answer) and decision.target.request_id == "req-1" and "map key" in message_of(decision)


@pytest.mark.parametrize("where", ["prompt", "stop", "key"])
def test_a_string_that_is_not_utf8_is_answered_when_the_id_is_readable(where: str) -> None:
    bad = "x\udcff"  # packs as the byte 0xff, which no UTF-8 string holds
    fields = {"prompt": bad} if where == "prompt" else {"params": {"stop": [bad]}} if where == "stop" else {bad: 1}
    raw = msgpack.packb(valid(fields), unicode_errors="surrogateescape")
    decision = decide(b"1-0", entry(raw), LIMITS)
    assert isinstance(decision, Answer) and decision.target.request_id == "req-1" and "UTF-8" in message_of(decision)


def test_a_tiny_temperature_is_accepted_and_decodes_greedily() -> None:
    from worker.adapter import engine_request

    decision = decide(b"1-0", entry(valid(params={"temperature": 1e-300})), LIMITS)
    assert isinstance(decision, Accepted)
    assert engine_request(decision.request).params.greedy


def test_expired_deadline_is_rejected_without_generation() -> None:
    now = ms_now()
    decision = decide(b"1-0", entry(valid(deadline=now - 1, result_ttl=60)), LIMITS, now_ms=now)
    assert isinstance(decision, Answer) and code_of(decision) == ErrorCode.EXPIRED and decision.target.ttl_s == 60
    assert isinstance(decide(b"1-0", entry(valid(deadline=now + 10_000)), LIMITS, now_ms=now), Accepted)


# --- admit: one test per branch ----------------------------------------------------------------

EOS = (0,)
POLICY = Policy(eos_token_ids=EOS, max_deliveries=3, max_engine_failures=2)


def ready(**fields: object) -> Ready:
    request = GenerateRequest(id="r", input_ids=[3, 4], params={"max_new_tokens": 5}, submitted=ms_now())
    base: dict = {"attempt": 2, "cancelled": False, "delivered_ids": [], "delivered_text": "", "finished": False}
    return Ready(Accepted(b"1-0", request, notify="c", lane="batch", partition=1), **{**base, **fields})  # type: ignore[arg-type]


def test_a_fresh_request_starts() -> None:
    item = ready()
    assert admit(item, POLICY) == Start(item, suspect=False, replaces_own=False)


def test_a_request_implicated_once_starts_as_a_suspect() -> None:
    item = ready(engine_failures=1)
    assert admit(item, POLICY) == Start(item, suspect=True)


def test_claiming_its_own_request_replaces_the_old_run() -> None:
    item = ready()
    assert admit(item, POLICY, running_here=True) == Start(item, replaces_own=True)


def test_an_ended_request_is_only_acknowledged() -> None:
    item = ready(finished=True, engine_failures=9, deliveries=9, delivered_ids=[5, 6], delivered_text="ab")
    answer = admit(item, POLICY)
    assert isinstance(answer, Answer) and answer.event is None and not answer.rejected
    assert answer.seq == 2 and answer.output == ("ab", [5, 6]) and answer.entry_id == b"1-0"
    target = answer.target  # fenced by the attempt, where its events would have gone
    assert (target.request_id, target.attempt, target.lane, target.partition, target.notify) == (
        "r",
        2,
        "batch",
        1,
        "c",
    )


def refusal(item: Ready) -> tuple[Letter, ErrorEvent]:
    letter = admit(item, POLICY)
    assert isinstance(letter, Letter) and letter.answer is not None and isinstance(letter.answer.event, ErrorEvent)
    assert letter.entry_id == b"1-0" and letter.lane == "batch" and letter.raw == encode(item.accepted.request)
    assert letter.answer.target.attempt == item.attempt and not letter.answer.rejected
    assert letter.answer.event.message == f"the request was refused: {letter.reason}"
    return letter, letter.answer.event


def test_a_request_implicated_too_often_is_quarantined() -> None:
    letter, error = refusal(ready(engine_failures=2))
    assert error.code == ErrorCode.POISON_REQUEST and "2 engine failures" in letter.reason


def test_a_request_delivered_too_often_is_refused() -> None:
    letter, error = refusal(ready(deliveries=4, delivered_ids=[5], delivered_text="a"))
    assert error.code == ErrorCode.DELIVERY_LIMIT and "claimed 4 times" in letter.reason
    assert letter.answer is not None and letter.answer.seq == 1 and letter.answer.output == ("a", [5])
    item = ready(deliveries=3)
    assert admit(item, POLICY) == Start(item)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"cancelled": True}, "cancelled"),
        ({"delivered_ids": [5, 0]}, "eos"),
        ({"delivered_ids": [5, 6, 7, 8, 9]}, "length"),
    ],
)
def test_a_request_with_nothing_left_to_generate_completes(fields: dict, reason: str) -> None:
    item = ready(**fields)
    answer = admit(item, POLICY, now_ms=item.accepted.request.submitted + 70)
    assert isinstance(answer, Answer) and isinstance(answer.event, DoneEvent) and not answer.rejected
    assert answer.event.finish_reason == reason and answer.seq == len(item.delivered_ids)
    assert answer.event.usage.completion_tokens == len(item.delivered_ids) and answer.event.usage.prompt_tokens == 0
    assert answer.event.timings.total_ms == 70


def test_eos_is_not_an_end_when_the_request_ignores_it() -> None:
    request = GenerateRequest(id="r", input_ids=[3], params={"max_new_tokens": 5, "ignore_eos": True}, submitted=1)
    item = Ready(Accepted(b"1-0", request), 1, False, [5, 0], "", False)
    assert admit(item, POLICY) == Start(item)
