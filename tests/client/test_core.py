"""The sans-I/O core: result accumulation, deadlines, URL redaction, errors, retry policy.

No redis-server here; where a client object is needed, fakeredis stands in.
"""

from __future__ import annotations

import itertools
import logging
from datetime import UTC, datetime, timedelta

import fakeredis
import pytest
import redis.client as redis_pipeline
from hypothesis import given
from hypothesis import strategies as st
from redis.exceptions import ResponseError

from client import (
    Cancelled,
    Client,
    ErrorCode,
    InvalidRequest,
    LimitExceeded,
    MalformedEntry,
    RequestExpired,
    RequestFailed,
    ResultTimeout,
    error_from_event,
)
from client import _core as core
from client import _mux as mux
from client._core import ResultBuilder, ResultReader, deadline_ms
from client._mux import MuxCore
from client.connection import redact_url
from client.protocol import (
    ChatMessage,
    DoneEvent,
    ErrorEvent,
    RequestLimits,
    TokensEvent,
    Usage,
    decode_request,
    encode,
)
from client.store import Keys
from client.sync import ResultMux


def chunk(seq: int, ids: list[int], text: str) -> TokensEvent:
    return TokensEvent(seq=seq, ids=ids, text=text)


DONE = DoneEvent(finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=4))


def feed_all(builder: ResultBuilder, *events: TokensEvent | DoneEvent | ErrorEvent) -> str:
    """The concatenated text of the deltas the builder produced."""
    return "".join(d.text for e in events if (d := builder.feed(e)) is not None)


def test_builder_in_order() -> None:
    builder = ResultBuilder("r")
    assert feed_all(builder, chunk(0, [1, 2], "ab"), chunk(2, [3], "c"), DONE) == "abc"
    result = builder.outcome(raise_cancelled=True)
    assert (result.text, result.token_ids, result.finish_reason) == ("abc", [1, 2, 3], "stop")
    assert result.usage.completion_tokens == 4


def test_builder_drops_duplicates_by_seq() -> None:
    builder = ResultBuilder("r")
    assert builder.feed(chunk(0, [1], "a")) is not None
    assert builder.feed(chunk(0, [1], "a")) is None
    assert builder.feed(chunk(1, [2], "b")).seq == 1  # type: ignore[union-attr]
    assert builder.feed(chunk(0, [1], "a")) is None
    assert (builder.text, builder.token_ids) == ("ab", [1, 2])


def test_builder_slices_a_merged_resend() -> None:
    # A writer that re-sends two chunks merged into one, starting at one of our chunk boundaries.
    builder = ResultBuilder("r")
    text = feed_all(builder, chunk(0, [1], "a"), chunk(1, [2], "b"), chunk(1, [2, 3, 4], "bcd"), DONE)
    assert text == "abcd"
    assert builder.token_ids == [1, 2, 3, 4]
    delta = ResultBuilder("r")
    delta.feed(chunk(0, [1, 2], "ab"))
    assert delta.feed(chunk(0, [1, 2, 3], "abc")) == core.Delta(text="c", token_ids=[3], seq=2)


def test_builder_aligns_a_resend_that_starts_inside_a_chunk() -> None:
    builder = ResultBuilder("r")
    feed_all(builder, chunk(0, [1, 2], "ab"))
    assert builder.feed(chunk(1, [2, 3], "bc")) == core.Delta(text="c", token_ids=[3], seq=2)


@pytest.mark.parametrize(
    ("seen", "resend"),
    [
        ([chunk(0, [1, 2], "ab")], chunk(1, [9, 3], "bc")),  # a stale writer that sampled differently
        ([chunk(0, [1, 2], "ab"), chunk(2, [3], "c")], chunk(1, [2, 3, 4], "Xcd")),
    ],  # text lines up nowhere
)
def test_builder_keeps_tokens_but_not_text_it_cannot_place(
    seen: list[TokensEvent], resend: TokensEvent, caplog: pytest.LogCaptureFixture
) -> None:
    builder = ResultBuilder("r")
    feed_all(builder, *seen)
    with caplog.at_level(logging.WARNING, logger="llmq.client"):
        delta = builder.feed(resend)
    assert delta is not None and delta.text == "" and delta.token_ids == resend.ids[-1:]
    assert "conflicting chunk" in caplog.text


def test_builder_rejects_a_gap() -> None:
    builder = ResultBuilder("r")
    builder.feed(chunk(0, [1], "a"))
    with pytest.raises(MalformedEntry, match="gap"):
        builder.feed(chunk(2, [3], "c"))


def test_builder_ignores_events_after_the_terminal_one() -> None:
    builder = ResultBuilder("r")
    feed_all(builder, chunk(0, [1], "a"), DONE, chunk(1, [2], "b"), ErrorEvent(code="internal", message="x"))
    assert builder.outcome(raise_cancelled=True).text == "a"


def test_builder_outcomes() -> None:
    failed = ResultBuilder("r1")
    failed.feed(ErrorEvent(code=ErrorCode.ENGINE_FAILED, message="boom", retryable=True))
    with pytest.raises(RequestFailed) as info:
        failed.outcome(raise_cancelled=False)
    assert (info.value.code, info.value.retryable, info.value.request_id) == ("engine_failed", True, "r1")

    cancelled = ResultBuilder("r2")
    feed_all(
        cancelled,
        chunk(0, [1], "a"),
        DoneEvent(finish_reason="cancelled", usage=Usage(prompt_tokens=1, completion_tokens=1)),
    )
    assert cancelled.outcome(raise_cancelled=False).finish_reason == "cancelled"
    with pytest.raises(Cancelled) as stopped:
        cancelled.outcome(raise_cancelled=True)
    assert stopped.value.result.text == "a"


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[int], list[str], list[TokensEvent]]:
    """An output cut into chunks, delivered in order with re-sends: merged runs that start at a chunk
    already delivered (or the next one) and may reach past what was delivered."""
    n = draw(st.integers(1, 30))
    ids = list(range(100, 100 + n))
    # Distinct (or empty) text per token: then a resend's text aligns with ours in exactly one way.
    texts = [f"<{i}>" if draw(st.booleans()) else "" for i in range(n)]
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n)) if n > 1 else set())
    bounds = [0, *cuts, n]
    chunks = list(itertools.pairwise(bounds))
    events: list[TokensEvent] = []
    for i, (a, b) in enumerate(chunks):
        if draw(st.booleans()):  # a run of chunks merged into one, from a delivered one to any later one
            first = draw(st.integers(0, i))
            start, end = chunks[first][0], chunks[draw(st.integers(first, len(chunks) - 1))][1]
            events.append(chunk(start, ids[start:end], "".join(texts[start:end])))
        events.append(chunk(a, ids[a:b], "".join(texts[a:b])))
    return ids, texts, events


@given(deliveries())
def test_builder_resends_never_change_the_output(case: tuple[list[int], list[str], list[TokensEvent]]) -> None:
    ids, texts, events = case
    builder = ResultBuilder("r")
    deltas = [d for e in events if (d := builder.feed(e)) is not None]
    assert [t for d in deltas for t in d.token_ids] == ids == builder.token_ids
    assert "".join(d.text for d in deltas) == "".join(texts) == builder.text
    assert [d.seq for d in deltas] == [sum(len(x.token_ids) for x in deltas[:i]) for i in range(len(deltas))]


def test_deadline_ms() -> None:
    now = 1_000_000
    assert deadline_ms(None, now) is None
    assert deadline_ms(2.5, now) == now + 2500
    assert deadline_ms(timedelta(minutes=1), now) == now + 60_000
    assert deadline_ms(datetime(2030, 1, 1, tzinfo=UTC), now) == 1_893_456_000_000
    with pytest.raises(ValueError, match="positive"):
        deadline_ms(-1, now)
    with pytest.raises(TypeError):
        deadline_ms(True, now)  # type: ignore[arg-type]
    for absurd in (float("inf"), float("nan"), 1.7976931348623157e308, 1e300):
        with pytest.raises(InvalidRequest, match="deadline"):
            deadline_ms(absurd, now)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://:hunter2@localhost:6379/0", "redis://:***@localhost:6379/0"),
        ("rediss://alice:hunter2@cache.example:6380/1", "rediss://alice:***@cache.example:6380/1"),
        ("redis://alice:p%40ss@h/0", "redis://alice:***@h/0"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("code", "cls"),
    [(ErrorCode.EXPIRED, RequestExpired), (ErrorCode.INTERNAL, RequestFailed), ("brand_new", RequestFailed)]
    + [(c, RequestFailed) for c in ErrorCode if c is not ErrorCode.EXPIRED],
)
def test_error_from_event(code: str, cls: type[RequestFailed]) -> None:
    error = error_from_event(ErrorEvent(code=code, message="why"), "r9")
    assert type(error) is cls
    assert error.code == str(code) and error.message == "why"
    assert "r9" in str(error) and str(code) in str(error)


def test_result_timeout_says_what_it_waited_for() -> None:
    first = ResultTimeout("r1", 2.0, 0)
    assert isinstance(first, TimeoutError)
    assert "'r1'" in str(first) and "first event" in str(first)
    assert "'done' event after 7 tokens" in str(ResultTimeout("r1", 2.0, 7))


def test_the_reader_retries_with_capped_backoff_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(mux.time, "monotonic", lambda: clock[0])
    reading = MuxCore(Keys("default"), "c1")
    delays = [reading.retry_delay(ConnectionError("down")) for _ in range(8)]
    doubling = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]  # jittered: each drawn from the upper half of these
    assert all(full / 2 <= delay <= full for delay, full in zip(delays, doubling, strict=True))  # type: ignore[operator]
    clock[0] += mux.RECONNECT_BUDGET_S + 1
    assert reading.retry_delay(ConnectionError("still down")) is None
    reading.route([])  # a successful read resets the budget
    assert 0.025 <= reading.retry_delay(ConnectionError("again")) <= 0.05  # type: ignore[operator]


def test_the_reader_blocks_under_the_socket_timeout() -> None:
    assert mux.max_block_ms(None) == mux.BLOCK_S * 1000 and mux.max_block_ms(1.0) == 500


def test_a_job_times_out_by_its_own_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(core.time, "monotonic", lambda: clock[0])
    reader = ResultReader("r", "k")
    assert reader.remaining_s(0.0, None) is None and reader.remaining_s(0.0, 0.3) == 0.3
    clock[0] = 0.3
    with pytest.raises(ResultTimeout):
        reader.remaining_s(0.0, 0.3)


def test_new_followers_are_read_at_once_in_chunks_with_the_wake_stream() -> None:
    keys = Keys("default")
    reading = MuxCore(keys, "c1")
    idle = reading.plan(0.0)
    assert idle.chunks == [{keys.wake("c1"): "0-0"}] and idle.block_ms is not None
    followers = [reading.follow(keys.result(f"r{i}"), b"0-0", None) for i in range(mux.CHUNK_KEYS + 3)]
    first = reading.plan(1.0)
    assert first.block_ms is None and [len(c) for c in first.chunks] == [mux.CHUNK_KEYS + 1, 3]
    assert keys.wake("c1") in first.chunks[0]
    for follower in followers:
        reading.unfollow(follower)
    assert reading.idle


def test_between_sweeps_only_the_streams_a_notice_names_are_read() -> None:
    keys = Keys("default")
    reading = MuxCore(keys, "c1")
    for i in range(600):
        reading.follow(keys.result(f"r{i}"), b"0-0", None)
    reading.plan(0.0)  # every new follower, and the first sweep chunk
    waiting = reading.plan(0.01)  # nothing has news and the next sweep chunk is 40 ms away: block on the wake stream
    assert waiting.chunks == [{keys.wake("c1"): "0-0"}] and waiting.block_ms == 40
    notice = {b"r": f"{keys.result('r7')} {keys.result('r500')} {keys.result('gone')}".encode()}
    reading.route({keys.wake("c1").encode(): [[b"5-1", notice]]})
    told = reading.plan(0.02)
    assert told.block_ms is None and set(told.chunks[0]) == {keys.wake("c1"), keys.result("r7"), keys.result("r500")}
    assert told.chunks[0][keys.wake("c1")] == "5-1"
    swept: set[str] = set()
    for step in range(3):  # the first sweep reads every stream, one chunk per step
        chunks = reading.plan(0.05 * (step + 1)).chunks
        swept |= {str(key) for chunk in chunks for key in chunk}
    assert {keys.result(f"r{i}") for i in range(256, 600)} <= swept
    again: set[str] = set()
    for step in range(3):  # the next one only those no notice has named
        chunks = reading.plan(0.2 + 0.05 * step).chunks
        again |= {str(key) for chunk in chunks for key in chunk}
    assert keys.result("r7") not in again and keys.result("r500") not in again
    assert {keys.result(f"r{i}") for i in range(600) if i not in (7, 500)} <= again


def _noticed_reader(keys: Keys, count: int) -> MuxCore:
    """A reader of `count` streams after its first sweep, every stream named by a notice."""
    reading = MuxCore(keys, "c1")
    for i in range(count):
        reading.follow(keys.result(f"r{i}"), b"0-0", None)
    reading.plan(0.0)
    names = " ".join(keys.result(f"r{i}") for i in range(count)).encode()
    reading.route({keys.wake("c1").encode(): [[b"5-1", {b"r": names}]]})
    reading.plan(0.01)  # the streams the notice named
    return reading


def test_streams_that_notices_cover_are_swept_once_a_quiet_period() -> None:
    keys = Keys("default")
    reading = _noticed_reader(keys, 3)
    waiting = reading.plan(0.02)  # no fast sweep is due: the read blocks until the quiet sweep
    assert waiting.chunks == [{keys.wake("c1"): "5-1"}] and waiting.block_ms == 980
    assert reading.plan(0.5).block_ms == 500
    quiet = reading.plan(mux.QUIET_SWEEP_S)
    assert quiet.block_ms is None and set(quiet.chunks[0]) == {keys.wake("c1")} | {
        keys.result(f"r{i}") for i in range(3)
    }


def test_a_sweep_that_finds_entries_no_notice_named_puts_the_stream_back_on_the_fast_sweep() -> None:
    keys = Keys("default")
    reading = _noticed_reader(keys, 2)
    reading.plan(mux.QUIET_SWEEP_S)  # the quiet sweep reads both
    event = [[b"7-0", {b"m": encode(chunk(0, [1], "a"))}]]
    reading.route({keys.result("r0").encode(): event})  # news without a notice: a trimmed wake stream, say
    assert reading.plan(mux.QUIET_SWEEP_S + 0.01).block_ms == 40
    fast = reading.plan(mux.QUIET_SWEEP_S + 0.05)
    assert set(fast.chunks[0]) == {keys.wake("c1"), keys.result("r0")}


def test_a_stream_followed_again_after_its_notice_waits_for_a_new_one() -> None:
    keys = Keys("default")
    reading = _noticed_reader(keys, 1)
    (follower,) = reading.followers()
    reading.unfollow(follower)
    reading.follow(keys.result("r1"), b"0-0", None)  # a new stream, no notice yet: the fast sweep is due again
    reading.plan(0.02)  # read at once, as every new follower is
    assert reading.plan(0.03).block_ms == 20


def test_entries_read_with_the_notice_that_names_them_keep_the_quiet_sweep() -> None:
    keys = Keys("default")
    reading = _noticed_reader(keys, 1)
    reading.plan(mux.QUIET_SWEEP_S)  # the quiet sweep reads the stream, and the wake stream with it
    event = [[b"7-0", {b"m": encode(chunk(0, [1], "a"))}]]
    notice = [[b"7-1", {b"r": keys.result("r0").encode()}]]
    routed = reading.route({keys.wake("c1").encode(): notice, keys.result("r0").encode(): event})
    assert len(routed) == 1
    reading.plan(mux.QUIET_SWEEP_S + 0.01)  # the stream the notice named, read again
    assert reading.plan(mux.QUIET_SWEEP_S + 0.02).block_ms == 980


def test_a_key_of_another_type_fails_its_followers_only_and_the_round_is_read_again() -> None:
    keys = Keys("default")
    reading = MuxCore(keys, "c1")
    good, bad = keys.result("good"), keys.result("bad")
    followers = {key: reading.follow(key, b"0-0", None) for key in (good, bad)}
    reading.plan(0.0)  # the round that failed with WRONGTYPE
    assert not mux.is_wrong_type(ConnectionError("down"))
    assert mux.is_wrong_type(
        ResponseError("Command # 1 (XREAD ...) of pipeline caused error: WRONGTYPE Operation against a key")
    )
    failed = reading.drop_wrong_types({good: b"stream", bad: b"string"})
    assert [(follower, type(error)) for follower, error in failed] == [(followers[bad], MalformedEntry)]
    assert bad in str(failed[0][1]) and "string" in str(failed[0][1])
    assert reading.followed_keys() == [good]
    assert good in reading.plan(0.01).chunks[0]  # read again at once, not after a backoff


def test_a_failed_round_reads_every_stream_again() -> None:
    keys = Keys("default")
    reading = MuxCore(keys, "c1")
    for i in range(3):
        reading.follow(keys.result(f"r{i}"), b"0-0", None)
    reading.plan(0.0)
    assert reading.plan(0.01).block_ms is not None
    reading.retry_delay(ConnectionError("down"))
    assert len(reading.plan(0.02).chunks[0]) == 4


def test_a_stream_that_filled_its_count_is_read_again() -> None:
    keys = Keys("default")
    reading = MuxCore(keys, "c1")
    reading.follow(keys.result("r"), b"0-0", None)
    reading.plan(0.0)
    entries = [(f"{i + 1}-0".encode(), {b"m": b""}) for i in range(mux.ENTRIES_PER_STREAM)]
    reading.route([[keys.result("r").encode(), entries]])
    again = reading.plan(0.01)
    assert again.block_ms is None and again.chunks[0][keys.result("r")] == f"{mux.ENTRIES_PER_STREAM}-0"


def test_entries_are_routed_past_each_followers_last_id_in_resp2_and_resp3() -> None:
    keys = Keys("default")
    reading = MuxCore(keys, "c1")
    event = {b"m": encode(chunk(0, [1], "a"))}
    early, late = reading.follow(keys.result("r"), b"0-0", "early"), reading.follow(keys.result("r"), b"9-0", "late")
    assert reading.plan(0.0).chunks[0][keys.result("r")] == "0-0"  # the slowest follower decides where to read from
    key = keys.result("r").encode()
    routed = reading.route([[key, [(b"9-0", event), (b"10-0", event)]]])  # 10-0 sorts after 9-0 as an id
    assert [(f.inbox, entry_id) for f, entry_id, _ in routed] == [
        ("early", b"9-0"),
        ("early", b"10-0"),
        ("late", b"10-0"),
    ]
    assert reading.route({key: [[b"10-0", event]]}) == []  # RESP3 shape; nothing new
    reading.route({keys.wake("c1").encode(): [[b"5-1", {b"w": b"1"}]]})
    assert reading.plan(0.01).chunks[0][keys.wake("c1")] == "5-1" and early.last_id == late.last_id == (10, 0)


# --- building requests (no Redis is touched) -----------------------------------------------------


@pytest.fixture
def client() -> Client:
    return Client(redis=fakeredis.FakeRedis(), limits=RequestLimits(max_new_tokens=300), result_ttl=60)


def test_build_request_fills_the_envelope(client: Client) -> None:
    request = client.build_request(
        None,
        messages=[{"role": "user", "content": "hi"}],
        input_ids=None,
        deadline=10,
        request_id=None,
        params={"temperature": 0.0, "stop": None, "seed": 3},
    )
    assert len(request.id) == 32 and request.result_ttl == 60
    assert request.deadline is not None and request.deadline - request.submitted == 10_000
    assert request.params.temperature == 0.0 and request.params.stop == [] and request.params.seed == 3
    assert decode_request(encode(request)) == request


def test_build_request_takes_chat_message_models(client: Client) -> None:
    request = client.build_request(
        None,
        messages=[ChatMessage(role="system", content="be brief"), {"role": "user", "content": "hi"}],
        input_ids=None,
        deadline=None,
        request_id="chat-1",
        params={},
    )
    assert [m.role for m in request.messages or ()] == ["system", "user"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt": None},
        {"prompt": "a", "input_ids": [1]},
        {"temperature": -1.0},
        {"temperature": "0.5"},
        {"top_p": 0.0},
        {"max_new_tokens": True},
        {"stop": [""]},
        {"request_id": "has space"},
        {"request_id": "x" * 129},
        {"deadline": -5},
    ],
)
def test_submit_validates_before_touching_redis(kwargs: dict[str, object]) -> None:
    unreachable = Client("redis://127.0.0.1:1/0")  # nothing listens there: any Redis call would fail
    kwargs = {"prompt": "hello", **kwargs}
    with pytest.raises(ValueError) as info:
        unreachable.submit(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, InvalidRequest) or "deadline" in str(info.value)


def test_submit_enforces_limits(client: Client) -> None:
    with pytest.raises(LimitExceeded, match="max_new_tokens"):
        client.submit("hello", max_new_tokens=301)


def test_client_refuses_decoded_responses() -> None:
    with pytest.raises(ValueError, match="decode_responses"):
        Client(redis=fakeredis.FakeRedis(decode_responses=True))


def test_ssl_ca_certs_needs_rediss() -> None:
    with pytest.raises(ValueError, match="rediss"):
        Client("redis://:pw@localhost/0", ssl_ca_certs="/etc/ca.pem")
    tls = Client("rediss://:pw@localhost/0", ssl_ca_certs="/etc/ca.pem")
    assert tls._redis.connection_pool.connection_kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    assert "pw" not in repr(tls) and "***" in repr(tls)


def test_a_sync_wake_after_close_sends_nothing_and_a_pool_closed_under_it_is_no_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wake is a timer that may fire after the client closed: it must send nothing then, and a wake in flight
    when the pool closes under it (redis-py then fails with non-Redis errors) must not escape its thread."""
    redis = fakeredis.FakeRedis()
    keys = Keys("default")
    wake_key = MuxCore(keys, "c1").wake_key
    results = ResultMux(redis, keys, "c1", None)
    results._wake()
    assert redis.xlen(wake_key) == 1, "an open client's wake is sent"
    results.close()
    results._wake()
    assert redis.xlen(wake_key) == 1, "a closed client's wake is not"

    in_flight = ResultMux(redis, keys, "c2", None)

    def pool_closed_under_it(self: object) -> None:
        in_flight.close()
        raise AttributeError("'NoneType' object has no attribute 'readline'")

    monkeypatch.setattr(redis_pipeline.Pipeline, "execute", pool_closed_under_it)
    in_flight._wake()  # no error: the client closed meanwhile
    with pytest.raises(AttributeError):
        ResultMux(redis, keys, "c3", None)._wake()  # not closed: a real fault is not hidden


def test_a_follower_that_joins_while_a_later_read_is_in_flight_gets_no_gap() -> None:
    """A job streamed, abandoned and streamed again follows anew from its last consumed entry, while the
    abandoned follower's read from a later entry may be in flight: that reply must not skip the entries between."""
    keys = Keys("default")
    reading = MuxCore(keys, "c1")
    key = keys.result("r")
    ahead = reading.follow(key, b"2-0", None)
    assert reading.plan(0.0).chunks[0][key] == "2-0"  # the read in flight starts after entry 2
    behind = reading.follow(key, b"1-0", None)  # joins now, from entry 1
    routed = reading.route([[key.encode(), [(b"3-0", {b"m": b""})]]])
    assert [(follower, entry_id) for follower, entry_id, _ in routed] == [(ahead, b"3-0")]
    assert reading.plan(0.01).chunks[0][key] == "1-0"  # read again from where `behind` stands
    routed = reading.route([[key.encode(), [(b"2-0", {b"m": b""}), (b"3-0", {b"m": b""})]]])
    assert [(follower, entry_id) for follower, entry_id, _ in routed] == [(behind, b"2-0"), (behind, b"3-0")]
