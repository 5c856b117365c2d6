"""OpenAI chat/completions bodies as `submit` arguments, and results as OpenAI response bodies: one translation,
shared by `llmq batch` (`client/batch.py`) and the HTTP gateway (`gateway/`).

Pure functions, no I/O. A field we cannot honour is refused by name (`FieldError`), never ignored: knobs the engine
does not implement (`best_of > 1`, `logit_bias`, the legacy `functions`, ...) are accepted only at their no-op
values, which some SDKs send by default; a few hints that change no answer (`prompt_cache_key`,
`prompt_cache_options`, `prompt_cache_retention`, `safety_identifier`, `metadata`, a message's `name`) are accepted
with any value of their type and dropped (docs/gateway.md lists what the popular SDKs send). `seed`,
`logprobs`/`top_logprobs`, completions' `echo` (with the prompt's logprobs), the penalties and `response_format`
(`text`, `json_object`, `json_schema`, and llmq's `regex`) are applied per request; `n` choices are `n` requests
(`Translated.choice`). Chat's `tools`, `tool_choice` and `parallel_tool_calls` go to the worker, whose model's chat
template renders the tools and whose grammar makes the calls; calls come back as `message.tool_calls` with
`finish_reason` `tool_calls`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from client._core import TokenLogprob
from client.errors import InvalidRequest
from client.protocol import MAX_N, Lane, SamplingParams, Tool, Usage
from client.protocol import ToolCall as WireToolCall
from client.tool_calls import ToolCall

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# OpenAI's (and vLLM's) default for /v1/completions; chat has none, so the queue's default applies there.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
# Tool calling: chat only, as OpenAI has it (completions have no messages for a template to render tools in).
_CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")

_PASSED = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
_SUPPORTED = {"model", "max_tokens", "max_completion_tokens", "stop", "logprobs", "top_logprobs", "response_format"}
_SUPPORTED |= {"user", "stream", "stream_options", "service_tier", "echo", "n", *_CHAT_ONLY, *_PASSED}
# Hints for OpenAI's own cache, abuse detection and stored completions: accepted with any value of their type and
# dropped, since none changes the answer (llmq stores nothing and caches prefixes by itself).
_IGNORED: dict[str, type] = {"prompt_cache_key": str, "prompt_cache_retention": str, "prompt_cache_options": dict}
_IGNORED |= {"safety_identifier": str, "metadata": dict}
# Fields accepted only at a value that changes nothing (compared with their type: `0` is not `False`).
_NO_OP: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "logit_bias": ({},),
    "functions": ([],),  # the legacy form of `tools`
    "function_call": ("none",),
    "suffix": ("",),
    "store": (False,),
    "modalities": (["text"],),
}
_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id"}
_MESSAGE_IGNORED = {"name"}  # a participant's name: chat templates show role and content only (as vLLM does)
_STREAM_OPTIONS = {"include_usage", "include_obfuscation"}  # obfuscation pads chunks against side channels: no-op
# OpenAI's newer name for the system role; chat templates know "system".
_ROLES = {"developer": "system"}
_OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")  # not the legacy "function": use tools
# `service_tier` -> llmq lane (`submit(priority=...)`).
TIERS: dict[str, Lane] = {"auto": "default", "default": "default", "priority": "interactive", "flex": "batch"}


class FieldError(InvalidRequest):
    """A body field we cannot honour; `field` is its OpenAI name (e.g. `n`, `messages[0].content`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class Translated:
    """A body as `submit` keyword arguments (`options`), plus what the HTTP side needs to answer it."""

    options: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    lane: Lane = "default"
    max_tokens_field: str = "max_tokens"  # the field that carried the token budget, for errors that name it
    echo: bool = False  # completions' `echo: true`: the answer starts with the prompt (`echo_of`)
    n: int = 1  # how many choices: `submit(n=...)`, one request each


def lane_for(service_tier: object) -> Lane:
    """The lane an OpenAI `service_tier` maps to (absent = `auto`): `priority` -> interactive, `auto` and
    `default` -> default, `flex` -> batch. The one place the mapping lives."""
    tier = "auto" if service_tier is None else service_tier
    if not isinstance(tier, str) or tier not in TIERS:
        raise FieldError("service_tier", f"must be one of {', '.join(TIERS)}, not {service_tier!r}")
    return TIERS[tier]


def translate(body: dict[str, Any], url: str, *, echo_allowed: bool = False, n_allowed: bool = False) -> Translated:
    """An OpenAI chat (`CHAT`) or completions (`COMPLETIONS`) body as `submit` arguments; raises `FieldError`
    naming the first field it cannot honour. Sampling values are checked against `BOUNDS` here too, so the
    error names the OpenAI field (`max_tokens`, not `params.max_new_tokens`). `echo: true` is refused unless
    `echo_allowed` (a caller that answers with `echo_of`: the gateway, not yet `llmq batch`), `n` above 1 unless
    `n_allowed` (a caller that answers with every choice: the gateway and the batches)."""
    source = "messages" if url == CHAT else "prompt"
    _refuse_unsupported(body, source)
    if body.get(source) is None:
        raise FieldError(source, f"{url} needs {source}")
    out = Translated(options=_input(source, body[source]))
    out.model = _optional(body, "model", str)
    out.user = _optional(body, "user", str)
    out.stream = _optional(body, "stream", bool) or False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - _STREAM_OPTIONS:
            raise FieldError("stream_options", f"only {' and '.join(sorted(_STREAM_OPTIONS))} (booleans) are supported")
        out.include_usage = _optional(options, "include_usage", bool, "stream_options.include_usage") or False
        _optional(options, "include_obfuscation", bool, "stream_options.include_obfuscation")
    out.lane = lane_for(body.get("service_tier"))
    if body.get("service_tier") is not None:  # else the caller's default lane (`llmq batch`: batch)
        out.options["priority"] = out.lane
    params = _params(body, url)
    out.options |= _tools(body, url, params)
    out.echo = _echo(body, url, echo_allowed)
    # The prompt is scored only where the echo needs the worker: for `logprobs` (alternatives as it asks), for a
    # token-id prompt's texts, and for `max_tokens` 0 (a request that generates nothing must score). A string
    # prompt echoed without them is the prompt as sent, and keeps its cached prefix.
    if out.echo and (params.get("logprobs") or "input_ids" in out.options or params.get("max_new_tokens") == 0):
        params["prompt_logprobs"] = params.get("top_logprobs", 0)
    if body.get("max_completion_tokens") is not None:
        out.max_tokens_field = "max_completion_tokens"
    _check_params(params, url, out.max_tokens_field)
    out.n = _n(body, n_allowed)
    if out.n > 1 and params.get("seed") is not None:  # the last choice's seed must be one too
        _check_params(params | {"seed": params["seed"] + out.n - 1}, url, out.max_tokens_field)
    out.options |= params
    return out


def _refuse_unsupported(body: dict[str, Any], source: str) -> None:
    for name in sorted(body):
        value = body[name]
        if name in _SUPPORTED or name == source or value is None:  # null is JSON's "not set", as OpenAI reads it
            continue
        if name in _IGNORED:
            _optional(body, name, _IGNORED[name])
            continue
        if name not in _NO_OP:
            raise FieldError(name, "is not supported by llmq")
        if not any(type(value) is type(v) and value == v for v in _NO_OP[name]):
            raise FieldError(name, f"only {' or '.join(map(repr, _NO_OP[name]))} is supported, not {value!r}")


def _tools(body: dict[str, Any], url: str, params: dict[str, Any]) -> dict[str, Any]:
    """`tools` as `submit`'s (each checked against the wire's `Tool`, so an error names it), and `tool_choice` and
    `parallel_tool_calls` into `params`. An empty `tools` is none, as some frameworks send it."""
    if url != CHAT:
        for name in _CHAT_ONLY:
            if body.get(name) is not None:
                raise FieldError(name, f"is supported on {CHAT} only")
        return {}
    if body.get("tool_choice") is not None:
        params["tool_choice"] = body["tool_choice"]
    if _optional(body, "parallel_tool_calls", bool) is not None:
        params["parallel_tool_calls"] = body["parallel_tool_calls"]
    tools = body.get("tools")
    if tools is None or tools == []:
        return {}
    if not isinstance(tools, list):
        raise FieldError("tools", "must be an array of tools")
    for index, tool in enumerate(tools):
        try:
            Tool.model_validate(tool)
        except ValidationError as exc:
            raise _located(f"tools[{index}]", exc) from None
    return {"tools": tools}


def _n(body: dict[str, Any], allowed: bool) -> int:
    n = _optional(body, "n", int)
    if n is None or n == 1:
        return 1
    if not allowed:
        raise FieldError("n", f"only 1 is supported here, not {n!r}")
    if not 1 <= n <= MAX_N:
        raise FieldError("n", f"must be 1 to {MAX_N}, not {n!r}")
    return n


def _echo(body: dict[str, Any], url: str, allowed: bool) -> bool:
    if not _optional(body, "echo", bool):
        return False
    if url == CHAT:
        raise FieldError("echo", f"only false is supported on {CHAT} (OpenAI echoes prompts on {COMPLETIONS} only)")
    if not allowed:
        raise FieldError("echo", "only false is supported here")
    return True


def _optional(body: dict[str, Any], name: str, kind: type, label: str | None = None) -> Any:
    value = body.get(name)
    if value is not None and type(value) is not kind:
        raise FieldError(label or name, f"must be a {kind.__name__}")
    return value


def _input(source: str, value: Any) -> dict[str, Any]:
    if source == "messages":
        if not isinstance(value, list) or not value:
            raise FieldError("messages", "must be a non-empty array of messages")
        return {"messages": [_message(i, m) for i, m in enumerate(value)]}
    if isinstance(value, str):
        return {"prompt": value}
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
        if isinstance(value, str):
            return {"prompt": value}
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return {"input_ids": value}
    raise FieldError("prompt", "must be one string or one array of token ids (send one request per prompt)")


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise FieldError(where, "must be an object with role and content")
    if message.get("name") is not None and not isinstance(message["name"], str):
        raise FieldError(f"{where}.name", "must be a string")
    for key in sorted(set(message) - _MESSAGE_KEYS - _MESSAGE_IGNORED):
        if message[key] is not None:
            raise FieldError(f"{where}.{key}", "is not supported by llmq")
    role = message.get("role")
    if not isinstance(role, str) or role not in _OPENAI_ROLES:
        raise FieldError(f"{where}.role", f"must be one of {', '.join(_OPENAI_ROLES)}")
    out: dict[str, Any] = {"role": _ROLES.get(role, role)}
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        out["tool_calls"] = _tool_calls(f"{where}.tool_calls", role, calls)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise FieldError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        out["tool_call_id"] = call_id
    elif message.get("tool_call_id") is not None:
        raise FieldError(f"{where}.tool_call_id", "only a tool message answers a call")
    content = message.get("content")
    if content is None and "tool_calls" in out:  # an assistant message that only called tools
        return out
    out["content"] = _content(f"{where}.content", content)
    return out


def _content(where: str, content: Any) -> str:
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise FieldError(where, "only text content parts are supported")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise FieldError(where, "must be a string or an array of text parts")
    return content


def _tool_calls(where: str, role: str, calls: Any) -> list[dict[str, Any]]:
    """The calls an earlier answer made, as the conversation sends them back (`arguments`: their JSON text)."""
    if role != "assistant":
        raise FieldError(where, "only an assistant message carries tool_calls")
    if not isinstance(calls, list):
        raise FieldError(where, "must be an array of calls")
    out = []
    for index, call in enumerate(calls):
        try:
            out.append(WireToolCall.model_validate(call).model_dump())
        except ValidationError as exc:
            raise _located(f"{where}[{index}]", exc) from None
    return out


def _located(where: str, exc: ValidationError) -> FieldError:
    """The first error of a wire model's validation, named by its path under `where` (`tools[0].function.name`)."""
    error = exc.errors(include_url=False, include_input=False)[0]
    path = "".join(f".{part}" if isinstance(part, str) else f"[{part}]" for part in error["loc"])
    return FieldError(f"{where}{path}", error["msg"])


def _params(body: dict[str, Any], url: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None and url == COMPLETIONS:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    for name in _PASSED:
        if body.get(name) is not None:
            params[name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else stop
    params |= _logprobs(body, url)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        params["response_format"] = response_format
    return params


def _logprobs(body: dict[str, Any], url: str) -> dict[str, Any]:
    """Chat: `logprobs` (bool) and `top_logprobs` (alternatives); completions: `logprobs` (alternatives)."""
    logprobs = body.get("logprobs")
    if url == COMPLETIONS:
        if logprobs is None:
            return {}
        if type(logprobs) is not int:
            raise FieldError("logprobs", "must be an integer: how many alternatives per token (0 to 20)")
        return {"logprobs": True, "top_logprobs": logprobs}
    if logprobs is not None and type(logprobs) is not bool:
        raise FieldError("logprobs", "must be a boolean")
    top = body.get("top_logprobs")
    if not logprobs:
        if top:
            raise FieldError("top_logprobs", "needs logprobs: true")
        return {}
    return {"logprobs": True, "top_logprobs": top or 0}


def _check_params(params: dict[str, Any], url: str, max_tokens_field: str) -> None:
    try:
        SamplingParams.model_validate(params)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        # A check across fields has no location but names the field it blames (its wire name), when it does.
        blamed = getattr(error.get("ctx", {}).get("error"), "field", None)
        wire = blamed if isinstance(blamed, str) else f"params.{error['loc'][0]}" if error["loc"] else ""
        raise FieldError(openai_param(wire, url, max_tokens_field), error["msg"]) from None


def openai_param(wire: str, url: str, max_tokens_field: str = "max_tokens") -> str:
    """The OpenAI field behind a wire field (`prompt`, `messages`, `input_ids`, `params.<name>`), for an error that
    names what the caller sent: the input is the endpoint's `messages` or `prompt` (the gateway may have sent it
    as any of the three), `params.max_new_tokens` is `max_tokens_field`, and a completions request's
    `params.top_logprobs` is its `logprobs` (and `params.prompt_logprobs` its `echo`, which asked for them). A
    name with no OpenAI field stays as it is."""
    if wire in ("prompt", "messages", "input_ids"):
        return "messages" if url == CHAT else "prompt"
    name = wire.removeprefix("params.")
    if name == "max_new_tokens":
        return max_tokens_field
    if name == "top_logprobs" and url == COMPLETIONS:
        return "logprobs"
    if name == "prompt_logprobs" and url == COMPLETIONS:
        return "echo"
    return name


def usage_body(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass(frozen=True)
class Echo:
    """The prompt an `echo: true` completion starts with: its text, and when `logprobs` was asked its tokens' own
    texts and scores (the first None: nothing predicts it)."""

    text: str
    tokens: list[str] = field(default_factory=list)
    scores: list[TokenLogprob | None] | None = None  # one per token in `tokens`


def echo_of(
    asked: Translated, scores: list[TokenLogprob | None] | None, tokens: list[str] | None = None
) -> Echo | None:
    """What to echo for `asked` (None unless it asked), from the prompt's scores and its tokens' texts (a
    `Result`'s or a stream's first `Delta`'s `prompt_logprobs` and `prompt_tokens`). A string prompt is echoed as
    sent, a token-id prompt as its tokens' texts joined."""
    if not asked.echo:
        return None
    prompt = asked.options.get("prompt")
    text = prompt if isinstance(prompt, str) else "".join(tokens or [])
    if not asked.options.get("logprobs") or tokens is None or scores is None:
        return Echo(text)
    return Echo(text, tokens, scores)


def logprobs_body(
    url: str, logprobs: list[TokenLogprob] | None, text: str = "", text_offset: int = 0, echo: Echo | None = None
) -> dict[str, Any] | None:
    """Tokens' log-probabilities in OpenAI's shape: chat's `{"content": [...]}`, or completions' parallel lists
    (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`: where each token starts in `text`, the text these
    tokens produced, counted from `text_offset`). A completion's `echo` with scores comes first: its prompt's
    tokens (the first's `token_logprobs` and `top_logprobs` null), then these, counted on after its text."""
    if url == CHAT:
        if logprobs is None:
            return None
        content = [
            {
                **_token(lp.text, lp.logprob),
                "top_logprobs": [_token(text, value) for _, value, text in lp.top],
            }
            for lp in logprobs
        ]
        return {"content": content, "refusal": None}
    scored = echo if echo is not None and echo.scores is not None else None
    if logprobs is None and scored is None:
        return None
    body: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if scored is not None and scored.scores is not None:
        _extend(body, scored.tokens, scored.scores, scored.text, text_offset)
        text_offset += len(scored.text)
    if logprobs is not None:
        _extend(body, [lp.text for lp in logprobs], logprobs, text, text_offset)
    return body


def _extend(
    body: dict[str, list[Any]], tokens: list[str], scores: Sequence[TokenLogprob | None], text: str, start: int
) -> None:
    """Adds completions' lists for `tokens` (scored by `scores`, None for a token nothing predicts), which
    produced `text`, counting their offsets from `start`."""
    body["tokens"] += tokens
    body["token_logprobs"] += [None if lp is None else lp.logprob for lp in scores]
    body["top_logprobs"] += [None if lp is None else {text: value for _, value, text in lp.top} for lp in scores]
    body["text_offset"] += [start + offset for offset in token_offsets(tokens, text)]


def token_offsets(tokens: list[str], text: str) -> list[int]:
    """Where each token starts in `text`, the text they produced. A token's own decoding is not always its span:
    part of a multi-byte character decodes alone to U+FFFD (one character for 2-4 bytes, spread over tokens), and
    some tokenizers drop a token's leading space when decoding it alone. So a token holding U+FFFD starts where
    the text stands and the next token is looked for a little further on (as far as the pending U+FFFD tokens'
    length, plus one for a dropped space); a token not found there keeps the running count."""
    offsets, position, slack = [], 0, 1
    for token in tokens:
        offsets.append(position)
        if "\ufffd" in token:
            slack += len(token)
            continue
        found = text.find(token, position, position + slack + len(token)) if token else -1
        if found >= 0:
            offsets[-1] = position = found
        position += len(token)
        slack = 1
    return offsets


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def choice_body(
    url: str,
    index: int,
    text: str,
    finish_reason: str,
    logprobs: list[TokenLogprob] | None = None,
    echo: Echo | None = None,
    tool_calls: Sequence[ToolCall] | None = None,
) -> dict[str, Any]:
    """One choice of a whole answer: chat's `message` (with its `tool_calls`, its content null when it holds
    nothing else, as OpenAI's) or a completion's `text` (after `echo`'s)."""
    choice: dict[str, Any] = {"index": index}
    if url == CHAT:
        choice["message"] = {"role": "assistant", "content": text or (None if tool_calls else text)}
        if tool_calls:
            choice["message"]["tool_calls"] = [tool_call_body(call) for call in tool_calls]
    else:
        choice["text"] = (echo.text if echo is not None else "") + text
    choice["logprobs"] = logprobs_body(url, logprobs, text, echo=echo)
    choice["finish_reason"] = finish_reason_of(finish_reason, called=bool(tool_calls))
    return choice


def finish_reason_of(finish_reason: str, *, called: bool = False) -> str:
    """OpenAI's `finish_reason` for llmq's: `tool_calls` for an answer that called tools and ended by itself (one
    cut short stays `length`)."""
    reason = FINISH_REASONS.get(finish_reason, "stop")
    return "tool_calls" if called and reason == "stop" else reason


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def choices_body(
    url: str, request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage: Usage
) -> dict[str, Any]:
    """A whole answer with `choices` (`choice_body`s) and the `usage` of them all (`total_usage`)."""
    return {
        "id": request_id,
        "object": "chat.completion" if url == CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(usage),
    }
