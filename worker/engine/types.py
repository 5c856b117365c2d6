"""What goes into the engine and what comes out of it. Plain dataclasses: the engine knows nothing of Redis."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from client.protocol import DEFAULT_MAX_NEW_TOKENS, GREEDY_BELOW_TEMPERATURE


class Finish(StrEnum):
    EOS = "eos"
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step as its observers see it (in the engine's thread): `tokens` fed to the forward pass, `decode`
    of them decode rows, `generated` requests given a token (each decode row, and each prompt whose last chunk
    ran: its first token comes from the prefill)."""

    tokens: int
    decode: int
    generated: int

    @property
    def iteration_tokens(self) -> int:
        """vLLM's tokens of an iteration: the prompt tokens the step ran plus the tokens it generated."""
        return self.tokens - self.decode + self.generated


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """A constraint on the output: `kind` "json_schema" (`spec` is the schema, serialized), "json_object",
    "regex" (`spec` is the pattern), or "structural_tag" (`spec`: xgrammar's structural tag, serialized: text and
    tool calls, `worker.engine.tools`)."""

    kind: str
    spec: str = ""


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Per-request decoding settings. A temperature under `GREEDY_BELOW_TEMPERATURE` (or `top_k == 1`) is greedy:
    float32 sampling cannot divide logits by it. `logprobs` None: none reported; else how many alternatives.
    `prompt_logprobs` likewise for the prompt's tokens (`ScoredPrompt`); with it, `max_new_tokens` may be 0."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_format: OutputFormat | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def per_row(self) -> bool:
        """Whether the sampler must treat this request's row apart: a seed, logprobs, penalties or a format."""
        return (
            self.seed is not None
            or self.logprobs is not None
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.output_format is not None
        )


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and text, and the most likely alternatives (id, log-probability,
    text). A token's text is its own decoding: part of a multi-byte character decodes to U+FFFD."""

    logprob: float
    top: list[tuple[int, float]]
    text: str = ""
    top_text: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ScoredPrompt:
    """The prompt's tokens with each one's own text and its log-probability given the tokens before it (with the
    alternatives asked for); the first token's is None: nothing predicts it."""

    token_ids: list[int]
    texts: list[str]
    logprobs: list[TokenLogprob | None]


@dataclass(frozen=True, slots=True)
class Resume:
    """Output an earlier attempt already delivered: generation continues after it, as one stream."""

    token_ids: list[int]
    text: str  # the text delivered with those tokens (a multi-byte character may have been held back)


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request: exactly one of `prompt`, `messages` (chat) or `input_ids`. `tools` (OpenAI's
    function shape) are rendered by the chat template; unless `tool_choice` is "none", the output is generated
    under the grammar of the calls (None means "auto"), at most one with `parallel_tool_calls` False."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    params: GenerationParams = field(default_factory=GenerationParams)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    resume: Resume | None = None
    # Implicated in an earlier engine failure: the engine runs at most one suspect at a time, next to any number
    # of other requests, so a failure with a suspect in it points at that suspect and at no other suspect.
    suspect: bool = False
    # Someone is waiting for the first token (the interactive lane): its prefill goes before other requests'.
    urgent: bool = False

    def __repr__(self) -> str:  # prompts and ids stay out of logs
        return f"EngineRequest(request_id={self.request_id!r}, params={self.params!r}, suspect={self.suspect})"


@dataclass(slots=True)
class OutputDelta:
    """New output of one request since its previous delta. The last delta of a stream has `finish_reason` set.

    Concatenating every delta's `text` gives the full decoded output (stop string excluded), and
    concatenating `token_ids` gives every generated token.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: Finish | None = None
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    prompt: ScoredPrompt | None = None  # on a stream's first delta, when the request asked for prompt logprobs
    tool_syntax: str | None = None  # on a request that may call tools: the syntax `text` writes calls in

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    """Counters and gauges an operator watches; counters only grow, so rates and percentiles come from diffs."""

    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_reserved: int
    page_size: int
    max_batch_tokens: int
    running: int
    waiting: int
    steps: int
    prefill_tokens: int  # prompt tokens run through a forward pass (a prefix-cache hit is not run)
    decode_tokens: int  # decode rows: generated tokens after each request's first
    generation_tokens: int  # every generated token, a request's first (from its prefill step) included
    batch_fill_p50: float
    batch_fill_p95: float
    batch_fill_p99: float
    requests_finished: dict[str, int]
    restarts: int
    prefix_cache_queries: int | None = None  # prompt tokens looked up in the prefix cache; None: no prefix sharing
    prefix_cache_hits: int | None = None  # of those, tokens found in the cache
    paths: dict[str, str] = field(default_factory=dict)  # step component -> implementation (`library.engine_paths`)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
