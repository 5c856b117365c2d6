"""What the engine relies on in transformers, checked against the installed version without building a model.

`worker/engine/library.py` is the only code that touches transformers' continuous-batching internals; the lean
layers and our attention also rely on a few modeling names. Every class, private attribute, method signature and
call site they use is listed here. After an upgrade, `test_every_name_we_rely_on_is_still_there` fails in about a
second with the whole list of what moved, instead of an engine that breaks somewhere at run time.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from typing import Any, get_type_hints

import pytest

CB = "transformers.generation.continuous_batching"

# Every name imported from transformers by the engine, as (module, name).
IMPORTS = [
    ("transformers", "AttentionInterface"),
    ("transformers", "GenerationConfig"),
    ("transformers.generation.configuration_utils", "ContinuousBatchingConfig"),
    (CB, "ContinuousBatchingManager"),
    (f"{CB}.cache_allocators.full_attention", "FullAttentionCacheAllocator"),
    (f"{CB}.cb_logits_processors", "ContinuousBatchingTemperatureLogitsWarper"),
    (f"{CB}.cb_logits_processors", "ContinuousBatchingTopKLogitsWarper"),
    (f"{CB}.cb_logits_processors", "ContinuousBatchingTopPLogitsWarper"),
    (f"{CB}.requests", "RequestStatus"),
    (f"{CB}.scheduler", "SCHEDULER_MAPPING"),
    (f"{CB}.scheduler", "FIFOScheduler"),
]

# Methods we call, wrap or replace, as (class, method, leading parameters after `self`, in order). Replacements
# (`_sample`, `_process_candidates`, the cache's `update`, a layer's `forward`) must take what the library passes.
SIGNATURES = [
    (
        f"{CB}.continuous_api.ContinuousMixin",
        "init_continuous_batching",
        ("generation_config", "continuous_batching_config"),
    ),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "warmup", ()),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "start", ()),
    (
        f"{CB}.continuous_api.ContinuousBatchingManager",
        "stop",
        ("block", "timeout", "keep_for_next_session", "hard_stop"),
    ),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "is_running", ()),
    (
        f"{CB}.continuous_api.ContinuousBatchingManager",
        "add_request",
        ("input_ids", "request_id", "max_new_tokens", "streaming"),
    ),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "cancel_request", ("request_id",)),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "register_result_handler", ("request_id", "callback")),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "_generation_step", ()),
    (f"{CB}.continuous_api.BackgroundThreadStatus", "can_accept_new_requests", ()),
    (f"{CB}.cache.PagedAttentionCache", "update", ("key_states", "value_states", "layer_idx", "kwargs")),
    (f"{CB}.cache.PagedAttentionCache", "compute_free_capacity", ()),
    (f"{CB}.cache.PagedAttentionCache", "search_prefix_match", ("request_id", "prompt_ids")),
    (f"{CB}.model_runner.ModelRunner", "_sample", ("scores", "output_ids")),
    (f"{CB}.scheduler.FIFOScheduler", "__init__", ("cache", "safety_margin", "max_requests_per_batch")),
    (
        f"{CB}.scheduler.Scheduler",
        "_process_candidates",
        ("candidates", "token_budget", "cache_budget", "request_ids_to_remove_from_waiting"),
    ),
    (f"{CB}.requests.FutureRequestState", "__init__", ("state", "has_new_token", "complete_blocks", "query_length")),
    (f"{CB}.requests.GenerationOutput", "is_finished", ()),
    ("transformers.PreTrainedModel", "set_attn_implementation", ("attn_implementation",)),
    ("transformers.PreTrainedModel", "get_decoder", ()),
    *(
        (
            f"transformers.models.{family}.modeling_{family}.{prefix}DecoderLayer",
            "forward",
            ("hidden_states", "attention_mask", "position_ids", "cache", "use_cache", "position_embeddings"),
        )
        for family, prefix in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"))
    ),
]

# Attributes we read or overwrite, as (class, attribute): found on the class (a field, property or annotation) or
# assigned as `self.<attribute> = ...` in its source.
ATTRIBUTES = [
    (f"{CB}.continuous_api.ContinuousBatchingManager", "batch_processor"),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "output_router"),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "background_thread_status"),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "logit_processor"),
    (f"{CB}.continuous_api.ContinuousBatchingManager", "model"),
    (f"{CB}.continuous_api.OutputRouter", "result_handlers"),
    (f"{CB}.continuous_api.OutputRouter", "output_queue"),
    (f"{CB}.continuous_api.BackgroundThreadStatus", "fatal_error"),
    (f"{CB}.continuous_api.ContinuousBatchProcessor", "scheduler"),
    (f"{CB}.continuous_api.ContinuousBatchProcessor", "cache"),
    (f"{CB}.continuous_api.ContinuousBatchProcessor", "model_runner"),
    (f"{CB}.continuous_api.ContinuousBatchProcessor", "inputs_and_outputs"),
    (f"{CB}.model_runner.ModelRunner", "logit_processor"),
    (f"{CB}.model_runner.ModelRunner", "inputs_and_outputs"),
    (f"{CB}.model_runner.ModelRunner", "use_cuda_graph_varlen"),
    (f"{CB}.model_runner.ModelRunner", "use_cuda_graph_decode"),
    (f"{CB}.input_outputs.ContinuousBatchingIOs", "requests_in_batch"),
    (f"{CB}.cache.PagedAttentionCache", "num_blocks"),
    (f"{CB}.cache.PagedAttentionCache", "cache_allocators"),
    (f"{CB}.cache.PagedAttentionCache", "layer_to_allocator"),
    (f"{CB}.cache_allocators.cache_allocator.CacheAllocator", "index"),
    (f"{CB}.cache_allocators.cache_allocator.CacheAllocator", "layer_type"),
    (f"{CB}.cache_allocators.full_attention.FullAttentionCacheAllocator", "_kv_token_views"),
    (f"{CB}.cb_logits_processors.ContinuousBatchingLogitsProcessorList", "logits_processor"),
    (f"{CB}.cb_logits_processors.ContinuousBatchingTemperatureLogitsWarper", "fill_defaults"),
    (f"{CB}.cb_logits_processors.ContinuousBatchingTopKLogitsWarper", "fill_defaults"),
    (f"{CB}.cb_logits_processors.ContinuousBatchingTopPLogitsWarper", "fill_defaults"),
    (f"{CB}.requests.FutureRequestState", "state"),
    (f"{CB}.requests.FutureRequestState", "has_new_token"),
    (f"{CB}.requests.FutureRequestState", "query_length"),
    (f"{CB}.requests.RequestState", "request_id"),
    (f"{CB}.requests.RequestState", "position_offset"),
    (f"{CB}.requests.RequestState", "status"),
    (f"{CB}.requests.RequestState", "generated_tokens"),
    (f"{CB}.requests.RequestStatus", "DECODING"),
    (f"{CB}.requests.GenerationOutput", "request_id"),
    (f"{CB}.requests.GenerationOutput", "generated_tokens"),
    (f"{CB}.requests.GenerationOutput", "error"),
    ("transformers.PretrainedConfig", "_attn_implementation"),
    ("transformers.models.llama.modeling_llama.LlamaAttention", "head_dim"),
    ("transformers.models.llama.modeling_llama.LlamaAttention", "scaling"),
    ("transformers.models.llama.modeling_llama.LlamaAttention", "layer_idx"),
    ("transformers.models.llama.modeling_llama.LlamaRMSNorm", "variance_epsilon"),
]

# Where the library calls what we replace: (function, text its source must contain). Overwriting an instance's
# `_sample` or `_generation_step` works only while the library calls it through `self`; our scheduler only while the
# manager picks its class by name from the mapping.
CALL_SITES = [
    (f"{CB}.continuous_api.ContinuousBatchingManager._create_batch_processor", "SCHEDULER_MAPPING.get(scheduler_type"),
    (
        f"{CB}.continuous_api.ContinuousBatchingManager._create_batch_processor",
        "continuous_batching_config.scheduler_type",
    ),
    (f"{CB}.continuous_api.ContinuousBatchingManager._generation_loop_body", "self._generation_step()"),
    (f"{CB}.scheduler.FIFOScheduler.schedule_batch", "self._process_candidates("),
    (f"{CB}.model_runner.ModelRunner._forward_process_and_sample", "self.logit_processor.do_processing"),
    (f"{CB}.model_runner.ModelRunner._forward_process_and_sample", "self.logit_processor("),
    (f"{CB}.model_runner.ModelRunner._forward_process_and_sample", "self._sample(scores, output_ids)"),
    (f"{CB}.scheduler.Scheduler._infer_request_tokens", "self.cache.search_prefix_match("),
    (f"{CB}.cache.PagedAttentionCache.__init__", "self.use_prefix_sharing"),
    # `Manager.free_capacity`: the blocks the prefix cache keeps are free room, and where they are counted.
    (f"{CB}.cache.PagedAttentionCache.__init__", "self.num_sectors"),
    (f"{CB}.cache.PagedAttentionCache.__init__", "self.bytes_per_sector"),
    (f"{CB}.cache_allocators.cache_allocator.CacheAllocator._before_cache_tensor_init", "self.ledger = BlockLedger()"),
    (f"{CB}.cache_allocators.cache_allocator.CacheAllocator._before_cache_tensor_init", "self.bytes_per_block"),
    (f"{CB}.cache_allocators.cache_allocator.BlockLedger.__init__", "self.cached_blocks"),
    # `UrgentFirstScheduler._try_to_meet_safety_margin`: least recently used eviction in place of the library's.
    (f"{CB}.scheduler.Scheduler._process_candidates", "self._try_to_meet_safety_margin()"),
    (f"{CB}.scheduler.Scheduler._try_to_meet_safety_margin", "self.cache.evict_cached_blocks()"),
    (f"{CB}.cache_allocators.cache_pool.CachePool.free_blocks", "self._free_blocks[index].add_leaves(block_ids)"),
    (f"{CB}.cache_allocators.cache_allocator.BlockLedger.release", "self.cached_blocks[block_id] = None"),
    (f"{CB}.cache_allocators.cache_allocator.BlockLedger.acquire", "self.cached_blocks.pop(block_id)"),
    # `_forget_prefixes_on_request`: what a reset clears, before the scheduler's lookup.
    (f"{CB}.cache_allocators.cache_allocator.BlockLedger.__init__", "self.hash_to_block"),
    (f"{CB}.cache_allocators.cache_allocator.BlockLedger.__init__", "self.block_to_hash"),
    (f"{CB}.cache.PagedAttentionCache.evict_cached_blocks", "allocator.ledger.evict_cached_blocks()"),
    (f"{CB}.cache.PagedAttentionCache.compute_free_capacity", "self.pool.free_sectors"),
    # Prompt scoring: a batch's rows are planned after its chunks advanced their requests' offsets, and the logits
    # the model returns for `logits_to_keep` are used as they come (`library.install_prompt_scoring`).
    (f"{CB}.input_outputs.ContinuousBatchingIOs.prepare_batch_tensors", "state.position_offset += query_length"),
    (f"{CB}.model_runner.ModelRunner.compute_batch", 'batch_data["logits_to_keep"] = batch_data["logits_indices"]'),
    (f"{CB}.model_runner.ModelRunner._forward_process_and_sample", 'if "logits_to_keep" not in batch_data:'),
    (f"{CB}.model_runner.ModelRunner._forward_process_and_sample", "logits = model(**batch_data).logits"),
    ("transformers.models.llama.modeling_llama.LlamaAttention.forward", "cache.update("),
    ("transformers.models.llama.modeling_llama.LlamaAttention.forward", "self.config._attn_implementation"),
]

# The attention keyword arguments of a continuous-batching step that our attention and paged reads read.
STEP_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index", "block_table")

# The `ContinuousBatchingConfig` fields `library.start` sets.
CONFIG_FIELDS = (
    "page_size",
    "num_blocks",
    "max_batch_tokens",
    "max_requests_per_batch",
    "allow_block_sharing",
    "per_request_processors",
    "seed",
    "scheduler_type",
)


def _resolve(path: str) -> Any:
    """`package.module.Class.member` to its object, importing the longest module prefix."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            target = getattr(target, part)
        return target
    raise ImportError(path)


def _source(target: Any) -> str:
    classes = target.__mro__ if inspect.isclass(target) else [target]
    texts = []
    for item in classes:
        with_source = item is not object and getattr(item, "__module__", "").startswith("transformers")
        if with_source:
            texts.append(inspect.getsource(item))
    return "\n".join(texts)


def _has_attribute(cls: type, name: str) -> bool:
    if any(name in vars(klass) or name in getattr(klass, "__annotations__", {}) for klass in cls.__mro__):
        return True
    if dataclasses.is_dataclass(cls) and name in {field.name for field in dataclasses.fields(cls)}:
        return True
    assigned = re.compile(rf"self\.{re.escape(name)}\b(\s*:[^=\n]+)?\s*(,[^=\n]*)?=(?!=)")
    return bool(assigned.search(_source(cls)))


def _import_problems() -> list[str]:
    problems = []
    for module, name in IMPORTS:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as error:
            problems.append(f"import {module}.{name}: {error}")
    return problems


def _signature_problems() -> list[str]:
    problems = []
    for path, method, leading in SIGNATURES:
        try:
            parameters = list(inspect.signature(getattr(_resolve(path), method)).parameters)
        except (ImportError, AttributeError, ValueError, TypeError) as error:
            problems.append(f"{path}.{method}: {error}")
            continue
        parameters = parameters[1:] if parameters[:1] == ["self"] else parameters
        if tuple(parameters[: len(leading)]) != leading:
            problems.append(f"{path}.{method}: parameters {parameters}, expected to start with {list(leading)}")
    return problems


def _attribute_problems() -> list[str]:
    problems = []
    for path, name in ATTRIBUTES:
        try:
            if not _has_attribute(_resolve(path), name):
                problems.append(f"{path}.{name}: no such attribute")
        except (ImportError, AttributeError, OSError, TypeError) as error:
            problems.append(f"{path}.{name}: {error}")
    for path, text in CALL_SITES:
        try:
            if text not in inspect.getsource(_resolve(path)):
                problems.append(f"{path}: no longer contains {text!r}")
        except (ImportError, AttributeError, OSError, TypeError) as error:
            problems.append(f"{path}: {error}")
    return problems


def _field_problems() -> list[str]:
    problems = []
    try:
        arguments = get_type_hints(_resolve(f"{CB}.input_outputs.PagedAttentionArgs"))
        problems += [f"PagedAttentionArgs.{key}: gone" for key in STEP_ARGUMENTS if key not in arguments]
    except (ImportError, AttributeError, NameError) as error:
        problems.append(f"PagedAttentionArgs: {error}")
    try:
        config = _resolve("transformers.generation.configuration_utils.ContinuousBatchingConfig")
        fields = {field.name for field in dataclasses.fields(config)}
        problems += [f"ContinuousBatchingConfig.{name}: gone" for name in CONFIG_FIELDS if name not in fields]
    except (ImportError, AttributeError, TypeError) as error:
        problems.append(f"ContinuousBatchingConfig: {error}")
    return problems


def _problems() -> list[str]:
    return [*_import_problems(), *_signature_problems(), *_attribute_problems(), *_field_problems()]


def test_every_name_we_rely_on_is_still_there() -> None:
    problems = _problems()
    assert not problems, "transformers moved what the engine relies on:\n" + "\n".join(problems)


def test_our_scheduler_is_the_one_the_manager_picks_by_name() -> None:
    from transformers.generation.continuous_batching import continuous_api, scheduler

    from worker.engine import library

    assert continuous_api.SCHEDULER_MAPPING is scheduler.SCHEDULER_MAPPING, "the manager reads the same mapping"
    assert issubclass(library.UrgentFirstScheduler, scheduler.FIFOScheduler)
    config = library.ContinuousBatchingConfig(scheduler_type=library.SCHEDULER_NAME)
    assert config.scheduler_type == library.SCHEDULER_NAME


def test_the_sampler_finds_its_rows_in_the_librarys_processor_list() -> None:
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessorList,
    )
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from worker.engine.library import argument_rows

    processors = ContinuousBatchingLogitsProcessorList(
        LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(50), TopPLogitsWarper(0.9)]),
        per_request_processors=True,
    )
    rows = argument_rows(processors)
    assert sorted((rows.temperature, rows.top_k, rows.top_p)) == [0, 1, 2]


def test_the_check_itself_reports_what_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    monkeypatch.delattr(ModelRunner, "_sample")
    assert any(problem.startswith(f"{CB}.model_runner.ModelRunner._sample") for problem in _problems())
