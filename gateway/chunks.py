"""The streamed shapes of OpenAI's answers: `chat.completion.chunk` and streamed `text_completion` objects.
Whole answers are `client.openai_format.choices_body`, shared with `llmq batch`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from client import Delta
from client.openai_format import CHAT, Echo, finish_reason_of, logprobs_body, usage_body
from client.protocol import Usage
from client.tool_calls import ToolCallDelta


@dataclass(frozen=True)
class ChunkMaker:
    """Builds the chunks of one streamed answer (all share its id, creation time and model); each chunk carries
    one choice, named by its `index` (0 to `n` - 1), so the chunks of `n` choices can interleave."""

    url: str
    request_id: str
    model: str
    created: int

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.url == CHAT else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage_body(usage)
        return chunk

    def text(
        self,
        delta: Delta | None,
        *,
        first: bool = False,
        offset: int = 0,
        echo: Echo | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        """New text, with its tokens' log-probabilities when asked (completions count `text_offset` from
        `offset`, the text streamed before), and new output of tool calls; a chat stream's first chunk also carries
        the assistant role, and a completion stream's first chunk the prompt it echoes (`echo`, with its scores
        when asked)."""
        text = delta.text if delta is not None else ""
        logprobs = logprobs_body(self.url, delta.logprobs if delta is not None else None, text, offset, echo)
        text = (echo.text if echo is not None else "") + text
        if self.url == CHAT:
            content: dict[str, Any] = {"role": "assistant"} if first else {}
            calls = delta.tool_calls if delta is not None else None
            if text or not calls:
                content["content"] = text
            if calls:
                content["tool_calls"] = [_tool_call_delta(call) for call in calls]
            return self._chunk([{"index": index, "delta": content, "logprobs": logprobs, "finish_reason": None}])
        return self._chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}])

    def finish(self, finish_reason: str, index: int = 0, *, called: bool = False) -> dict[str, Any]:
        """The last chunk of choice `index`: `called` when its answer called tools."""
        reason = finish_reason_of(finish_reason, called=called)
        if self.url == CHAT:
            return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}])

    def usage(self, usage: Usage) -> dict[str, Any]:
        """`stream_options.include_usage`: a last chunk with no choices and the whole call's usage (all its
        choices': `total_usage`)."""
        return self._chunk([], usage)


def _tool_call_delta(call: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's streamed call: its first delta names it (`id`, `type`, `function.name`), later ones add to
    `function.arguments`."""
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    function = {"name": call.name, "arguments": call.arguments}
    return {"index": call.index, "id": call.id, "type": "function", "function": function}
