"""The llmq wire protocol, version 1: key names, message schemas and their msgpack codec.

Both sides import this module (the worker too), so it depends on nothing but pydantic and msgpack.
Every stream entry has one field, `m` (`ENTRY_FIELD`): a msgpack map whose first key is `v`.
Decoding never raises anything but a `ProtocolError` subclass, whatever the bytes; the error carries
the request id when one could be read, so a worker can still answer an invalid request.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgpack
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from client.errors import (
    InvalidRequest,
    LimitExceeded,
    MalformedEntry,
    RequestExpired,
    RequestFailed,
    UnsupportedVersion,
)

__all__ = [
    "AFFINITY_FIELD",
    "BOUNDS",
    "COST_FIELD",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_PREFIX",
    "DEFAULT_TENANT",
    "ENTRY_FIELD",
    "GREEDY_BELOW_TEMPERATURE",
    "LANES",
    "MAX_EPOCH_MS",
    "MAX_N",
    "MAX_NEW_TOKENS",
    "MAX_RESULT_TTL_S",
    "MAX_SEED",
    "MAX_TEMPERATURE",
    "MAX_TOKEN_ID",
    "MAX_TOOLS",
    "MAX_TOP_K",
    "MAX_TOP_LOGPROBS",
    "MIN_SEED",
    "NOTIFY_FIELD",
    "PROTOCOL_VERSION",
    "TENANT_FIELD",
    "TRACE_FIELD",
    "Bound",
    "ChatMessage",
    "Completion",
    "DeadLetterBody",
    "DoneEvent",
    "ErrorCode",
    "ErrorEvent",
    "Event",
    "FinishReason",
    "FunctionCall",
    "FunctionSpec",
    "GenerateRequest",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "Lane",
    "LimitSettings",
    "NamedToolChoice",
    "PrefixCacheInfo",
    "PromptEvent",
    "RegexFormat",
    "RequestLimits",
    "ResponseFormat",
    "SamplingParams",
    "Timings",
    "TokensEvent",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "Usage",
    "WorkerInfo",
    "decode_completion",
    "decode_dead_letter",
    "decode_event",
    "decode_request",
    "decode_trace",
    "decode_worker",
    "encode",
    "encode_trace",
    "error_from_event",
    "is_valid_name",
    "ms_now",
    "parse_request",
]

_T = TypeVar("_T")

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "llmq"
ENTRY_FIELD = b"m"
# Traffic classes, highest first: each is its own request stream (`Keys.lane`); workers fill free slots from the
# highest lane first, keep a share of slots for lower lanes that have work, and preempt lower lanes for
# `interactive` requests (handing them back, to be resumed from their published tokens).
Lane = Literal["interactive", "default", "batch"]
LANES: tuple[Lane, ...] = ("interactive", "default", "batch")

# A request entry's optional second field: the submitting client's id. Workers name every result stream they
# write to on that client's wake stream (`Keys.wake`), so its reader reads only streams with news. A hint
# outside the request, so a worker that predates it ignores it (and the client's sweep still reads).
NOTIFY_FIELD = b"n"
# A request entry's optional third field: the submitter's trace context, as its OpenTelemetry propagator wrote it
# (W3C `traceparent` and `tracestate`, by default), a msgpack map of strings (`encode_trace`). Outside the request
# too, so a worker that predates it ignores it, and a worker that cannot read it runs the request untraced.
TRACE_FIELD = b"t"
MAX_TRACE_BYTES = 4096  # a carrier this big is no trace context: it is ignored on both sides
# A request entry's optional fourth field: the hash of the start of its prompt (`client.affinity`), by which
# workers route it to the worker whose prefix cache likely holds that start. Outside the request too, so a worker
# that predates it ignores it.
AFFINITY_FIELD = b"k"
# A request entry's optional fifth and sixth fields: the tenant that owns it (who pays; `DEFAULT_TENANT` when the
# caller names none) and its estimated cost in tokens (`GenerateRequest.estimated_tokens`), by which workers share
# the fleet between tenants (`docs/tenants.md`). Outside the request too, so a worker that predates them ignores
# them.
TENANT_FIELD = b"o"
COST_FIELD = b"c"
DEFAULT_TENANT = "default"

# Request ids, queue names and prefixes end up inside key names and hash tags: no braces, no spaces.
_NAME_CHARS = r"[A-Za-z0-9._:-]{1,128}"
_NAME = re.compile(_NAME_CHARS)
_I64_MAX = 2**63 - 1  # msgpack carries 64-bit integers; bounding every count keeps encode() total


# --- bounds -------------------------------------------------------------------------------------
# Every numeric field's range, in one place: the client checks them before submitting and the worker after
# decoding, so a value the engine or Redis cannot take never gets past whichever side sees it first. Each
# bound is set by what the library (float32 sampling, int32 token ids and top-k) or Redis (`EXPIRE`, int64
# milliseconds) accepts; `RequestLimits` are the narrower, configurable limits inside them.

MAX_TOKEN_ID = 2**31 - 1  # the library holds token ids in int32 tensors; workers also check their vocabulary
DEFAULT_MAX_NEW_TOKENS = 256
MAX_NEW_TOKENS = 2**20  # absolute; a worker's `RequestLimits.max_new_tokens` (default 8192) is usually lower
MAX_TEMPERATURE = 100.0  # beyond it every distribution is uniform anyway
# Sampling divides float32 logits by the temperature: below about 1e-3 that overflows to inf/NaN, and long
# before that the distribution is one-hot. Smaller positive temperatures therefore decode greedily (vLLM
# clamps at the same point).
GREEDY_BELOW_TEMPERATURE = 0.01
MAX_TOP_K = 2**31 - 1  # int32 in the library; workers clamp it to their vocabulary
MAX_RESULT_TTL_S = 30 * 24 * 3600  # Redis refuses an EXPIRE whose deadline overflows int64 ms; 30 days is ample
MAX_EPOCH_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: deadlines and timestamps
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI bounds them
# Dividing logits by a smaller repetition penalty overflows float32 and poisons the whole batch's sampling.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0
MAX_SCHEMA_BYTES = 65536  # a response format's JSON schema or regex, serialized
MAX_TOOLS = 128  # functions one request may offer (OpenAI's limit); all of them, serialized, in MAX_SCHEMA_BYTES
TOOL_NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's function names
MAX_N = 16  # choices of one call (`submit(n=...)`, OpenAI's `n`): each is a request of its own in the queue


@dataclass(frozen=True)
class Bound:
    """One field's documented range (`minimum` and `maximum` inclusive unless `note` says otherwise)."""

    field: str
    minimum: int | float
    maximum: int | float
    note: str = ""


BOUNDS: tuple[Bound, ...] = (
    Bound(
        "params.max_new_tokens",
        1,
        MAX_NEW_TOKENS,
        "and at most the worker's LLMQ_MAX_NEW_TOKENS; also 0 with prompt_logprobs (score the prompt only)",
    ),
    Bound("params.temperature", 0.0, MAX_TEMPERATURE, f"below {GREEDY_BELOW_TEMPERATURE} (0 included) is greedy"),
    Bound("params.top_p", 0.0, 1.0, "0 excluded"),
    Bound("params.top_k", 0, MAX_TOP_K, "0 is off; clamped to the model's vocabulary"),
    Bound("params.seed", MIN_SEED, MAX_SEED, "the same seed gives the same tokens, in any batch, on any worker"),
    Bound("params.top_logprobs", 0, MAX_TOP_LOGPROBS, "alternatives per token; needs logprobs"),
    Bound("params.prompt_logprobs", 0, MAX_TOP_LOGPROBS, "alternatives per prompt token; absent: none"),
    Bound("params.repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, "1 is off; prompt and output"),
    Bound("params.presence_penalty", -MAX_PENALTY, MAX_PENALTY, "0 is off; tokens of the output"),
    Bound("params.frequency_penalty", -MAX_PENALTY, MAX_PENALTY, "0 is off; tokens of the output, by count"),
    Bound("params.response_format", 0, MAX_SCHEMA_BYTES, "bytes of its schema or regex, serialized"),
    Bound("tools", 1, MAX_TOOLS, f"functions; at most {MAX_SCHEMA_BYTES} bytes serialized, all together"),
    Bound("input_ids[]", 0, MAX_TOKEN_ID, "and below the model's vocabulary size"),
    Bound("deadline", 0, MAX_EPOCH_MS, "epoch ms"),
    Bound("submitted", 0, MAX_EPOCH_MS, "epoch ms"),
    Bound("result_ttl", 1, MAX_RESULT_TTL_S, "seconds"),
)


def ms_now() -> int:
    """Wall-clock time in epoch milliseconds, the unit of every timestamp on the wire."""
    return time.time_ns() // 1_000_000


# --- error codes ---------------------------------------------------------------------------------


class ErrorCode(StrEnum):
    """Why a request failed, as carried by an `error` event."""

    INVALID_REQUEST = "invalid_request"
    EXPIRED = "expired"
    UNSUPPORTED_VERSION = "unsupported_version"
    ENGINE_FAILED = "engine_failed"
    POISON_REQUEST = "poison_request"  # implicated in repeated engine failures; quarantined, never run again
    DELIVERY_LIMIT = "delivery_limit"
    INTERNAL = "internal"


# --- models -------------------------------------------------------------------------------------

_Count = Annotated[int, Field(strict=True, ge=0, le=_I64_MAX)]
_Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_Version = Annotated[int, Field(strict=True)]


class _Size:
    """Stands in for hidden text or token ids in reprs: their size, not their content."""

    def __init__(self, value: Any) -> None:
        self.size = len(value)

    def __repr__(self) -> str:
        return f"<{self.size} hidden>"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _hidden: ClassVar[frozenset[str]] = frozenset()

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, (_Size(value) if name in self._hidden and value is not None else value)


def _utf8(text: str) -> str:
    """Python strings may hold lone surrogates, which no UTF-8 encoder takes: refuse them where they enter."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("strings must be valid UTF-8 (this one holds a lone surrogate)") from None
    return text


_Text = Annotated[str, AfterValidator(_utf8)]
_EpochMs = Annotated[int, Field(strict=True, ge=0, le=MAX_EPOCH_MS)]
_TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]


def _schema_size(value: Any) -> Any:
    try:
        size = len(json.dumps(value, separators=(",", ":")).encode())
    except (TypeError, ValueError):
        raise ValueError("must be plain JSON") from None
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"serialized, it is over {MAX_SCHEMA_BYTES} bytes")
    return value


def _has_schema(value: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(value.get("schema"), dict):
        raise ValueError("needs 'schema', a JSON schema object (OpenAI's shape: name, schema, strict)")
    return value


class _FieldError(ValueError):
    """A check across fields that blames one of them: `field` is its wire name, for `InvalidRequest.param`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class JsonSchemaFormat(_Wire):
    """Output constrained to a JSON schema, in OpenAI's shape: `json_schema` = {`name`, `schema`, `strict`}."""

    type: Literal["json_schema"] = "json_schema"
    json_schema: Annotated[dict[str, Any], AfterValidator(_has_schema), AfterValidator(_schema_size)]


class JsonObjectFormat(_Wire):
    """Output constrained to any JSON object."""

    type: Literal["json_object"] = "json_object"


class RegexFormat(_Wire):
    """Output constrained to a regular expression."""

    type: Literal["regex"] = "regex"
    regex: Annotated[_Text, Field(min_length=1), AfterValidator(_schema_size)]


ResponseFormat = Annotated[JsonSchemaFormat | JsonObjectFormat | RegexFormat, Field(discriminator="type")]
_ToolName = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]


class FunctionSpec(_Wire):
    """A function the model may call, in OpenAI's shape; `parameters` is the JSON schema of its arguments (absent:
    any JSON object), which the arguments are generated under."""

    name: _ToolName
    description: _Text | None = None
    parameters: dict[str, Any] | None = None
    strict: Annotated[bool, Field(strict=True)] | None = None


class Tool(_Wire):
    """One of a request's `tools`: `{"type": "function", "function": {...}}`, as OpenAI's chat API takes it."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionName(_Wire):
    name: _ToolName


class NamedToolChoice(_Wire):
    """`tool_choice` naming the one function the answer must call."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _tools_size(tools: list[Tool]) -> list[Tool]:
    _schema_size([tool.model_dump(exclude_none=True) for tool in tools])
    return tools


def _choice_name(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"


class FunctionCall(_Wire):
    """A call the model made: `arguments` is its JSON text, as generated (OpenAI's shape)."""

    name: _ToolName
    arguments: _Text


class ToolCall(_Wire):
    """An assistant message's call, sent back in a conversation that goes on after the tool answered."""

    id: Annotated[_Text, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class SamplingParams(_Wire):
    """Decoding settings; ranges are `BOUNDS`."""

    max_new_tokens: Annotated[int, Field(strict=True, ge=0, le=MAX_NEW_TOKENS)] = DEFAULT_MAX_NEW_TOKENS
    temperature: Annotated[float, Field(strict=True, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_K)] = 0
    stop: list[Annotated[_Text, Field(min_length=1)]] = Field(default_factory=list)
    seed: Annotated[int, Field(strict=True, ge=MIN_SEED, le=MAX_SEED)] | None = None
    ignore_eos: Annotated[bool, Field(strict=True)] = False
    # Each generated token's log-probability (and `top_logprobs` alternatives), from the distribution it was
    # drawn from: after penalties, the response format's mask, temperature, top-k and top-p.
    logprobs: Annotated[bool, Field(strict=True)] = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)] = 0
    # Each prompt token's log-probability given the tokens before it, and this many alternatives (as vLLM's
    # `prompt_logprobs`): from the model's raw distribution, before any sampling setting. None: not computed.
    prompt_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    repetition_penalty: Annotated[
        float, Field(strict=True, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    ] = 1.0
    presence_penalty: Annotated[float, Field(strict=True, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(strict=True, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)] = 0.0
    response_format: ResponseFormat | None = None
    # With the request's `tools`: whether the answer may (`auto`, the default), must (`required`, or the function
    # named) or must not (`none`) call them; a call's arguments are generated under its function's schema, so a
    # request that may call tools has no `response_format` and no `ignore_eos`.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] = True

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise _FieldError("params.top_logprobs", "top_logprobs needs logprobs")
        if self.max_new_tokens == 0 and self.prompt_logprobs is None:
            raise _FieldError("params.max_new_tokens", "max_new_tokens may be 0 only with prompt_logprobs")
        if self.response_format is not None and self.ignore_eos:
            raise _FieldError(
                "params.response_format",
                "a response_format ends its output with EOS: ignore_eos cannot be combined with it",
            )
        return self


class ChatMessage(_Wire):
    """One message of a conversation. `content` may be absent only on an assistant message that made
    `tool_calls`; a `tool` message answers the call named by `tool_call_id` (the chat template renders both)."""

    _hidden = frozenset({"content", "tool_calls"})
    role: Annotated[_Text, Field(min_length=1)]
    content: _Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None
    tool_call_id: Annotated[_Text, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except on an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    def size(self) -> int:
        """UTF-8 bytes of what the message says (role, content, calls), the measure of `max_prompt_bytes`."""
        calls = sum(len(c.function.name) + len(c.function.arguments.encode()) for c in self.tool_calls or ())
        return len(self.role.encode()) + len((self.content or "").encode()) + calls


@dataclass(frozen=True)
class RequestLimits:
    """Upper bounds both sides enforce: the client before submitting, the worker after decoding."""

    max_prompt_bytes: int = 1_000_000
    max_input_ids: int = 131072
    max_new_tokens: int = 8192
    max_stop: int = 8
    max_stop_bytes: int = 256  # per stop string, UTF-8


class LimitSettings(BaseModel):
    """`RequestLimits` as settings fields (`LLMQ_MAX_PROMPT_BYTES`, ...), shared by the worker's and the gateway's
    settings classes, which mix it in."""

    max_prompt_bytes: int = Field(
        default=RequestLimits.max_prompt_bytes, ge=1, description="longest prompt a request may send, in UTF-8 bytes"
    )
    max_input_ids: int = Field(
        default=RequestLimits.max_input_ids, ge=1, description="most token ids a request may send"
    )
    max_new_tokens: int = Field(
        default=RequestLimits.max_new_tokens,
        ge=1,
        le=MAX_NEW_TOKENS,
        description="largest max_new_tokens a request may ask for",
    )
    max_stop: int = Field(default=RequestLimits.max_stop, ge=0, description="most stop strings a request may give")
    max_stop_bytes: int = Field(
        default=RequestLimits.max_stop_bytes, ge=1, description="longest stop string, in UTF-8 bytes"
    )

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(
            max_prompt_bytes=self.max_prompt_bytes,
            max_input_ids=self.max_input_ids,
            max_new_tokens=self.max_new_tokens,
            max_stop=self.max_stop,
            max_stop_bytes=self.max_stop_bytes,
        )


class GenerateRequest(_Wire):
    _hidden = frozenset({"prompt", "messages", "input_ids"})
    v: _Version = PROTOCOL_VERSION
    id: Annotated[str, Field(pattern=f"^{_NAME_CHARS}$")]
    prompt: Annotated[_Text, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    input_ids: Annotated[list[_TokenId], Field(min_length=1)] | None = None
    # Functions the model may call (`params.tool_choice` says whether it must): chat `messages` only, since the
    # model's chat template renders them.
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS), AfterValidator(_tools_size)] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    deadline: _EpochMs | None = None
    result_ttl: Annotated[int, Field(strict=True, ge=1, le=MAX_RESULT_TTL_S)] = 3600  # s
    submitted: _EpochMs
    # The final result is also appended to the shared stream `{<queue>}:reply:<reply_to>` (`Completion`).
    reply_to: Annotated[str, Field(pattern=f"^{_NAME_CHARS}$")] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        given = [self.prompt is not None, self.messages is not None, self.input_ids is not None]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, messages, input_ids is required")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        choice = self.params.tool_choice
        if self.tools is None:
            if choice is not None and choice != "none":
                raise _FieldError("params.tool_choice", f"tool_choice {_choice_name(choice)} needs tools")
            return
        if self.messages is None:
            raise _FieldError("tools", "tools need messages: the model's chat template renders them")
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise _FieldError("tools", "function names must be unique")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _FieldError("params.tool_choice", f"names {choice.function.name!r}, which is not one of the tools")
        if choice == "none":
            return
        if self.params.response_format is not None:  # the calls' grammar is the output's format
            raise _FieldError("params.response_format", "a response_format cannot be combined with tools to call")
        if self.params.ignore_eos:
            raise _FieldError("params.ignore_eos", "tool calls end their output with EOS: ignore_eos cannot be set")

    def prompt_bytes(self) -> int:
        """UTF-8 size of the text input (0 for `input_ids`), the measure of `max_prompt_bytes`."""
        if self.prompt is not None:
            return len(self.prompt.encode())
        return sum(message.size() for message in self.messages or ())

    def estimated_tokens(self) -> int:
        """Prompt + `max_new_tokens`, for backlog estimates where no tokenizer is at hand: a text prompt counts
        one token per 4 UTF-8 bytes."""
        prompt = len(self.input_ids) if self.input_ids is not None else -(-self.prompt_bytes() // 4)
        return prompt + self.params.max_new_tokens

    def check_limits(self, limits: RequestLimits) -> None:
        """Raise `LimitExceeded` naming the first limit this request is over."""
        stop = self.params.stop
        measured = (  # (limit, the field it measures, its value)
            ("max_prompt_bytes", "prompt" if self.prompt is not None else "messages", self.prompt_bytes()),
            ("max_input_ids", "input_ids", len(self.input_ids or ())),
            ("max_new_tokens", "params.max_new_tokens", self.params.max_new_tokens),
            ("max_stop", "params.stop", len(stop)),
            ("max_stop_bytes", "params.stop", max((len(s.encode()) for s in stop), default=0)),
        )
        for limit, param, value in measured:
            bound = getattr(limits, limit)
            if value > bound:
                raise LimitExceeded(limit, f"{limit}: {value} is over the limit of {bound}", self.id, param)


FinishReason = Literal["stop", "length", "eos", "cancelled"]


class TokensEvent(_Wire):
    """A chunk of output; `seq` is the index of its first token in the whole output.

    A chunk holds at least one token, so readers can drop what they have seen by token index;
    `text` is the chunk's detokenized delta (possibly empty while a multi-byte character is incomplete).
    """

    _hidden = frozenset({"ids", "text"})
    v: _Version = PROTOCOL_VERSION
    type: Literal["tokens"] = "tokens"
    seq: _Count
    ids: Annotated[list[_Count], Field(min_length=1)]
    text: str
    # With `params.logprobs`, per token of `ids`: [log-probability, text, [[alternative id, log-probability, text]]].
    logprobs: list[tuple[float, str, list[tuple[_Count, float, str]]]] | None = None
    # On a request with tools: the syntax its model writes calls in (`client.tool_calls.SYNTAXES`), which readers
    # parse `text` with into content and calls; `text` itself is the output as generated, markup included.
    tool_syntax: Annotated[str, Field(max_length=64)] | None = None


class PromptEvent(_Wire):
    """The prompt's tokens scored, written before the first `tokens` event, only for a request that set
    `params.prompt_logprobs`. Per prompt token: its id, its own text, and [log-probability, [[alternative id,
    log-probability, text]]] given the tokens before it; the first token's entry is None (nothing predicts it).
    A reader keeps the first it sees: a request restarted before its first token may write it again."""

    _hidden = frozenset({"ids", "texts", "logprobs"})
    v: _Version = PROTOCOL_VERSION
    type: Literal["prompt"] = "prompt"
    ids: Annotated[list[_Count], Field(min_length=1)]
    texts: list[str]
    logprobs: list[tuple[float, list[tuple[_Count, float, str]]] | None]

    @model_validator(mode="after")
    def _aligned(self) -> PromptEvent:
        if not len(self.ids) == len(self.texts) == len(self.logprobs):
            raise ValueError("ids, texts and logprobs must have one entry per prompt token")
        return self


class Usage(_Wire):
    prompt_tokens: _Count
    completion_tokens: _Count


def total_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of a call's `n` choices, as OpenAI counts it: the prompt once (each choice's request read the
    same one), the completion tokens of all."""
    return Usage(
        prompt_tokens=usages[0].prompt_tokens, completion_tokens=sum(usage.completion_tokens for usage in usages)
    )


class Timings(_Wire):
    """Milliseconds; may be negative under clock skew between client and worker hosts."""

    queue_ms: _Float | None = None
    ttft_ms: _Float | None = None
    total_ms: _Float | None = None


class DoneEvent(_Wire):
    v: _Version = PROTOCOL_VERSION
    type: Literal["done"] = "done"
    finish_reason: FinishReason
    usage: Usage
    timings: Timings = Field(default_factory=Timings)
    # On a request that may call tools, as on its tokens events: so a `Completion`'s text can be parsed too.
    tool_syntax: Annotated[str, Field(max_length=64)] | None = None


class ErrorEvent(_Wire):
    """`code` stays a plain str when this side does not know it, so newer workers remain readable."""

    v: _Version = PROTOCOL_VERSION
    type: Literal["error"] = "error"
    code: Annotated[ErrorCode | str, Field(union_mode="left_to_right")]
    message: str
    retryable: Annotated[bool, Field(strict=True)] = False
    # The request field refused, by its wire name (`params.max_new_tokens`, `input_ids`, `messages`...), when one
    # field was the reason. Written only then: a reader older than the field refuses an event that carries it.
    param: Annotated[str, Field(max_length=128)] | None = None


class Completion(_Wire):
    """A request's final result on its `reply_to` stream: `done` with the whole output, or `error`.

    Appended in the same atomic write that publishes the terminal event on the request's own result stream,
    which stays the source of truth; a consumer group reads completions at least once, so process them
    idempotently by `id`."""

    _hidden = frozenset({"text", "ids"})
    v: _Version = PROTOCOL_VERSION
    type: Literal["completion"] = "completion"
    id: str
    text: str = ""
    ids: list[_Count] = Field(default_factory=list)
    done: DoneEvent | None = None
    error: ErrorEvent | None = None


Event = Annotated[PromptEvent | TokensEvent | DoneEvent | ErrorEvent, Field(discriminator="type")]
_EVENT: TypeAdapter[PromptEvent | TokensEvent | DoneEvent | ErrorEvent] = TypeAdapter(Event)


class WorkerInfo(_Wire):
    """A worker's heartbeat; `tokens_generated` is a counter since `started`."""

    v: _Version = PROTOCOL_VERSION
    id: str
    host: str
    pid: _Count
    queue: str
    model: str
    running: _Count
    waiting: _Count
    kv_used_blocks: _Count
    kv_total_blocks: _Count
    tokens_generated: _Count
    started: _Count  # epoch ms
    heartbeat: _Count  # epoch ms


class PrefixCacheInfo(_Wire):
    """A worker's prefix cache since it started, beside its heartbeat (`Keys.prefix_caches`, so that readers of
    `WorkerInfo` from before it, which refuse unknown fields, still read heartbeats): prompt tokens looked up and
    found."""

    v: _Version = PROTOCOL_VERSION
    queries: _Count
    hits: _Count


class DeadLetterBody(_Wire):
    """An entry of the dead-letter stream (`Keys.dead`): a request entry no worker will run (unreadable, past its
    delivery limit, quarantined, or its result stream refused), with why. `raw` is the entry's `m` field as it was
    (empty when it had none), so an operator can inspect or re-queue it."""

    _hidden = frozenset({"raw"})
    v: _Version = PROTOCOL_VERSION
    entry_id: str  # its id in the request stream
    reason: str
    raw: Annotated[bytes, Field(strict=True)] = b""


# --- codec --------------------------------------------------------------------------------------


def encode(model: BaseModel) -> bytes:
    """msgpack of the model's fields in declaration order (so `v` comes first), without None values."""
    return msgpack.packb(model.model_dump(exclude_none=True))


def encode_trace(carrier: dict[str, str]) -> bytes:
    """The `TRACE_FIELD` of a propagator's carrier: b"" (no field) when it is empty or over `MAX_TRACE_BYTES`."""
    raw = msgpack.packb(carrier) if carrier else b""
    return raw if len(raw) <= MAX_TRACE_BYTES else b""


def decode_trace(raw: bytes | None) -> dict[str, str]:
    """A `TRACE_FIELD` back as a carrier; {} for anything else (it is only a hint: never an error)."""
    if not raw or len(raw) > MAX_TRACE_BYTES:
        return {}
    try:
        data = msgpack.unpackb(raw)
    except Exception:  # msgpack raises several types for bad bytes; none of them matter here
        return {}
    if not isinstance(data, dict):
        return {}
    return {key: value for key, value in data.items() if isinstance(key, str) and isinstance(value, str)}


def _summarize(exc: ValidationError, shown: int = 3) -> str:
    """pydantic's errors as one short line, without the (possibly huge) input values."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    parts = [
        ".".join(map(str, e["loc"])) + ": " * bool(e["loc"]) + e["msg"].removeprefix("Value error, ")
        for e in errors[:shown]
    ]
    more = f" (+{len(errors) - shown} more)" if len(errors) > shown else ""
    return ("; ".join(parts) + more)[:500]


def choice_ids(request_id: str, n: int) -> list[str]:
    """The request ids of a call's `n` choices: its own id for one, else `<id>-<index>`, derived, so a retry of the
    call under the same id attaches to the same `n` generations."""
    return [request_id] if n == 1 else [f"{request_id}-{index}" for index in range(n)]


def is_valid_name(name: object) -> bool:
    """Whether a request id, queue name, prefix or tenant may be used in key names: 1-128 of [A-Za-z0-9._:-]."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def _valid_id(data: dict[Any, Any]) -> str | None:
    rid = data.get("id")
    return rid if is_valid_name(rid) else None


def _unpack(raw: bytes) -> dict[Any, Any]:
    """The entry's map with a supported `v`. Every error carries the request id when one can be read, also
    from an entry with a bad string or an array for a map key elsewhere, or no usable `v`, so its reader can
    still be answered."""
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except UnicodeDecodeError:
        raise MalformedEntry("a string is not valid UTF-8", _salvage_id(raw)) from None
    except TypeError:  # an array or a map as a map key: valid msgpack, no Python dict
        raise MalformedEntry("a map key is an array or a map", _salvage_id(raw)) from None
    except Exception as exc:  # msgpack raises a zoo of types (ValueError, StackError, ExtraData...)
        raise MalformedEntry(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise MalformedEntry(f"expected a msgpack map, got {type(data).__name__}")
    version = data.get("v")
    if type(version) is not int:
        raise MalformedEntry("no integer protocol version 'v'", _valid_id(data))
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})",
            _valid_id(data),
        )
    return data


def _salvage_id(raw: bytes) -> str | None:
    """The id of an entry that strict decoding refused (a string that is not UTF-8, an unhashable map key):
    decoded leniently, only to answer its reader. The id itself must still be valid."""

    def lenient_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
        return {key if isinstance(key, str | int | float | bool | None) else repr(key): value for key, value in pairs}

    try:
        data = msgpack.unpackb(
            raw, raw=False, strict_map_key=False, unicode_errors="replace", object_pairs_hook=lenient_map
        )
    except Exception:
        return None
    return _valid_id(data) if isinstance(data, dict) else None


def _param(exc: ValidationError) -> str | None:
    """The wire name of the field the first error is about: `params.<name>` or a top-level field (`input_ids`, not
    `input_ids.3`); what a `_FieldError` names for a check across fields; None for a check of the whole request."""
    first = exc.errors(include_url=False, include_input=False)[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, _FieldError):
        return cause.field
    names = [str(part) for part in first["loc"] if isinstance(part, str)]
    return ".".join(names[: 2 if names[:1] == ["params"] else 1]) or None


def parse_request(data: dict[str, Any]) -> GenerateRequest:
    """Validate request fields; raise `InvalidRequest` with a one-line summary and the field at fault."""
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid request: {_summarize(exc)}", _valid_id(data), _param(exc)) from None


def decode_request(raw: bytes) -> GenerateRequest:
    """A request entry's `m` field; limits are checked separately (`GenerateRequest.check_limits`).

    Raises `MalformedEntry` only when no request id can be read: with an id, a broken entry is an
    `InvalidRequest` (or `UnsupportedVersion`) that the worker answers on the request's result stream."""
    try:
        data = _unpack(raw)
    except MalformedEntry as error:
        if error.request_id is None:
            raise
        raise InvalidRequest(f"invalid request: {error}", error.request_id) from None
    if _valid_id(data) is None:
        raise MalformedEntry("request has no valid 'id'")
    return parse_request(data)


def _validated(validate: Callable[[Any], _T], raw: bytes, what: str) -> _T:
    data = _unpack(raw)
    try:
        return validate(data)
    except ValidationError as exc:
        raise MalformedEntry(f"invalid {what}: {_summarize(exc)}") from None


def decode_event(raw: bytes) -> PromptEvent | TokensEvent | DoneEvent | ErrorEvent:
    """A result stream entry's `m` field."""
    return _validated(_EVENT.validate_python, raw, "event")


def decode_completion(raw: bytes) -> Completion:
    """An entry's `m` field on a `reply_to` stream."""
    return _validated(Completion.model_validate, raw, "completion")


def decode_dead_letter(raw: bytes) -> DeadLetterBody:
    """An entry's `m` field on the dead-letter stream."""
    return _validated(DeadLetterBody.model_validate, raw, "dead letter")


def decode_worker(raw: bytes) -> WorkerInfo:
    """A value of the `workers` hash."""
    return _validated(WorkerInfo.model_validate, raw, "worker info")


def decode_prefix_cache(raw: bytes) -> PrefixCacheInfo:
    """A value of the `prefix_caches` hash."""
    return _validated(PrefixCacheInfo.model_validate, raw, "prefix cache info")


_FAILURES: dict[str, type[RequestFailed]] = {ErrorCode.EXPIRED: RequestExpired}


def error_from_event(event: ErrorEvent, request_id: str | None = None) -> RequestFailed:
    """The exception for a terminal `error` event; unknown codes map to `RequestFailed` itself."""
    cls = _FAILURES.get(str(event.code), RequestFailed)
    return cls(str(event.code), event.message, event.retryable, request_id, event.param)
