"""Tool calls parsed out of streamed output: any split of the text gives the same content and calls, markup never
reaches the content, and a request's events assemble into `Result.tool_calls` and `Delta.tool_calls`."""

from __future__ import annotations

import json
import random

import pytest

from client._core import ResultBuilder
from client.protocol import DoneEvent, TokensEvent, Usage
from client.tool_calls import SYNTAXES, ToolCallDelta, ToolCallParser, ToolSyntax, call_id

pytestmark = pytest.mark.unit

ARGUMENTS = ['{"city": "Pa}ris\\"{", "days": [1, {"a": 2}]}', "{}", '{"q": "<tool_call>"}']


def written(syntax: ToolSyntax, content: str, calls: list[tuple[str, str]], separator: str = "\n") -> str:
    """The output a model of `syntax` writes: `content`, then each call, separated as templates do."""
    return content + separator.join(f"{syntax.begin}{name}{syntax.middle}{args}{syntax.end}" for name, args in calls)


def parsed(syntax: ToolSyntax, text: str, pieces: int, rng: random.Random) -> tuple[str, list[ToolCallDelta], str]:
    parser = ToolCallParser(syntax, "req-1")
    cuts = sorted(rng.sample(range(1, len(text)), min(pieces, len(text) - 1)))
    content, deltas = [], []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        piece_content, piece_deltas = parser.feed(text[start:end])
        content.append(piece_content)
        deltas += piece_deltas
    content.append(parser.finish())
    return "".join(content), deltas, json.dumps([vars(call) for call in parser.tool_calls()])


@pytest.mark.parametrize("syntax", SYNTAXES.values(), ids=SYNTAXES)
def test_any_split_of_the_output_gives_the_same_content_and_calls(syntax: ToolSyntax) -> None:
    rng = random.Random(7)
    calls = [("get_weather", ARGUMENTS[0]), ("noop", ARGUMENTS[1]), ("search", ARGUMENTS[2])]
    text = written(syntax, "Let me check. ", calls)
    whole = parsed(syntax, text, 0, rng)
    assert whole[0] == "Let me check. "
    assert [(c["name"], c["arguments"]) for c in json.loads(whole[2])] == calls
    for _ in range(200):
        content, deltas, calls_json = parsed(syntax, text, rng.randint(1, 40), rng)
        assert (content, calls_json) == (whole[0], whole[2])
        by_index: dict[int, list[ToolCallDelta]] = {}
        for delta in deltas:
            by_index.setdefault(delta.index, []).append(delta)
        for index, (name, arguments) in enumerate(calls):
            first, *rest = by_index[index]
            assert (first.id, first.name) == (call_id("req-1", index), name)  # the first delta names the call
            assert all(d.id is None and d.name is None for d in rest)
            assert "".join(d.arguments for d in by_index[index]) == arguments


def test_text_that_only_looks_like_the_start_of_a_call_is_content_in_the_end() -> None:
    syntax = SYNTAXES["hermes"]
    parser = ToolCallParser(syntax, "r")
    assert parser.feed("a <tool") == ("a ", [])  # held: it may open a call
    assert parser.feed("box> b") == ("<toolbox> b", [])
    assert parser.feed(" <tool_c") == (" ", [])
    assert parser.finish() == "<tool_c"  # the output ended there: it was content
    assert parser.tool_calls() == []


def test_whitespace_between_and_after_calls_is_no_content_but_text_after_them_is() -> None:
    syntax = SYNTAXES["hermes"]
    only_calls = written(syntax, "", [("a", "{}"), ("b", "{}")], separator="\n\n") + "\n"
    assert parsed(syntax, only_calls, 5, random.Random(1))[0] == ""
    after = written(syntax, "", [("a", "{}")]) + "\nDone."
    assert parsed(syntax, after, 5, random.Random(2))[0] == "\nDone."


def test_call_ids_are_derived_from_the_request_so_every_reader_agrees() -> None:
    assert call_id("r", 0) == call_id("r", 0) != call_id("r", 1) != call_id("s", 1)
    assert call_id("r", 0).startswith("call_")


def tokens(seq: int, ids: list[int], text: str, syntax: str | None = "hermes") -> TokensEvent:
    return TokensEvent(seq=seq, ids=ids, text=text, tool_syntax=syntax)


def test_a_tool_requests_events_assemble_into_content_calls_and_deltas() -> None:
    syntax = SYNTAXES["hermes"]
    text = written(syntax, "Hi <t", [("f", '{"x": 1}')])
    builder = ResultBuilder("req-9")
    chunks = [text[:4], text[4:9], text[9:30], text[30:]]
    deltas = []
    for index, chunk in enumerate(chunks):
        deltas.append(builder.feed(tokens(index, [index], chunk)))
    assert builder.feed(tokens(1, [1], chunks[1])) is None  # a duplicate chunk (a retried write) changes nothing
    builder.feed(DoneEvent(finish_reason="eos", usage=Usage(prompt_tokens=3, completion_tokens=4)))
    result = builder.outcome(raise_cancelled=False)
    assert result.text == "Hi <t" == "".join(d.text for d in deltas if d)  # "<t" held until it was no call
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls or []] == [(call_id("req-9", 0), "f", '{"x": 1}')]
    streamed = [call for d in deltas if d and d.tool_calls for call in d.tool_calls]
    assert streamed[0].name == "f" and "".join(c.arguments for c in streamed) == '{"x": 1}'


def test_held_back_content_comes_in_a_last_delta_when_the_output_ends() -> None:
    builder = ResultBuilder("r")
    assert builder.feed(tokens(0, [1, 2], "maybe <tool_")).text == "maybe "  # type: ignore[union-attr]
    last = builder.feed(DoneEvent(finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=2)))
    assert last is not None and (last.text, last.token_ids) == ("<tool_", [])
    result = builder.outcome(raise_cancelled=False)
    assert (result.text, result.tool_calls) == ("maybe <tool_", [])


def test_without_a_syntax_the_text_is_the_output_and_there_are_no_calls() -> None:
    builder = ResultBuilder("r")
    builder.feed(tokens(0, [1], '<tool_call>\n{"name": "f"', syntax=None))
    builder.feed(DoneEvent(finish_reason="eos", usage=Usage(prompt_tokens=1, completion_tokens=1)))
    result = builder.outcome(raise_cancelled=False)
    assert (result.text, result.tool_calls) == ('<tool_call>\n{"name": "f"', None)


def test_an_unknown_syntax_leaves_the_calls_in_the_text() -> None:
    builder = ResultBuilder("r")
    builder.feed(tokens(0, [1], "x", syntax="from-the-future"))
    builder.feed(DoneEvent(finish_reason="eos", usage=Usage(prompt_tokens=1, completion_tokens=1)))
    assert builder.outcome(raise_cancelled=False).text == "x"
