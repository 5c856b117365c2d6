"""The continuous-batching engine: a small asyncio interface over transformers' own CB manager.

The library's manager runs the model in its own thread (paged KV cache, chunked prefill, requests joining
and leaving the batch every step); `library.py` builds it, installs our hooks and is our only way into it. This
adapter adds what the library does not do safely (5.24): explicit
cache sizing, validation before anything reaches its thread, admission by free KV blocks (so the library
never has to evict a running request), stop strings, deltas instead of cumulative outputs, cancellation
that ends the caller's stream, restart after the thread dies, and stats.

Note on threads: every method here runs on one event loop. The library thread talks to us only through
`call_soon_threadsafe` callbacks (`_on_output`) and plain counters (`StepCounters`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from client.tool_calls import ToolSyntax
from worker.engine import library, openmp
from worker.engine.constraints import Grammars
from worker.engine.errors import EngineClosed, EngineError, EngineFailed, RequestRejected
from worker.engine.inputs import InputProcessor, ModelLimits
from worker.engine.outputs import IncrementalDetokenizer
from worker.engine.prompt_scores import PromptScores
from worker.engine.rows import RowState
from worker.engine.stats import StepCounters
from worker.engine.stream import RequestStream
from worker.engine.tools import template_syntax, tools_format
from worker.engine.types import (
    EngineRequest,
    EngineStats,
    Finish,
    GenerationParams,
    OutputDelta,
    Resume,
    ScoredPrompt,
    Step,
    TokenLogprob,
)

_WATCHDOG_PERIOD_S = 0.1


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Cache and batch sizing. Never the library's defaults, which take 60 % of free RAM on CPU."""

    kv_cache_tokens: int = 16384
    page_size: int = 32
    max_batch_tokens: int = 512
    max_running: int = 32
    prefix_sharing: bool = True  # prefix caching: a prompt's full pages are computed once while they stay cached
    seed: int | None = None
    varlen_attention: bool = True  # our CPU attention (batched decode, paged reads), not the dense masked SDPA
    stop_timeout_s: float = 30.0


class Engine:
    """Continuous batching over one model. Use as `async with Engine(model, tokenizer, config) as engine:`.

    `submit(request)` validates at once (raising `RequestRejected`) and returns an async iterator of `OutputDelta`;
    `cancel(id)` ends a stream with `cancelled`; `stats()` reports KV use, queue sizes and step counters.
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # `_token_text`'s, bounded by the vocabulary
        self.config = config or EngineConfig()
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.counters = StepCounters()
        self._grammars = Grammars(tokenizer, self.vocab_size, self.eos_token_ids)
        self.tool_syntax = template_syntax(tokenizer)  # or why this model cannot be offered tools
        self._urgent: set[str] = set()  # library ids of urgent requests, whose prefill the scheduler takes first
        self._row_states: dict[str, RowState] = {}  # by library id: the requests the sampler treats apart
        self._prompt_scores: dict[str, PromptScores] = {}  # by library id: the prompts being scored
        self._per_row = True  # the fused sampler is installed (not with CUDA graphs): per-row features work
        self._weights = library.weights_of(model)  # what cached prefixes were computed with
        self._manager: library.Manager | None = None
        self._inputs: InputProcessor | None = None
        self._num_blocks = 0
        self._reserved_blocks = 0
        self._waiting: deque[RequestStream] = deque()
        # Keyed by the id the library knows: the caller's id plus a serial number, because a request id can
        # come back (a worker claiming its own request) while the library is still dropping the old run.
        self._running: dict[str, RequestStream] = {}
        self._submissions = itertools.count()
        self._watchdog: asyncio.Task[None] | None = None
        self._closing = False
        self._lifecycle = threading.Lock()  # orders `close` against a restart finishing in its thread

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Engine:
        await asyncio.to_thread(self._start_manager)
        self._watchdog = asyncio.create_task(self._watch(), name="engine-watchdog")
        return self

    async def close(self) -> None:
        """Stops the engine thread; streams still open end with `EngineClosed`. Also during a restart: a manager
        that a restart is still building stops itself (`_publish`), so no thread outlives the engine."""
        with self._lifecycle:
            self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        for stream in [*self._waiting, *self._running.values()]:
            self._end(stream, "error", EngineClosed("the engine is shutting down"))
        if self._manager is not None:
            manager, self._manager = self._manager, None
            await asyncio.to_thread(manager.stop, self.config.stop_timeout_s, hard_stop=True)
        library.restore(self.model)

    async def __aenter__(self) -> Engine:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests

    def submit(self, request: EngineRequest) -> RequestStream:
        """Validates and queues a request. Raises `RequestRejected` or `EngineClosed`; never fails other requests."""
        if self._closing or self._inputs is None:
            raise EngineClosed("the engine is not running")
        request, syntax = self._with_tools(request)
        prepared = self._inputs.prepare(request)
        if self._find(prepared.request_id) is not None:
            raise RequestRejected(f"request {prepared.request_id!r} is already in this engine")
        row_state = self._row_state(request, syntax) if request.params.per_row else None
        if request.params.prompt_logprobs is not None and not self._per_row:
            raise RequestRejected("prompt logprobs need the fused sampler", param="params.prompt_logprobs")
        unread, carry_text = self._held_back(request.resume)
        stream = RequestStream(
            prepared,
            IncrementalDetokenizer(self.tokenizer, prepared.prompt_ids, unread=unread),
            kv_blocks=-(-prepared.max_tokens // self.config.page_size),
            carry_text=carry_text,
            library_id=f"{prepared.request_id}#{next(self._submissions)}",
        )
        stream.tool_syntax = syntax.name if syntax is not None else None
        if row_state is not None:
            row_state.context = prepared.prompt_ids
            stream.row_state = self._row_states[stream.library_id] = row_state
        if request.params.prompt_logprobs is not None and request.resume is None:
            # A resumed request's prompt was scored by the attempt that delivered its first tokens, and published
            # before them: it is not scored again (its stream would otherwise repeat it).
            scores = PromptScores(list(prepared.prompt_ids), request.params.prompt_logprobs)
            stream.prompt_scores = self._prompt_scores[stream.library_id] = scores
        if request.urgent:
            self._urgent.add(stream.library_id)
            self._waiting.appendleft(stream)
        else:
            self._waiting.append(stream)
        self._admit()
        return stream

    def _with_tools(self, request: EngineRequest) -> tuple[EngineRequest, ToolSyntax | None]:
        """A request offered tools, checked against this model's template; one that may call them (any choice
        but "none") gets the calls' grammar as its output format, and the syntax its calls are written in."""
        if request.tools is None:
            return request, None
        syntax = self.tool_syntax
        if isinstance(syntax, str):
            raise RequestRejected(syntax, param="tools")
        if request.tool_choice == "none":
            return request, None
        output_format = tools_format(syntax, request.tools, request.tool_choice, request.parallel_tool_calls)
        return replace(request, params=replace(request.params, output_format=output_format)), syntax

    def _row_state(self, request: EngineRequest, syntax: ToolSyntax | None = None) -> RowState:
        """The sampler's state for a request with a seed, logprobs, penalties or a response format; on a resume
        it continues after the delivered tokens (seed position, penalties, grammar state)."""
        if not self._per_row:
            raise RequestRejected("seed, logprobs, penalties and response formats need the fused sampler")
        params = request.params
        delivered = list(request.resume.token_ids) if request.resume is not None else []
        state = RowState(params, context=[], generated=delivered)
        if params.output_format is not None:
            try:
                state.matcher = self._grammars.matcher(params.output_format, syntax)
            except RequestRejected as error:  # the format does not compile, or this worker cannot apply one
                raise RequestRejected(str(error), param="tools" if syntax else "params.response_format") from error
            if params.output_format.kind.startswith("json"):
                state.forbidden = self._grammars.control_tokens()
            for token in delivered:
                if not state.matcher.accept_token(token):
                    raise RequestRejected("the output delivered so far does not match the response format")
        return state

    def _find(self, request_id: str) -> RequestStream | None:
        return next((s for s in [*self._running.values(), *self._waiting] if s.request_id == request_id), None)

    def _held_back(self, resume: Resume | None) -> tuple[int, str]:
        """What the earlier attempt delivered as tokens but not yet as text: the trailing tokens of an
        incomplete character (left for the detokenizer) and complete text held back for a stop string."""
        if resume is None:
            return 0, ""
        ids, unread = resume.token_ids, 0
        while unread < min(len(ids), 4) and self._decode(ids[: len(ids) - unread]).endswith("\ufffd"):
            unread += 1
        complete = self._decode(ids[: len(ids) - unread])
        return unread, complete[len(resume.text) :] if complete.startswith(resume.text) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _token_text(self, token: int) -> str:
        """One token's own text, decoded once per engine: a scored 32k-token prompt with 20 alternatives each
        names ~670k tokens, decoded on the loop, but only from the vocabulary's few thousand distinct ones."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self._decode([token])
        return text

    def cancel(self, request_id: str) -> bool:
        """Ends the request's stream now with `cancelled`; its KV blocks are freed before the next step."""
        stream = self._find(request_id)
        if stream is None:
            return False
        if stream.library_id in self._running and self._manager is not None:
            self._manager.cancel(stream.library_id)
        stream.put(OutputDelta(request_id, [], "", Finish.CANCELLED, stream.prompt_tokens))
        self._end(stream, Finish.CANCELLED)
        return True

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prompt prefix, as vLLM's `reset_prefix_cache` does: after weights changed in a way
        the engine cannot see (through `.data`). A parameter swapped or changed in place is seen at the next
        admission, which forgets them itself."""
        if self._manager is not None:
            self._manager.reset_prefix_cache()

    def _forget_stale_prefixes(self) -> None:
        weights = library.weights_of(self.model)
        if not library.same_weights(self._weights, weights):
            self._weights = weights
            self.reset_prefix_cache()

    def free_slots(self) -> int:
        """How many more requests this engine would start now: what a worker should read from its queue."""
        if self._closing or not self.alive or any(self._kv_bound(s) for s in self._waiting):
            return 0  # closing, restarting, or KV-bound
        return max(0, self.config.max_running - len(self._running) - len(self._waiting))

    def _kv_bound(self, stream: RequestStream) -> bool:
        """Whether a waiting request waits for KV blocks, not for a running suspect or a prefill it will share."""
        return not stream.request.suspect and not self._shares_a_prefill(stream)

    def _shares_a_prefill(self, stream: RequestStream) -> bool:
        """Whether a running request whose prompt starts with the same full page is still prefilling it. This one
        then waits for that prefill (its steps only) and reuses the pages it cached instead of computing them again:
        `n` choices of one prompt, or a burst of requests behind one system prompt, prefill it once."""
        page = self.config.page_size
        prompt = stream.request.prompt_ids
        if not self.config.prefix_sharing or len(prompt) <= page or stream.prompt_scores is not None:
            return False  # nothing to share, or a scored prompt, which never takes a cached page
        head = prompt[:page]
        return any(not s.prefilled and s.request.prompt_ids[:page] == head for s in self._running.values())

    def observe_steps(self, observer: Callable[[Step], None]) -> None:
        """Calls `observer(step)` after every step, from the engine's thread."""
        self.counters.step_observers.append(observer)

    @property
    def alive(self) -> bool:
        """Whether the library's generation thread is running (false while it restarts)."""
        return self._manager is not None and self._manager.is_running()

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    def stats(self) -> EngineStats:
        free = self._manager.free_capacity() if self._manager is not None else 1.0
        fill = self.counters.fill_percentiles(self.config.max_batch_tokens)
        return EngineStats(
            kv_blocks_total=self._num_blocks,
            kv_blocks_used=round((1.0 - free) * self._num_blocks),
            kv_blocks_reserved=self._reserved_blocks,
            page_size=self.config.page_size,
            max_batch_tokens=self.config.max_batch_tokens,
            running=len(self._running),
            waiting=len(self._waiting),
            steps=self.counters.steps,
            prefill_tokens=self.counters.prefill_tokens,
            decode_tokens=self.counters.decode_tokens,
            batch_fill_p50=fill[0],
            batch_fill_p95=fill[1],
            batch_fill_p99=fill[2],
            requests_finished=dict(self.counters.finished),
            restarts=self.counters.restarts,
            generation_tokens=self.counters.generation_tokens,
            prefix_cache_queries=self.counters.prefix_cache_queries,
            prefix_cache_hits=self.counters.prefix_cache_hits,
            paths=dict(self.counters.paths),
        )

    # ------------------------------------------------------------------ internals

    def _start_manager(self) -> None:
        """Builds and starts a fresh library manager (blocking: runs in a worker thread)."""
        hooks = library.Hooks(
            urgent=self._urgent,
            row_states=self._row_states,
            counters=self.counters,
            prompt_scores=self._prompt_scores,
        )
        manager = library.start(self.model, self.config, self.eos_token_ids, hooks)
        openmp.release_idle_threads()  # this thread allocated the cache; the steps run in the library's
        self._per_row = manager.per_row
        self._num_blocks = manager.num_blocks
        self._inputs = InputProcessor(
            self.tokenizer,
            ModelLimits(
                vocab_size=self.vocab_size,
                max_context=int(getattr(self.model.config.get_text_config(), "max_position_embeddings", 1 << 30)),
                max_cached_tokens=self._num_blocks * self.config.page_size,
            ),
        )
        self._publish(manager)

    def _publish(self, manager: library.Manager) -> None:
        """Makes a started manager the engine's, unless the engine closed meanwhile: then nobody else would stop
        its (non-daemon) thread, and the process could never exit."""
        with self._lifecycle:
            if not self._closing:
                self._manager = manager
                return
        manager.stop(self.config.stop_timeout_s, hard_stop=True)

    def _admit(self) -> None:
        """Starts waiting requests (urgent ones were queued first, then oldest first) while batch slots and
        unreserved KV blocks allow. A suspect waits while another suspect runs, without holding up the requests
        behind it."""
        manager = self._manager
        if self._waiting and self.config.prefix_sharing:
            self._forget_stale_prefixes()
        suspect_running = any(s.request.suspect for s in self._running.values())
        # Not into a dying thread (its failed outputs arrive before the watchdog sees it): they wait for the next.
        for stream in list(self._waiting):
            if not self.alive or len(self._running) >= self.config.max_running:
                return
            assert manager is not None
            if (stream.request.suspect and suspect_running) or self._shares_a_prefill(stream):
                continue
            if self._reserved_blocks + stream.kv_blocks > self._num_blocks:
                return  # nothing overtakes a request waiting for KV blocks
            if manager.refusal() is not None:
                return
            self._waiting.remove(stream)
            self._reserved_blocks += stream.kv_blocks
            self._running[stream.library_id] = stream
            if not manager.add(self._on_output, self._library_request(stream)):  # refused: stopping after all
                del self._running[stream.library_id]
                self._reserved_blocks -= stream.kv_blocks
                self._waiting.appendleft(stream)
                return
            suspect_running = suspect_running or stream.request.suspect

    def _library_request(self, stream: RequestStream) -> dict[str, Any]:
        request, params = stream.request, stream.request.params
        return {
            "input_ids": request.prompt_ids,
            "request_id": stream.library_id,
            "max_new_tokens": max(1, params.max_new_tokens),  # 0 (scoring only): the one token is not output
            "streaming": True,
            "eos_token_id": -1 if params.ignore_eos else list(self.eos_token_ids) or -1,
            **self._sampling_kwargs(params),
        }

    def _sampling_kwargs(self, params: GenerationParams) -> dict[str, Any]:
        # The library samples every row; top_k=1 makes a row exactly greedy, so greedy and sampled
        # requests share one batch.
        if params.greedy:
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        top_k = min(params.top_k, self.vocab_size) if params.top_k > 0 else self.vocab_size  # int32 in the library
        return {"temperature": float(params.temperature), "top_k": int(top_k), "top_p": float(params.top_p)}

    def _on_output(self, output: library.LibraryOutput) -> None:
        """Called on the loop for each library output of a running request (cumulative tokens)."""
        stream = self._running.get(output.request_id)
        if stream is None:  # cancelled or stopped meanwhile
            return
        if output.error is not None:
            self._failed(stream, output.error)
            return
        prompt = None
        if stream.prompt_scores is not None:  # the first output comes after the prompt's last chunk ran
            prompt = self._take_scores(stream)
            if prompt is None:
                return
        if not stream.prefilled:
            self._prefilled(stream)
        tokens = output.generated_tokens
        finished = output.is_finished()
        if stream.request.params.max_new_tokens == 0:  # scoring only: the token the library drew is not output
            tokens, finished = [], True
        new_tokens = tokens[stream.tokens_seen :]
        stream.tokens_seen = len(tokens)
        text = stream.detokenizer.push(new_tokens)
        if finished:
            text += stream.detokenizer.finish()
        text, stop_hit = stream.stops.feed(text, final=finished)
        reason = None
        if stop_hit:
            reason = Finish.STOP
            if not finished and self._manager is not None:
                self._manager.cancel(stream.library_id)
        elif finished:
            eos = not stream.request.params.ignore_eos and bool(tokens) and tokens[-1] in self.eos_token_ids
            reason = Finish.EOS if eos else Finish.LENGTH
        logprobs = self._token_logprobs(stream, new_tokens)
        delta = OutputDelta(
            stream.request_id,
            list(new_tokens),
            text,
            reason,
            stream.prompt_tokens,
            logprobs,
            prompt,
            stream.tool_syntax,
        )
        stream.put(delta)
        if reason is not None:
            self._end(stream, reason)

    def _failed(self, stream: RequestStream, error: str) -> None:
        manager = self._manager
        if manager is None or manager.refusal() is not None:
            return  # the thread is dying: the watchdog ends every request it ran at once, blaming consistently
        self._end(stream, "error", EngineFailed(f"the engine failed this request: {error}"))

    def _prefilled(self, stream: RequestStream) -> None:
        """Its first output came, so its prompt's pages are cached: requests waiting to share them may go in."""
        stream.prefilled = True
        if self._waiting:
            self._admit()

    def _token_logprobs(self, stream: RequestStream, new_tokens: list[int]) -> list[TokenLogprob] | None:
        """The new tokens' logprobs, which the sampler queued, when the request asked for them."""
        if stream.row_state is None or stream.row_state.params.logprobs is None:
            return None
        queued = stream.row_state.logprobs
        return [self._with_text(token, queued.popleft()) for token in new_tokens if queued]

    def _take_scores(self, stream: RequestStream) -> ScoredPrompt | None:
        """The stream's scored prompt, with every token's text (decoded here, on the loop, not in the library's
        thread); None, with the stream ended, where it could not be scored."""
        scores, stream.prompt_scores = stream.prompt_scores, None
        self._prompt_scores.pop(stream.library_id, None)
        if scores is None or not scores.complete:
            failed = scores.failed if scores is not None else "no scores"
            self._end(stream, "error", EngineError(f"the prompt could not be scored: {failed}"))
            return None
        ids = scores.prompt_ids
        texts = [self._token_text(token) for token in ids]
        logprobs: list[TokenLogprob | None] = [None]
        for index, (value, top) in enumerate(scores.scores, start=1):
            top_text = tuple(self._token_text(alternative) for alternative, _ in top)
            logprobs.append(TokenLogprob(value, top, texts[index], top_text))
        return ScoredPrompt(list(ids), texts, logprobs)

    def _with_text(self, token: int, logprob: TokenLogprob) -> TokenLogprob:
        texts = tuple(self._token_text(alternative) for alternative, _ in logprob.top)
        return replace(logprob, text=self._token_text(token), top_text=texts)

    def _end(self, stream: RequestStream, outcome: str, error: EngineError | None = None) -> None:
        """Takes a request out of the engine's books, counts its outcome, and lets the next waiting one in."""
        self._row_states.pop(stream.library_id, None)
        self._prompt_scores.pop(stream.library_id, None)
        self._urgent.discard(stream.library_id)
        if stream.library_id in self._running:
            del self._running[stream.library_id]
            self._reserved_blocks -= stream.kv_blocks
            if self._manager is not None:
                self._manager.forget(stream.library_id)
        else:
            with contextlib.suppress(ValueError):
                self._waiting.remove(stream)
        if error is not None:
            stream.fail(error)
        self.counters.finished[str(outcome)] += 1
        self._admit()

    async def _watch(self) -> None:
        """Restarts the library's thread when it dies; requests in flight end with `EngineFailed`."""
        while not self._closing:
            await asyncio.sleep(_WATCHDOG_PERIOD_S)
            manager = self._manager
            if manager is not None:
                manager.discard_unclaimed()
            if manager is None or manager.is_running() or self._closing:
                continue
            self.counters.restarts += 1
            fatal = manager.fatal_error
            self._manager = None  # first: ending streams admits waiting ones, which must wait for the new manager
            failed = list(self._running.values())
            suspect_ran = any(stream.request.suspect for stream in failed)
            for stream in failed:
                error = EngineFailed(
                    f"the engine thread died ({fatal}); it was restarted",
                    implicated=stream.request.suspect or not suspect_ran,
                )
                self._end(stream, "error", error)
            await asyncio.to_thread(manager.stop, self.config.stop_timeout_s)
            await self._restart_manager()

    async def _restart_manager(self) -> None:
        """Starts a fresh manager, retrying until one runs; waiting requests then go in."""
        while not self._closing:
            try:
                await asyncio.to_thread(self._start_manager)
            except Exception as error:  # e.g. memory still held by the dead one: try again shortly
                logging.getLogger(__name__).error("engine restart failed, retrying: %s", error)
                await asyncio.sleep(1.0)
                continue
            self._admit()
            return


def _eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from the model's generation config, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
