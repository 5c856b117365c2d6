"""Validation and tokenization: everything that can be wrong with a request is caught here, before it
reaches transformers' engine, where one bad request fails every request in flight (5.24)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from client.protocol import (
    MAX_NEW_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
)
from worker.engine.errors import RequestRejected
from worker.engine.tools import template_messages
from worker.engine.types import EngineRequest, GenerationParams


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """Checked ids for the library: the prompt, followed on a resume by the tokens already delivered."""

    request_id: str
    prompt_ids: list[int]
    params: GenerationParams  # on a resume, `max_new_tokens` is what is left to generate
    prompt_tokens: int  # the caller's prompt alone
    suspect: bool = False  # see `EngineRequest.suspect`

    @property
    def max_tokens(self) -> int:
        """Prompt plus the most it may generate: what the request can ever hold in the KV cache (the library draws
        one token even for a request that only scores its prompt)."""
        return len(self.prompt_ids) + max(1, self.params.max_new_tokens)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_context: int  # the model's position limit
    max_cached_tokens: int  # the whole KV cache: a request longer than this could never be scheduled


class InputProcessor:
    """Turns an `EngineRequest` into checked prompt ids, or raises `RequestRejected` saying what is wrong."""

    def __init__(self, tokenizer: Any, limits: ModelLimits) -> None:
        self._tokenizer = tokenizer
        self.limits = limits

    def prepare(self, request: EngineRequest) -> PreparedRequest:
        check_params(request.params)
        sources = [s for s in (request.prompt, request.messages, request.input_ids) if s is not None]
        if len(sources) != 1:
            raise RequestRejected("give exactly one of prompt, messages or input_ids")
        prompt_ids = self._tokenize(request)
        if not prompt_ids:
            raise RequestRejected("the prompt is empty", param=_source(request))
        self._check_length(len(prompt_ids), request.params.max_new_tokens, _source(request))
        if request.resume is None:
            return PreparedRequest(request.request_id, prompt_ids, request.params, len(prompt_ids), request.suspect)
        delivered = self._check_ids(request.resume.token_ids)
        left = request.params.max_new_tokens - len(delivered)
        if left < 1:
            raise RequestRejected("the resumed request has nothing left to generate")
        params = replace(request.params, max_new_tokens=left)
        return PreparedRequest(request.request_id, prompt_ids + delivered, params, len(prompt_ids), request.suspect)

    def _tokenize(self, request: EngineRequest) -> list[int]:
        if request.input_ids is not None:
            return self._check_ids(request.input_ids)
        if request.messages is not None:
            return self._render_chat(request.messages, request.tools)
        if not isinstance(request.prompt, str):
            raise RequestRejected("prompt must be a string", param="prompt")
        if not request.prompt:
            return []
        return list(self._tokenizer(request.prompt, add_special_tokens=True)["input_ids"])

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestRejected("input_ids must be a list of integers", param="input_ids")
        vocab = self.limits.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise RequestRejected(
                f"input_ids has {len(bad)} ids outside the vocabulary [0, {vocab}), e.g. {bad[0]}", param="input_ids"
            )
        return list(ids)

    def _render_chat(self, messages: Any, tools: list[dict[str, Any]] | None) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise RequestRejected("messages must be a non-empty list", param="messages")
        for message in messages:
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str | None)
                or (message.get("content") is None and not message.get("tool_calls"))
            ):
                raise RequestRejected("each message needs a string role and a string content", param="messages")
        if not getattr(self._tokenizer, "chat_template", None):
            raise RequestRejected(
                "this model has no chat template: send a prompt or input_ids instead", param="messages"
            )
        rendered = template_messages(messages)
        try:
            text = self._tokenizer.apply_chat_template(
                rendered, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as error:  # a template may raise anything (jinja): it is still the caller's input
            raise RequestRejected(f"the chat template rejected the messages: {error}", param="messages") from error
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_length(self, prompt_tokens: int, max_new_tokens: int, source: str) -> None:
        total = prompt_tokens + max_new_tokens
        if total > self.limits.max_context:
            raise RequestRejected(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"model's context of {self.limits.max_context} tokens",
                param=source,
            )
        if total > self.limits.max_cached_tokens:
            raise RequestRejected(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds this "
                f"worker's KV cache of {self.limits.max_cached_tokens} tokens",
                param=source,
            )


def check_params(params: GenerationParams) -> None:
    """Types and ranges of the sampling parameters (the protocol's `BOUNDS`): the library checks types only, and
    only inside its thread, where a value it cannot run kills every request in flight."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_real(value: Any) -> bool:
        return (is_int(value) or isinstance(value, float)) and math.isfinite(value)

    least = 0 if params.prompt_logprobs is not None else 1  # 0: only score the prompt
    if not is_int(params.max_new_tokens) or not least <= params.max_new_tokens <= MAX_NEW_TOKENS:
        raise RequestRejected(
            f"max_new_tokens must be an integer in [{least}, {MAX_NEW_TOKENS}], not {params.max_new_tokens}",
            param="params.max_new_tokens",
        )
    if not is_real(params.temperature) or not 0 <= params.temperature <= MAX_TEMPERATURE:
        raise RequestRejected(
            f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {params.temperature!r}",
            param="params.temperature",
        )
    if not is_real(params.top_p) or not 0 < params.top_p <= 1:
        raise RequestRejected(f"top_p must be a number in (0, 1], got {params.top_p!r}", param="params.top_p")
    if not is_int(params.top_k) or not 0 <= params.top_k <= MAX_TOP_K:
        raise RequestRejected(
            f"top_k must be an integer in [0, {MAX_TOP_K}], got {params.top_k!r}", param="params.top_k"
        )
    if not all(isinstance(s, str) and s for s in params.stop):
        raise RequestRejected("stop must be a list of non-empty strings", param="params.stop")
    _check_row_params(params, is_int, is_real)


def _check_row_params(params: GenerationParams, is_int: Any, is_real: Any) -> None:
    if params.seed is not None and (not is_int(params.seed) or not MIN_SEED <= params.seed <= MAX_SEED):
        raise RequestRejected(
            f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {params.seed!r}", param="params.seed"
        )
    if params.logprobs is not None and (not is_int(params.logprobs) or not 0 <= params.logprobs <= MAX_TOP_LOGPROBS):
        raise RequestRejected(
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {params.logprobs!r}",
            param="params.top_logprobs",
        )
    top = params.prompt_logprobs
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise RequestRejected(
            f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
            param="params.prompt_logprobs",
        )
    penalty = params.repetition_penalty
    if not is_real(penalty) or not MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY:
        bounds = f"[{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]"
        raise RequestRejected(
            f"repetition_penalty must be a number in {bounds}, got {penalty!r}", param="params.repetition_penalty"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise RequestRejected(
                f"{name} must be a number in [{-MAX_PENALTY}, {MAX_PENALTY}], got {value!r}", param=f"params.{name}"
            )
    if params.output_format is not None and params.ignore_eos:
        raise RequestRejected(
            "a response format ends its output with EOS: ignore_eos cannot be combined with it",
            param="params.response_format",
        )


def _source(request: EngineRequest) -> str:
    """The wire name of the field the request's prompt came from."""
    if request.input_ids is not None:
        return "input_ids"
    return "messages" if request.messages is not None else "prompt"
