"""Prompt logprobs on the client's side: the request field, the `prompt` event and how results assemble it."""

from __future__ import annotations

import msgpack
import pytest

from client._core import ResultBuilder, TokenLogprob
from client.errors import InvalidRequest, MalformedEntry
from client.protocol import (
    BOUNDS,
    DoneEvent,
    PromptEvent,
    SamplingParams,
    TokensEvent,
    Usage,
    decode_event,
    encode,
    parse_request,
)

PROMPT = PromptEvent(
    ids=[4, 5, 6],
    texts=["a", "b", "c"],
    logprobs=[None, (-1.5, [(5, -1.5, "b"), (9, -2.0, "z")]), (-0.25, [(6, -0.25, "c"), (4, -3.0, "a")])],
)
DONE = DoneEvent(finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=2))


def test_prompt_logprobs_is_bounded_like_top_logprobs_and_allows_zero_new_tokens() -> None:
    assert SamplingParams().prompt_logprobs is None
    assert SamplingParams(prompt_logprobs=0, max_new_tokens=0).max_new_tokens == 0
    bound = next(b for b in BOUNDS if b.field == "params.prompt_logprobs")
    top = next(b for b in BOUNDS if b.field == "params.top_logprobs")
    assert (bound.minimum, bound.maximum) == (top.minimum, top.maximum)
    for params, param in (
        ({"prompt_logprobs": top.maximum + 1}, "params.prompt_logprobs"),
        ({"prompt_logprobs": -1}, "params.prompt_logprobs"),
        ({"max_new_tokens": 0}, "params.max_new_tokens"),
    ):
        with pytest.raises(InvalidRequest) as info:
            parse_request({"v": 1, "id": "r", "prompt": "hi", "submitted": 1, "params": params})
        assert info.value.param == param


def test_the_prompt_event_round_trips_and_must_be_aligned() -> None:
    assert decode_event(encode(PROMPT)) == PROMPT
    raw = msgpack.packb({"v": 1, "type": "prompt", "ids": [1, 2], "texts": ["a"], "logprobs": [None, None]})
    with pytest.raises(MalformedEntry, match="one entry per prompt token"):
        decode_event(raw)


def test_the_result_carries_the_scored_prompt_once() -> None:
    builder = ResultBuilder("r")
    first = builder.feed(PROMPT)
    assert first is not None and first.token_ids == [] and first.text == ""
    expected = [
        None,
        TokenLogprob(5, -1.5, "b", [(5, -1.5, "b"), (9, -2.0, "z")]),
        TokenLogprob(6, -0.25, "c", [(6, -0.25, "c"), (4, -3.0, "a")]),
    ]
    assert first.prompt_logprobs == expected
    assert (first.prompt_token_ids, first.prompt_tokens) == ([4, 5, 6], ["a", "b", "c"])  # a stream's echo needs them
    assert builder.feed(TokensEvent(seq=0, ids=[7], text="x")) is not None
    assert builder.feed(PROMPT) is None  # written again (a retried write, a restarted attempt): already seen
    builder.feed(TokensEvent(seq=1, ids=[8], text="y"))
    builder.feed(DONE)
    result = builder.outcome(raise_cancelled=True)
    assert result.token_ids == [7, 8] and result.text == "xy"
    assert result.prompt_token_ids == [4, 5, 6] and result.prompt_tokens == ["a", "b", "c"]
    assert result.prompt_logprobs == expected
    assert result.as_dict()["prompt_logprobs"][1]["logprob"] == -1.5


def test_a_result_without_the_event_has_no_prompt_fields() -> None:
    builder = ResultBuilder("r")
    builder.feed(TokensEvent(seq=0, ids=[7], text="x"))
    builder.feed(DONE)
    result = builder.outcome(raise_cancelled=True)
    assert (result.prompt_token_ids, result.prompt_tokens, result.prompt_logprobs) == (None, None, None)
