"""Tool calling in the engine: which syntax a model's chat template writes calls in, and the grammar that makes
a request's output text and calls in that syntax, each call's arguments under its function's schema.

The grammar is xgrammar's structural tag for the model family (`ToolSyntax.grammar_key`), so `auto` allows text
and calls, `required` one or more calls and nothing else, a named choice exactly one call of that function. The
output stays text on the wire; readers split it with `client.tool_calls`, which names the same syntaxes.
"""

from __future__ import annotations

import json
from typing import Any

from client.tool_calls import SYNTAXES, ToolSyntax
from worker.engine.errors import RequestRejected
from worker.engine.types import OutputFormat

# Between the calls of an answer that is only calls (`required`): a line break, as templates write them.
CALL_SEPARATOR = "\n"
KNOWN = ", ".join(f"{name} ({syntax.template_marker})" for name, syntax in SYNTAXES.items())


def template_syntax(tokenizer: Any) -> ToolSyntax | str:
    """The syntax the tokenizer's chat template asks calls in, or why tools cannot be offered to this model."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        return "this model's chat template has no tool support: it does not render tools"
    for syntax in SYNTAXES.values():
        if syntax.template_marker in template:
            return syntax
    return f"this model's chat template renders tools in a syntax llmq does not know (it knows {KNOWN})"


def tools_format(syntax: ToolSyntax, tools: list[dict[str, Any]], choice: Any, parallel: bool) -> OutputFormat:
    """The grammar of a request that may call `tools` (`choice`: `auto`, `required` or a named function), as an
    `OutputFormat` whose spec is the structural tag serialized canonically: equal tool lists share a grammar."""
    try:
        from xgrammar import get_model_structural_tag
    except ImportError:
        raise RequestRejected("this worker cannot call tools: install llmq[constraints]", param="tools") from None
    try:
        tag = get_model_structural_tag(
            syntax.grammar_key,
            tools=[*tools],
            tool_choice="auto" if choice is None else choice,
            reasoning="disabled",
            parallel_tool_calls=parallel,
        )
    except (ValueError, TypeError) as error:
        raise RequestRejected(f"the tools do not make a grammar: {error}", param="tools") from None
    spec = tag.model_dump(mode="json")
    if choice == "required" and spec["format"]["type"] == "triggered_tags":  # calls only, as OpenAI's `required`
        calls = spec["format"]
        spec["format"] = {
            "type": "tags_with_separator",
            "tags": calls["tags"],
            "separator": CALL_SEPARATOR,
            "at_least_one": True,
            "stop_after_first": calls["stop_after_first"],
        }
    return OutputFormat("structural_tag", json.dumps(spec, separators=(",", ":")))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: a call's `arguments` (JSON text on the wire, as OpenAI sends them) as
    an object, as vLLM passes them; fields not set left out."""
    out = []
    for index, message in enumerate(messages):
        message = {key: value for key, value in message.items() if value is not None}
        if "tool_calls" in message:
            message["tool_calls"] = [_template_call(index, call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _template_call(index: int, call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except (TypeError, ValueError):
        raise RequestRejected(
            f"messages[{index}]: a tool call's arguments must be JSON text, not {function['arguments']!r:.60}",
            param="messages",
        ) from None
    return {**call, "function": {**function, "arguments": arguments}}
