"""The one seam between the engine and transformers' continuous batching (pinned to 5.24).

Nothing else in the engine imports `transformers.generation.continuous_batching` or touches the library's manager,
batch processor, model runner, scheduler or cache: `core.py` drives a `Manager` (our handle on one) and reads
outputs as `LibraryOutput`; the hooks' own modules (`sampling`, `urgency`, `paged_reads`, `lean_layers`, `stats`)
keep their logic and see only our types. `tests/engine/test_library_contract.py` names every class, private
attribute and signature used here and checks the installed transformers still has each, so an upgrade fails in a
second with the list of what moved.

`start` builds a manager and installs every hook, in this order (each step says why it comes where it does):
1. our scheduler (urgent prefills first, the prefix cache evicted least recently used first) is registered in the
   library's `SCHEDULER_MAPPING` and chosen by `scheduler_type` (the library's own seam), before the manager exists;
2. the manager is built, checking the model's attention implementation against those it knows (sdpa);
3. only then our attention function (`attention.py`), registered with `AttentionInterface` and switched in before
   the warmup, which builds the batch buffers: so it builds no dense masks either;
4. the lean decoder layers (`lean_layers.py`), which need our attention;
5. the warmup: the batch processor now exists (scheduler, cache, model runner), the cache at its real size;
6. the engine's urgent ids into our scheduler (`urgency.py`);
7. the fused sampler into the model runner (`sampling.py`), where CUDA graphs are off; with it, prompt scoring
   (`prompt_scores.py`): hooks on the model that add a scored prompt's positions to the logits it computes, and no
   prefix-cache match for such a prompt (every position must run);
8. the paged reads into the cache (`paged_reads.py`), which exist only after the warmup, on CPU with our attention;
9. the step counters around the manager's step (`stats.py`), with the engine paths chosen above; the prefix cache's
   reset on request (`Manager.reset_prefix_cache`: before the scheduler's next lookup) and, where prefix sharing is
   on, its lookups' counters;
10. the manager's thread starts.
`restore` undoes 3, 4 and the model's scoring hooks (the library's checks and `model.generate` need SDPA and the
library's layers).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopKLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

from worker.engine import attention, fastpath, lean_layers, prompt_scores
from worker.engine.kernels import cpu_kernels
from worker.engine.kernels.cpu_kernels import DecodeWrites
from worker.engine.paged_reads import DECODE_STEP, PagedReads
from worker.engine.prompt_scores import PromptScores
from worker.engine.rows import RowState
from worker.engine.sampling import ArgumentRows, FusedSampler
from worker.engine.stats import StepCounters
from worker.engine.urgency import urgent_first

if TYPE_CHECKING:
    from worker.engine.core import EngineConfig

SCHEDULER_NAME = "llmq_urgent_first"  # our scheduler's key in the library's SCHEDULER_MAPPING
_PAGED_READS_MARK = "_llmq_paged_reads"  # set on a cache whose `update` is ours
_SCORING_HOOKS = "_llmq_scoring_hooks"  # the model's prompt-scoring hook handles, removed by `restore`
_MAX_LOOKUPS_WAITING = 4096  # prefix-cache lookups of requests not yet in a step (`_count_prefix_lookups`)


class LibraryOutput(Protocol):
    """What the engine reads of one library output (`GenerationOutput`): one request's cumulative tokens."""

    request_id: str
    generated_tokens: list[int]
    error: str | None

    def is_finished(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Hooks:
    """The engine's state that the hooks read in the library's thread (the engine writes it on its loop)."""

    urgent: Collection[str]  # library ids of urgent requests, whose prefill goes first
    row_states: Mapping[str, RowState]  # by library id: the requests the fused sampler treats apart
    counters: StepCounters
    prompt_scores: Mapping[str, PromptScores]  # by library id: the prompts being scored


class UrgentFirstScheduler(FIFOScheduler):
    """The library's FIFO scheduler, with urgent requests' prefills before every other prefill (`urgency.py`), and
    the prefix cache's blocks evicted least recently used first (`_try_to_meet_safety_margin`). `urgent` is the
    engine's set, given to the instance the manager builds (`start`)."""

    urgent: Collection[str] = frozenset()

    def _try_to_meet_safety_margin(self) -> bool:
        """The library's check, but where it drops every cached prefix block at once when free room falls under the
        margin, this drops the least recently used ones, only until the margin is met with `EVICTION_ROOM` more: a
        prefix in use now and then (a system prompt) stays cached. (Before ever pausing a running request for room,
        the library still drops them all.)"""
        cache = self.cache
        cache.pool.try_to_free_sectors()
        if cache.compute_free_capacity() < self.safety_margin:
            evict_least_recently_used(cache, self.safety_margin + EVICTION_ROOM)
            cache.pool.try_to_free_sectors()
        return bool(cache.compute_free_capacity() >= self.safety_margin)

    def _process_candidates(
        self,
        candidates: list[Any],
        token_budget: int,
        cache_budget: int,
        request_ids_to_remove_from_waiting: set[str],
    ) -> Any:
        ordered = urgent_first(candidates, self.urgent, _decoding)
        return super()._process_candidates(ordered, token_budget, cache_budget, request_ids_to_remove_from_waiting)


EVICTION_ROOM = 0.05  # share of the cache freed past the margin by one eviction, so it does not run every step
_EVICTION_CHUNK = 8  # blocks evicted between two looks at the free room


def evict_least_recently_used(cache: Any, free: float) -> None:
    """Returns cached prefix blocks (no request holds them) to the pool, the least recently released first, until
    `free` of the cache is free or none is left. A block a request takes from the cache leaves the ledger's
    `cached_blocks` and goes back to its end when released: the dict's order is the order of last use."""
    for allocator in cache.cache_allocators.values():
        ledger = allocator.ledger
        while ledger.cached_blocks and cache.compute_free_capacity() < free:
            oldest = list(itertools.islice(ledger.cached_blocks, _EVICTION_CHUNK))
            for block in oldest:
                del ledger.cached_blocks[block]
                del ledger.hash_to_block[ledger.block_to_hash.pop(block)]
            cache.pool.free_blocks(allocator.index, oldest)


def _decoding(state: Any) -> bool:
    return bool(state.status == RequestStatus.DECODING)


class Manager:
    """Our handle on one started library manager: every call the engine makes into it. Call on the event loop."""

    def __init__(self, manager: ContinuousBatchingManager, per_row: bool, forget_prefixes: threading.Event) -> None:
        self.library = manager  # for tests that look inside; the engine goes through the methods
        self.per_row = per_row  # the fused sampler is in: per-request seeds, logprobs, penalties, formats work
        self._forget_prefixes = forget_prefixes  # set: the library's thread forgets them before its next lookup
        processor = manager.batch_processor
        assert processor is not None, "a started manager has its batch processor"
        self.num_blocks = int(processor.cache.num_blocks)

    def is_running(self) -> bool:
        return bool(self.library.is_running())

    def refusal(self) -> str | None:
        """Why the library's thread takes no new request now (it is dying or stopping), or None."""
        return self.library.background_thread_status.can_accept_new_requests()

    @property
    def fatal_error(self) -> object:
        return self.library.background_thread_status.fatal_error

    def add(self, handler: Callable[[Any], None], request: dict[str, Any]) -> bool:
        """Starts a request (`add_request` keywords) whose outputs go to `handler` on this loop. False, with the
        handler dropped again, where the library refuses it (stopping after all). Its input queue is unbounded
        here, so this never blocks."""
        request_id = request["request_id"]
        self.library.register_result_handler(request_id, handler)
        if self.library.add_request(**request) is None:
            self.forget(request_id)
            return False
        return True

    def cancel(self, request_id: str) -> None:
        self.library.cancel_request(request_id)

    def forget(self, request_id: str) -> None:
        """Drops a request's output handler: its later outputs go to the shared queue (`discard_unclaimed`)."""
        self.library.output_router.result_handlers.pop(request_id, None)

    def discard_unclaimed(self) -> None:
        """Drops outputs no handler took (the last one or two of a request we already ended): nothing reads the
        library's shared queue, so without this it would only grow."""
        unclaimed: queue.Queue[Any] = self.library.output_router.output_queue
        with contextlib.suppress(queue.Empty):
            while True:
                unclaimed.get_nowait()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix before the library's next prefix lookup (in its thread, which owns the
        ledgers), so no request admitted from now on reuses a block computed before."""
        self._forget_prefixes.set()

    def free_capacity(self) -> float:
        """The free share of the paged cache (1.0 once the manager stopped). Blocks the prefix cache keeps, which no
        request holds, count as free, as vLLM counts them: the library evicts them whenever it needs the room."""
        processor = self.library.batch_processor
        if processor is None:
            return 1.0
        cache = processor.cache
        cached = sum(len(a.ledger.cached_blocks) * a.bytes_per_block for a in cache.cache_allocators.values())
        return float(cache.compute_free_capacity()) + cached / (cache.num_sectors * cache.bytes_per_sector)

    def stop(self, timeout: float, hard_stop: bool = False) -> None:
        """Stops the library's thread, waiting up to `timeout` (blocking: call through a worker thread)."""
        self.library.stop(block=True, timeout=timeout, hard_stop=hard_stop)


def start(model: Any, sizing: EngineConfig, eos_token_ids: tuple[int, ...], hooks: Hooks) -> Manager:
    """Builds a manager for `model`, installs every hook in the order of the module's docstring and starts its
    thread (blocking: call through a worker thread)."""
    restore(model)
    SCHEDULER_MAPPING[SCHEDULER_NAME] = UrgentFirstScheduler
    manager = model.init_continuous_batching(
        # Processors are created only for non-default values; every request then passes its own.
        generation_config=GenerationConfig(
            do_sample=True, temperature=0.5, top_k=50, top_p=0.9, eos_token_id=list(eos_token_ids) or -1
        ),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=sizing.page_size,
            num_blocks=max(1, sizing.kv_cache_tokens // sizing.page_size),
            max_batch_tokens=sizing.max_batch_tokens,
            max_requests_per_batch=sizing.max_running,
            allow_block_sharing=sizing.prefix_sharing,
            per_request_processors=True,
            seed=sizing.seed,
            scheduler_type=SCHEDULER_NAME,
        ),
    )
    paths = fastpath.choose(model, sizing.varlen_attention)
    if paths.varlen_attention:
        AttentionInterface.register(attention.ATTENTION_NAME, attention.varlen_sdpa_forward)
        model.set_attn_implementation(attention.ATTENTION_NAME)
    lean = paths.lean_layers and lean_layers.install(model)
    manager.warmup()  # allocates the paged cache now, so its real size is known before the first request
    processor = manager.batch_processor
    if isinstance(processor.scheduler, UrgentFirstScheduler):
        processor.scheduler.urgent = hooks.urgent
    # The fused sampler goes in wherever CUDA graphs are off (it declines otherwise): per-request seeds,
    # logprobs, penalties and response formats need it, on any device.
    per_row = install_sampler(processor.model_runner, manager.logit_processor, hooks.row_states)
    if per_row:
        install_prompt_scoring(manager, model, hooks.prompt_scores)
    kernel, paged = None, False
    if _runs_our_attention_on_cpu(model):
        kernel = cpu_kernels.load(model.dtype)  # the cache holds the model's dtype
        paged = install_paged_reads(processor.cache, kernel)
    hooks.counters.paths = engine_paths(model, paths.varlen_attention, lean, paged, kernel is not None)
    _count_steps(manager, hooks.counters)
    forget_prefixes = _forget_prefixes_on_request(processor.cache)
    if processor.cache.use_prefix_sharing:
        _count_prefix_lookups(manager, processor.cache, hooks.counters)
    manager.start()
    return Manager(manager, per_row, forget_prefixes)


def restore(model: Any) -> None:
    """Gives the model back its SDPA attention and library layers, for the library's checks and `model.generate`."""
    for handle in vars(model).pop(_SCORING_HOOKS, ()):
        handle.remove()
    lean_layers.uninstall(model)
    if model.config._attn_implementation == attention.ATTENTION_NAME:
        model.set_attn_implementation("sdpa")


def argument_rows(processors: Any) -> ArgumentRows:
    """Where the library's per-request processors (a `ContinuousBatchingLogitsProcessorList`) write temperature,
    top-k and top-p: one row of `logits_processor_args` each, in the order of the processors that fill defaults."""
    rows = {}
    for index, processor in enumerate(p for p in processors.logits_processor if hasattr(p, "fill_defaults")):
        rows[type(processor)] = index
    return ArgumentRows(
        temperature=rows[ContinuousBatchingTemperatureLogitsWarper],
        top_k=rows[ContinuousBatchingTopKLogitsWarper],
        top_p=rows[ContinuousBatchingTopPLogitsWarper],
    )


def install_sampler(runner: Any, processors: Any, row_states: Mapping[str, RowState]) -> bool:
    """Puts the fused sampler into a warmed-up model runner, as its logits processor and its `_sample`; False where
    CUDA graphs (or the asynchronous inputs, which do not list the batch's requests) forbid it."""
    if getattr(runner, "use_cuda_graph_varlen", False) or getattr(runner, "use_cuda_graph_decode", False):
        return False
    batch = runner.inputs_and_outputs
    if not hasattr(batch, "requests_in_batch"):
        return False

    def batch_ids() -> list[str]:
        """The library lays out one logits row per request that gets a token this step, in batch order."""
        return [future.state.request_id for future in batch.requests_in_batch if future.has_new_token]

    sampler = FusedSampler(argument_rows(processors), batch_ids, row_states)
    runner.logit_processor = sampler
    runner._sample = sampler.sample
    return True


def install_prompt_scoring(manager: Any, model: Any, scoring: Mapping[str, PromptScores]) -> None:
    """Scores the prompts in `scoring` as they are prefilled (`prompt_scores`). Around each step, the rows to score
    are planned from the batch (each row's request and chunk); during that step's forward only (in the library's
    thread: never a forward of anyone else's), a pre-hook appends those rows to `logits_to_keep` and a hook takes
    their logits off the output again, so the library sees exactly the logits it asked for. Where the model takes
    no `logits_to_keep`, its logits cover every row already. Prompts being scored get no prefix-cache match."""
    active: dict[str, Any] = {}  # during a step with rows to score: the plan, its thread and the library's row count

    def planned_step() -> None:
        batch = getattr(manager.batch_processor.inputs_and_outputs, "requests_in_batch", [])
        chunks = [(f.state.request_id, f.state.position_offset - f.query_length, f.query_length) for f in batch]
        plan = prompt_scores.plan(chunks, scoring) if scoring else []
        if plan:
            active.update(plan=plan, thread=threading.get_ident())
        try:
            step()
        finally:
            active.clear()

    def before(module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if not active or active["thread"] != threading.get_ident():
            return None
        kept = kwargs.get("logits_to_keep")
        kept = kept if isinstance(kept, torch.Tensor) else None  # None: the model returns every row's logits
        try:
            wanted = torch.tensor(prompt_scores.rows(active["plan"]), dtype=torch.int32, device=model.device)
            if kept is not None:
                kwargs["logits_to_keep"] = torch.cat([kept.to(torch.int32), wanted])
        except Exception as error:  # never into the library's thread: these prompts fail, the step runs as ever
            for chunk in active["plan"]:
                chunk.scores.failed = f"{type(error).__name__}: {error}"
            active.clear()
            return None
        active.update(wanted=wanted, kept=None if kept is None else kept.numel())
        return args, kwargs

    def after(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        if not active or active["thread"] != threading.get_ident() or "wanted" not in active:
            return None
        logits, kept = output.logits, active["kept"]
        if kept is None:
            prompt_scores.score(active["plan"], logits[0, active["wanted"].long()])
            return None
        prompt_scores.score(active["plan"], logits[0, kept:])
        output.logits = logits[:, :kept]
        return output

    step = manager._generation_step
    manager._generation_step = planned_step
    vars(model)[_SCORING_HOOKS] = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    if manager.batch_processor.cache.use_prefix_sharing:
        _no_prefix_match(manager.batch_processor.cache, scoring)


def _no_prefix_match(cache: Any, scoring: Mapping[str, PromptScores]) -> None:
    """A prefix-cache hit skips the positions it matches, whose logits a prompt being scored needs."""
    search = cache.search_prefix_match

    def search_unless_scored(request_id: str, prompt_ids: list[int]) -> int:
        return 0 if request_id in scoring else int(search(request_id, prompt_ids))

    cache.search_prefix_match = search_unless_scored


def supports_paged_reads(cache: Any) -> bool:
    """Only full-attention layers on the index path: sliding windows read a ring, not a request's whole past."""
    allocators = list(getattr(cache, "cache_allocators", {}).values())
    return bool(allocators) and all(isinstance(a, FullAttentionCacheAllocator) for a in allocators)


def install_paged_reads(cache: Any, kernel: cpu_kernels.PagedDecode | None = None) -> bool:
    """Makes this cache's `update` hand attention `PagedKV` instead of copied K/V on steps that read the cache
    (`paged_reads.PagedReads`), decode rows planned for `kernel` where given. Returns False (and changes nothing)
    where the layout is not plain full attention, or where it is installed already."""
    if not supports_paged_reads(cache) or getattr(cache, _PAGED_READS_MARK, False):
        return False
    library_update = cache.update
    reads = PagedReads(kernel)

    def reading(layer_idx: int, kwargs: dict[str, Any]) -> Any:
        """The layer's allocator on a step that reads the cache, else None."""
        allocator = cache.layer_to_allocator[layer_idx]
        read_indices = kwargs.get("read_index")
        if kwargs.get("block_table") is not None or not read_indices or read_indices[allocator.index].numel() == 0:
            return None
        return allocator

    def update(
        key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        allocator = reading(layer_idx, kwargs)
        if allocator is None:
            return library_update(key_states, value_states, layer_idx, kwargs)  # no cache read: nothing to save
        view = allocator._kv_token_views[layer_idx]
        return reads.update(key_states, value_states, view, allocator.index, allocator.layer_type, kwargs)

    def decode_step(
        layer_idx: int, kwargs: dict[str, Any]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], DecodeWrites] | None:
        allocator = reading(layer_idx, kwargs)
        writes = None if allocator is None else reads.decode_writes(allocator.index, allocator.layer_type, kwargs)
        return None if writes is None else (allocator._kv_token_views[layer_idx], writes)

    cache.update = update
    setattr(cache, DECODE_STEP, decode_step)
    setattr(cache, _PAGED_READS_MARK, True)
    return True


def has_paged_reads(cache: Any) -> bool:
    return bool(getattr(cache, _PAGED_READS_MARK, False))


def _runs_our_attention_on_cpu(model: Any) -> bool:
    """Paged reads serve our attention function on the CPU only."""
    return model.config._attn_implementation == attention.ATTENTION_NAME and torch.device(model.device).type == "cpu"


def _asks_few_rows(model: Any) -> bool:
    """Whether the float32 few-row kernel was asked for (`LLMQ_FLOAT32_FEW_ROWS`: prepack marks its layers)."""
    return model.dtype == torch.float32 and any(getattr(m, "float32_few_rows", False) for m in model.modules())


def engine_paths(model: Any, varlen: bool, lean: bool, paged: bool, compiled: bool) -> dict[str, str]:
    """Which implementation runs each part of a step, for `llmq:engine_path`: our attention or the library's, our
    decoder layers or the library's and, where they serve, each native kernel compiled or its torch fallback."""
    paths = {"attention": "varlen" if varlen else "library", "decoder_layers": "lean" if lean else "library"}
    if paged:
        paths["paged_decode"] = "compiled" if compiled else "fallback"
    if torch.device(model.device).type == "cpu" and (model.dtype == torch.bfloat16 or _asks_few_rows(model)):
        paths["few_rows"] = "compiled" if cpu_kernels.few_rows(model.dtype) is not None else "fallback"
    if lean:
        weight = model.get_decoder().layers[0].input_layernorm.weight
        # lean_layers' choice: the native RMSNorm for float32 where it builds (cached: no second build here)
        native = weight.dtype == torch.float32 and cpu_kernels.rms_norm(int(weight.shape[0])) is not None
        paths["rms_norm"] = "compiled" if native else "fallback"
        if weight.device.type == "cpu" and (weight.dtype == torch.bfloat16 or _asks_few_rows(model)):
            # lean_layers' native layer of a few rows (bfloat16, or float32 few-row), where it builds
            dtype, width = weight.dtype, int(weight.shape[0])
            built = cpu_kernels.few_rows(dtype) is not None and cpu_kernels.decoder_layer(width, dtype) is not None
            paths["decoder_layer"] = "compiled" if built else "fallback"
    return paths


def _count_steps(manager: Any, counters: StepCounters) -> None:
    """Wraps the manager's `_generation_step` (called once per forward, in its thread) with the step counters."""
    step = manager._generation_step

    def counted_step() -> None:
        io = manager.batch_processor.inputs_and_outputs
        batch = getattr(io, "requests_in_batch", [])
        # A row decodes when its request already has output; otherwise it is (a chunk of) its prompt. A row gets a
        # token when it decodes or ran its prompt's last chunk: a request's first token comes from its prefill.
        decode = sum(1 for future in batch if future.state.generated_tokens)
        generated = sum(1 for future in batch if future.has_new_token)
        tokens = sum(future.query_length for future in batch)
        step()
        counters.count_step(tokens, decode, generated)

    manager._generation_step = counted_step


def _forget_prefixes_on_request(cache: Any) -> threading.Event:
    """An event that, once set, makes the library's thread forget every cached prefix before its next lookup (the
    scheduler's, for a prompt it is about to schedule): blocks no request holds go back to the pool, and blocks
    requests still hold lose their hashes (so they are freed, not kept, when those end)."""
    wanted = threading.Event()
    search = cache.search_prefix_match

    def search_after_forgetting(request_id: str, prompt_ids: list[int]) -> int:
        if wanted.is_set():
            wanted.clear()
            cache.evict_cached_blocks()
            for allocator in cache.cache_allocators.values():
                allocator.ledger.hash_to_block.clear()
                allocator.ledger.block_to_hash.clear()
        return int(search(request_id, prompt_ids))

    cache.search_prefix_match = search_after_forgetting
    return wanted


def weights_of(model: Any) -> list[tuple[torch.Tensor, int]]:
    """Each parameter with its version: a parameter swapped or changed in place (not through `.data`, which
    autograd does not see either) makes a different list, and cached prefixes computed before are stale. The
    tensors are held, so a new parameter can never pass for a collected one by reusing its id."""
    return [(parameter, parameter._version) for parameter in model.parameters()]


def same_weights(before: list[tuple[torch.Tensor, int]], now: list[tuple[torch.Tensor, int]]) -> bool:
    return len(before) == len(now) and all(a is b and u == v for (a, u), (b, v) in zip(before, now, strict=True))


def _count_prefix_lookups(manager: Any, cache: Any, counters: StepCounters) -> None:
    """Counts the prefix cache's lookups (`search_prefix_match`, in the library's thread) once per request that then
    runs: the scheduler looks a prompt without a match up again every step it waits, so a lookup counts when its
    request's first chunk reaches a step (the latest lookup wins), as vLLM counts a scheduled request's."""
    search = cache.search_prefix_match
    looked_up: dict[str, tuple[int, int]] = {}  # library id -> (prompt tokens, tokens found), until it runs
    counters.prefix_cache_queries = counters.prefix_cache_queries or 0
    counters.prefix_cache_hits = counters.prefix_cache_hits or 0

    def counted_search(request_id: str, prompt_ids: list[int]) -> int:
        hit = int(search(request_id, prompt_ids))
        looked_up.pop(request_id, None)
        looked_up[request_id] = (len(prompt_ids), hit)
        while len(looked_up) > _MAX_LOOKUPS_WAITING:  # requests cancelled before they ran: forget the oldest
            del looked_up[next(iter(looked_up))]
        return hit

    step = manager._generation_step

    def counted_step() -> None:
        batch = getattr(manager.batch_processor.inputs_and_outputs, "requests_in_batch", [])
        for future in batch:
            lookup = looked_up.pop(future.state.request_id, None)
            if lookup is not None:
                counters.count_prefix_lookup(*lookup)
        step()

    cache.search_prefix_match = counted_search
    manager._generation_step = counted_step
