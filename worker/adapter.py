"""The one place where the wire meets the engine: a wire request becomes an `EngineRequest`, the worker's
settings become an `EngineConfig`, and an engine error becomes a wire error code (as httpx maps httpcore's
exceptions at its transport boundary). The engine knows nothing of the wire; the wire nothing of the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from client.protocol import (
    ErrorCode,
    ErrorEvent,
    GenerateRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    PromptEvent,
    RegexFormat,
    ResponseFormat,
    ToolChoice,
)
from worker.config import Settings
from worker.engine import (
    EngineClosed,
    EngineConfig,
    EngineError,
    EngineFailed,
    EngineRequest,
    GenerationParams,
    OutputFormat,
    RequestRejected,
    Resume,
    ScoredPrompt,
)
from worker.engine.constraints import json_schema_format


@dataclass(frozen=True, slots=True)
class WireError:
    code: ErrorCode
    retryable: bool


# Most specific first; every `EngineError` subclass has a row (a test checks).
ERRORS: dict[type[EngineError], WireError] = {
    RequestRejected: WireError(ErrorCode.INVALID_REQUEST, retryable=False),
    EngineFailed: WireError(ErrorCode.ENGINE_FAILED, retryable=True),
    EngineClosed: WireError(ErrorCode.ENGINE_FAILED, retryable=True),
    EngineError: WireError(ErrorCode.INTERNAL, retryable=False),
}


def wire_error(error: EngineError) -> WireError:
    """The code and retryability an engine error is reported with."""
    for cls in type(error).__mro__:
        if cls in ERRORS:
            return ERRORS[cls]
    return ERRORS[EngineError]


def error_event(error: EngineError) -> ErrorEvent:
    """The terminal `error` event an engine error ends its request with, naming the field a rejection blames."""
    wire = wire_error(error)
    param = error.param if isinstance(error, RequestRejected) else None
    return ErrorEvent(code=wire.code, message=str(error), retryable=wire.retryable, param=param)


def prompt_event(prompt: ScoredPrompt) -> PromptEvent:
    """The wire form of a scored prompt."""
    logprobs = [
        None
        if entry is None
        else (
            entry.logprob,
            [(token, value, text) for (token, value), text in zip(entry.top, entry.top_text, strict=True)],
        )
        for entry in prompt.logprobs
    ]
    return PromptEvent(ids=prompt.token_ids, texts=prompt.texts, logprobs=logprobs)


def engine_request(
    request: GenerateRequest, resume: Resume | None = None, *, suspect: bool = False, urgent: bool = False
) -> EngineRequest:
    params = request.params
    return EngineRequest(
        request_id=request.id,
        prompt=request.prompt,
        messages=[m.model_dump(exclude_none=True) for m in request.messages] if request.messages is not None else None,
        input_ids=request.input_ids,
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools is not None else None,
        tool_choice=_tool_choice(params.tool_choice),
        parallel_tool_calls=params.parallel_tool_calls,
        params=GenerationParams(
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop=tuple(params.stop),
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            logprobs=params.top_logprobs if params.logprobs else None,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            output_format=output_format(params.response_format),
            prompt_logprobs=params.prompt_logprobs,
        ),
        resume=resume,
        suspect=suspect,
        urgent=urgent,
    )


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    return choice if choice is None or isinstance(choice, str) else choice.model_dump()


def output_format(response_format: ResponseFormat | None) -> OutputFormat | None:
    """The engine's form of a wire response format (a JSON schema serialized canonically, so equal schemas share
    one compiled grammar)."""
    if isinstance(response_format, JsonSchemaFormat):
        return json_schema_format(response_format.json_schema["schema"])
    if isinstance(response_format, JsonObjectFormat):
        return OutputFormat("json_object")
    if isinstance(response_format, RegexFormat):
        return OutputFormat("regex", response_format.regex)
    return None


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        kv_cache_tokens=settings.kv_cache_tokens,
        page_size=settings.page_size,
        max_batch_tokens=settings.max_batch_tokens,
        max_running=settings.max_running,
        prefix_sharing=settings.prefix_sharing,
        seed=settings.seed,
    )
