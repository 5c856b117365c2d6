"""Tool calls out of generated text: the syntaxes models write calls in, and the parser that splits an output,
as it streams, into message content and calls.

A worker generates a tool request's output under a grammar for its model's syntax (`worker.engine.tools`) and
names the syntax on each `tokens` event (`TokensEvent.tool_syntax`); readers parse `text` with it. The output on
the wire stays the text as generated, so resumes and duplicate chunks are handled as for any text, and a call's
id is derived from the request id: the same on every reader, every attempt and every retry.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolSyntax:
    """How a model family writes one call: `begin`, the function name, `middle`, the arguments (a JSON object),
    `end`. `template_marker` is the text its chat templates contain (how a worker recognises the syntax) and
    `grammar_key` xgrammar's name for the structural tag that generates it."""

    name: str
    begin: str
    middle: str
    end: str
    template_marker: str
    grammar_key: str


# Checked in this order against a chat template: Hermes' `<tool_call>` tags (Qwen2.5, Qwen3, Hermes, SmolLM3 and
# the many templates derived from them), then Llama 3.1's bare JSON object.
SYNTAXES: dict[str, ToolSyntax] = {
    "hermes": ToolSyntax(
        name="hermes",
        begin='<tool_call>\n{"name": "',
        middle='", "arguments": ',
        end="}\n</tool_call>",
        template_marker="<tool_call>",
        grammar_key="qwen_3",
    ),
    "llama3_json": ToolSyntax(
        name="llama3_json",
        begin='{"name": "',
        middle='", "parameters": ',
        end="}",
        template_marker='"parameters"',
        grammar_key="llama",
    ),
}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: `arguments` is its JSON text as generated (the OpenAI API's shape), valid under the
    function's schema unless the output was cut short (`finish_reason` `length`)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """New output of call `index`: its first delta carries `id` and `name` (and no arguments yet), later ones
    pieces of `arguments`, as OpenAI's streamed `tool_calls` deltas do."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def call_id(request_id: str, index: int) -> str:
    """Call `index`'s id: derived from the request's, so every reader of the request names its calls alike."""
    return "call_" + hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()[:24]


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolCallParser:
    """Splits one request's output, fed as it streams, into content and calls (`feed` returns each piece's new
    content and call deltas). Text that may open a call is held back until it does or cannot; whitespace after
    a call is content only if more content follows (a template's separator between calls is not an answer)."""

    def __init__(self, syntax: ToolSyntax, request_id: str) -> None:
        self.syntax = syntax
        self.request_id = request_id
        self.calls: list[_Call] = []
        self._state = "content"  # content -> name -> arguments -> end -> content
        self._buffer = ""  # content held back, or the name so far, or the end marker matched so far
        self._depth = 0  # the arguments' JSON nesting, and whether the scanner is inside a string or an escape
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        position = 0
        while position < len(text):
            position = getattr(self, f"_{self._state}")(text, position, content, deltas)
        return "".join(content), _merged(deltas)

    def finish(self) -> str:
        """The content still held back once the output has ended (none after a call, or inside one)."""
        held, self._buffer = self._buffer, ""
        return held if self._state == "content" and (not self.calls or held.strip()) else ""

    @property
    def in_arguments(self) -> bool:
        """Whether the output so far ends inside a call's arguments."""
        return self._state == "arguments"

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(call.id, call.name, "".join(call.arguments)) for call in self.calls]

    def _content(self, text: str, position: int, content: list[str], deltas: list[ToolCallDelta]) -> int:
        begin = self.syntax.begin
        buffer = self._buffer + text[position:]
        found = buffer.find(begin)
        if found >= 0:
            if not self._separator(buffer[:found]):
                content.append(buffer[:found])
            self._buffer, self._state = "", "name"
            return len(text) - (len(buffer) - found - len(begin))
        keep = _partial_suffix(buffer, begin)  # the start of a `begin` still to come
        if self._separator(buffer[: len(buffer) - keep]):
            self._buffer = buffer  # held whole: content only if more content follows
        else:
            content.append(buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep :]
        return len(text)

    def _separator(self, piece: str) -> bool:
        """Whether `piece` is nothing but the whitespace a template puts after a call (or nothing at all)."""
        return not piece or (bool(self.calls) and not piece.strip())

    def _name(self, text: str, position: int, content: list[str], deltas: list[ToolCallDelta]) -> int:
        middle = self.syntax.middle
        buffer = self._buffer + text[position:]
        found = buffer.find(middle)
        if found < 0:
            self._buffer = buffer
            return len(text)
        call = _Call(call_id(self.request_id, len(self.calls)), buffer[:found])
        self.calls.append(call)
        deltas.append(ToolCallDelta(len(self.calls) - 1, id=call.id, name=call.name))
        self._buffer, self._state = "", "arguments"
        self._depth, self._in_string, self._escaped = 0, False, False
        return len(text) - (len(buffer) - found - len(middle))

    def _arguments(self, text: str, position: int, content: list[str], deltas: list[ToolCallDelta]) -> int:
        start = position
        while position < len(text):
            char = text[position]
            position += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "end"
                    break
        piece = text[start:position]
        self.calls[-1].arguments.append(piece)
        deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))
        return position

    def _end(self, text: str, position: int, content: list[str], deltas: list[ToolCallDelta]) -> int:
        end = self.syntax.end
        while position < len(text):
            expected = end[len(self._buffer)]
            if text[position] != expected:  # not the syntax's end after all: what follows is content again
                self._buffer, self._state = "", "content"
                return position
            self._buffer += expected
            position += 1
            if self._buffer == end:
                self._buffer, self._state = "", "content"
                break
        return position


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument pieces of one call as one delta."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and last.index == delta.index and delta.id is None:
            merged[-1] = ToolCallDelta(last.index, last.arguments + delta.arguments, last.id, last.name)
        else:
            merged.append(delta)
    return merged
