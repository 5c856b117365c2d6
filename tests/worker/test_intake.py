"""Intake decisions are pure: every kind of entry maps to accept, reject (an event) or dead letter."""

from __future__ import annotations

import msgpack
import pytest

from client.errors import ErrorCode
from client.protocol import GenerateRequest, RequestLimits, encode, ms_now
from worker.intake import Accepted, DeadLetter, Rejected, decide

LIMITS = RequestLimits()


def entry(data: dict | bytes) -> dict[bytes, bytes]:
    return {b"m": data if isinstance(data, bytes) else msgpack.packb(data)}


def valid(**fields: object) -> dict:
    base = {"v": 1, "id": "req-1", "prompt": "hi", "params": {"max_new_tokens": 4}, "submitted": ms_now()}
    return {**base, **fields}


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
        (msgpack.packb({"id": "x", "prompt": "no version"}), "version"),
    ],
)
def test_unreadable_entries_become_dead_letters(raw: bytes, reason: str) -> None:
    decision = decide(b"1-0", entry(raw), LIMITS)
    assert isinstance(decision, DeadLetter) and reason in decision.reason and decision.raw == raw


def test_entry_without_the_m_field_is_a_dead_letter() -> None:
    assert isinstance(decide(b"1-0", {b"x": b"1"}, LIMITS), DeadLetter)


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
    ],
)
def test_invalid_requests_are_answered_with_an_error(fields: dict, code: ErrorCode) -> None:
    decision = decide(b"1-0", entry(valid(**fields)), LIMITS)
    assert isinstance(decision, Rejected) and decision.code == code and decision.request_id == "req-1"


def test_expired_deadline_is_rejected_without_generation() -> None:
    now = ms_now()
    decision = decide(b"1-0", entry(valid(deadline=now - 1, result_ttl=60)), LIMITS, now_ms=now)
    assert isinstance(decision, Rejected) and decision.code == ErrorCode.EXPIRED and decision.result_ttl == 60
    assert isinstance(decide(b"1-0", entry(valid(deadline=now + 10_000)), LIMITS, now_ms=now), Accepted)
