"""Engine throughput on a busy workload: our engine vs the library's own continuous batching vs static padded
`model.generate` batches vs one request at a time, with the matmul-only limit and a lone request's latency.

    python -m bench.engine [--quick] [--all-at-once] [--requests N] [--sequential-every K] [--device D --dtype T]
                           [--quantize int8] [--float32-few-rows] [--exact-rows] [--no-bfloat16]

Default workload (a busy service): more requests than slots, `max_running` 32, static batches of at most 32 (the
same memory), prompts 16-256 tokens, output lengths heavy-tailed (70 % 16-64, 30 % 128-384), greedy, EOS ignored,
in arrival order. `--requests` defaults to 64, not 256: on 2 CPU cores the four ways over 256 such requests take
well over half an hour (one request at a time alone ~40 min); 64 keeps the shape (twice the slots, two static
batches, the same length mix). One-at-a-time `generate` runs on every K-th request (`--sequential-every`, 4 by
default); its tokens/s stands for the whole workload (at batch 1 a token costs about the same in any request), and
outputs are compared on that subset. `--all-at-once`: the old workload (32 requests, max_new_tokens 16-128, 32 slots).

Useful tokens/s counts only the tokens each request asked for. `limit_fraction`: the time the engine's own steps
would take if each cost only its matrix multiplies (every step's token and logits-row counts are recorded; the
model's linear layers are timed on those shapes right after the engine's run), over the engine's time; the same
ratio over the decode-only steps alone (`decode_limit_fraction`) and over the steps that ran a prompt chunk
(`prefill_limit_fraction`), with the decode-only steps' share of the step time (`decode_time_share`).
`b1_fraction`: one row's matrix multiplies over a lone request's decode ms/token on the idle engine, the two
measured back to back in three rounds (the median ratio), since a shared machine's speed drifts over minutes.
Linear layers run as the loader prepares them (pre-packed on float32 CPU) in every way, so the ratios compare the
same matrix multiplies.

`--quantize int8` also runs the engine way on the same model loaded with `quantize="int8"` (`LLMQ_QUANTIZE`):
`int8_speedup` is its tokens/s over float32's, and agreement compares its greedy outputs with the float32 engine's,
request by request: `int8_first_diff_mean`, the mean index of the first differing token (a request without a
difference counts as its length), and `int8_identical`, the fraction of requests with no difference.
`--float32-few-rows` does the same for the model loaded with `float32_few_rows=True` (`LLMQ_FLOAT32_FEW_ROWS`: decode
steps of up to 6 rows, 16 with AVX-512, on the float32 few-row kernel): `few_rows_engine_tok_s`, `few_rows_speedup`,
`few_rows_lone_decode_ms`, `few_rows_first_diff_mean`, `few_rows_identical`.

Bfloat16 (`LLMQ_DTYPE=bfloat16`), on a CPU with native bfloat16 products (AVX-512 BF16 / AMX; `--no-bfloat16`
skips it): the engine way again on the model loaded in bfloat16, and bfloat16 `generate` one at a time on the same
subset. `bf16_engine_tok_s`, `bf16_lone_decode_ms`, `bf16_ratio_float32` (busy tokens/s over float32's),
`bf16_matches_generate` (requests of the subset equal to bfloat16 `generate`'s), `bf16_first_diff_mean` (the mean
first differing token against the float32 engine's outputs; `bf16_subset_first_diff_mean` on the subset alone, and
`bf16_generate_first_diff_mean` the same for bfloat16 `generate` on that subset: which of the two bfloat16 ways stays
closer to float32, as neither computes exactly as the other), `bf16_generate_batched_matches` (the subset's requests
whose bfloat16 `generate` in one padded batch equals its one-at-a-time outputs: how far the reference agrees with
itself once its rows share a product; float32's `static_matches_sequential` is alike, over batches of 32) and
`bf16_logprob_diff_mean` (the float32 engine's greedy tokens scored by both models, teacher-forced: the mean absolute
difference of their log-probabilities per token).
`lone_bound_ms` (and `bf16_lone_bound_ms`): the bytes of every weight a decode step multiplies, over the read
bandwidth measured here (`read_gb_s`): what a lone token would cost if reading the weights were all it did.

`--exact-rows` also runs the engine way with each product at its exact row count, as before products were padded
to a bounded set of row counts (`prepack.row_bucket`, which keeps a worker's memory flat), alternating with the
padded way twice in this process: `padded_speedup` is the exact way's best time over the padded way's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from bench.workload import Job, load_bench_model, make_workload, peak_rss_mb, print_json
from worker.engine import Engine, EngineConfig, EngineRequest, GenerationParams, lean_layers, openmp, prepack
from worker.engine.kernels.cpu_kernels import native_bfloat16
from worker.engine.loader import DEFAULT_MODEL, LoadOptions, load_model
from worker.engine.quantize import quantize_int8

MAX_RUNNING = 32
BFLOAT16_KEYS = (
    "bf16_engine_tok_s",
    "bf16_lone_decode_ms",
    "bf16_ratio_float32",
    "bf16_matches_generate",
    "bf16_first_diff_mean",
    "bf16_subset_first_diff_mean",
    "bf16_generate_first_diff_mean",
    "bf16_generate_batched_matches",
    "bf16_logprob_diff_mean",
    "bf16_lone_bound_ms",
)
PAGE = 32


def load(quick: bool, device: str, dtype: str) -> tuple[Any, Any, str]:
    if quick:
        return load_bench_model(True)
    model, tokenizer = load_model(DEFAULT_MODEL, LoadOptions(device=device, dtype=dtype))
    return model, tokenizer, "SmolLM2-135M-Instruct"


def load_int8(quick: bool, device: str, dtype: str) -> Any:
    """The same model with its body in int8; the tiny random one is rebuilt from its seed and converted."""
    if quick:
        model = load_bench_model(True)[0]
        quantize_int8(model)
        return model
    return load_model(DEFAULT_MODEL, LoadOptions(device=device, dtype=dtype, quantize="int8"))[0]


def load_float32_few_rows(quick: bool, device: str, dtype: str) -> Any:
    """The same model with the float32 few-row kernel asked for; the tiny random one is rebuilt and so marked."""
    if quick:
        model = load_bench_model(True)[0]
        for module in model.modules():
            if isinstance(module, prepack.PackedLinear):
                module.float32_few_rows = True
        return model
    return load_model(DEFAULT_MODEL, LoadOptions(device=device, dtype=dtype, float32_few_rows=True))[0]


def load_bfloat16(quick: bool, device: str) -> Any:
    """The same model loaded in bfloat16; the tiny random one is saved again from its seed and loaded so."""
    if quick:
        from testing.tiny_models import save_tiny_model

        folder = save_tiny_model(Path(tempfile.mkdtemp(prefix="llmq-bench-")), "llama", max_positions=2048)
        return ignoring_eos(load_model(str(folder), LoadOptions(dtype="bfloat16", cache_dir=folder / "cache"))[0])
    return ignoring_eos(load_model(DEFAULT_MODEL, LoadOptions(device=device, dtype="bfloat16"))[0])


def ignoring_eos(model: Any) -> Any:
    """`model` with EOS ignored by `generate`, as the engine's requests ignore it (`ignore_eos`): every request
    generates all it asked for, so a reference never ends early where the engine goes on."""
    model.generation_config.eos_token_id = None
    return model


def busy_workload(vocab_size: int, count: int, seed: int = 0) -> list[Job]:
    """Prompts 16-256; outputs heavy-tailed: 70 % 16-64 tokens, 30 % 128-384."""
    rng = random.Random(seed)
    jobs = []
    for index in range(count):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 256))]
        new = rng.randint(16, 64) if rng.random() < 0.7 else rng.randint(128, 384)
        jobs.append(Job(index, prompt, new))
    return jobs


def load_busy(
    requests: int, spec: str = DEFAULT_MODEL, options: LoadOptions | None = None
) -> tuple[Any, Any, list[Job]]:
    """The model with EOS ignored (every request generates all it asked for), its tokenizer and the busy workload."""
    model, tokenizer = load_model(spec, options)
    return ignoring_eos(model), tokenizer, busy_workload(model.config.vocab_size, requests)


def engine_config(jobs: list[Job], max_running: int) -> EngineConfig:
    """Room for `max_running` worst-case requests, so admission is bound by slots, not by KV blocks."""
    longest = max(len(job.prompt_ids) + job.max_new_tokens for job in jobs)
    tokens = max_running * -(-longest // PAGE) * PAGE
    return EngineConfig(kv_cache_tokens=tokens, page_size=PAGE, max_batch_tokens=512, max_running=max_running)


@dataclass
class EngineProbe:
    """What `run_engine` measures besides time, when asked: the mean decode rows per step of the workload, and the
    decode ms/token of one request alone on the idle engine with one row's matrix-multiply time, measured together
    before the workload."""

    mean_decode_rows: float = 0.0
    lone_decode_ms: float = 0.0
    one_row_ms: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)  # every workload step, in order


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step of the workload: what it ran and how long it took (from the previous step's end)."""

    tokens: int
    rows: int  # logits rows: its decode rows, plus the prompt chunk(s) it ran (counted as one)
    prefill: bool  # it ran (a chunk of) a prompt
    seconds: float


async def run_engine(
    model: Any, tokenizer: Any, jobs: list[Job], config: EngineConfig, probe: EngineProbe | None = None
) -> tuple[float, list[list[int]]]:
    steps: list[tuple[int, int, float]] = []  # (tokens, decode rows so far, end time), appended by the engine's thread
    openmp.release_idle_threads()  # this thread's torch work (other ways, bounds) would slow the engine's regions
    async with Engine(model, tokenizer, config) as engine:
        # Warm the kernels once so no run pays for first-call setup.
        await _drain(engine.submit(EngineRequest("warmup", input_ids=jobs[0].prompt_ids, params=_greedy(4))))
        if probe is not None:
            probe.lone_decode_ms, probe.one_row_ms = await _lone_against_matmul(engine, model, jobs[0].prompt_ids[:64])
        counters = engine.counters
        engine.observe_steps(lambda step: steps.append((step.tokens, counters.decode_tokens, time.perf_counter())))
        decode_before = counters.decode_tokens
        start = time.perf_counter()
        streams = [
            engine.submit(EngineRequest(f"r{job.index}", input_ids=job.prompt_ids, params=_greedy(job.max_new_tokens)))
            for job in jobs
        ]
        outputs = await asyncio.gather(*(_drain(stream) for stream in streams))
        seconds = time.perf_counter() - start
    if probe is not None:
        previous, previous_end = decode_before, start
        for tokens, decoded, end in steps:
            rows, prefill = decoded - previous, tokens > decoded - previous
            probe.steps.append(StepRecord(tokens, rows + prefill, prefill, end - previous_end))
            previous, previous_end = decoded, end
        probe.mean_decode_rows = (previous - decode_before) / max(1, len(steps))
    return seconds, outputs


async def _lone_against_matmul(engine: Engine, model: Any, prompt: list[int], rounds: int = 3) -> tuple[float, float]:
    """A lone request's decode ms/token and one row's matrix-multiply ms, measured back to back `rounds` times; the
    round with the median ratio. Together, because a shared machine's speed drifts over the minutes between the
    engine's run and the bound's timing at the end, which moved `b1_fraction` by a fifth either way."""
    bound = MatmulBound(model)
    pairs = []
    for _ in range(rounds):
        lone_ms = await _lone_decode_ms(engine, prompt)
        pairs.append((lone_ms, bound.time_ms(False, 1) + bound.time_ms(True, 1)))
        openmp.release_idle_threads()  # the bound ran here: as in `run_engine`
    pairs.sort(key=lambda pair: pair[1] / pair[0])
    return pairs[len(pairs) // 2]


async def _lone_decode_ms(engine: Engine, prompt: list[int], tokens: int = 48) -> float:
    """Decode ms per token of one request on an idle engine (from its first token to its last)."""
    stamps: list[float] = []
    async for delta in engine.submit(EngineRequest("lone", input_ids=prompt, params=_greedy(tokens))):
        stamps.extend(time.perf_counter() for _ in delta.token_ids)
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def run_library(model: Any, jobs: list[Job], config: EngineConfig) -> tuple[float, list[list[int]]]:
    """transformers' own continuous-batching manager, same sizing, no adapter: all requests queued at once."""
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=config.page_size,
            num_blocks=config.kv_cache_tokens // config.page_size,
            max_batch_tokens=config.max_batch_tokens,
            max_requests_per_batch=config.max_running,
        ),
    )
    manager.start()
    try:
        manager.add_request(jobs[0].prompt_ids, request_id="warmup", max_new_tokens=4)
        manager.get_result(timeout=600)
        start = time.perf_counter()
        for job in jobs:
            manager.add_request(job.prompt_ids, request_id=f"r{job.index}", max_new_tokens=job.max_new_tokens)
        outputs: dict[str, list[int]] = {}
        while len(outputs) < len(jobs):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("the library's manager stopped before finishing the workload")
            if result.is_finished():
                outputs[result.request_id] = list(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=60)
    return seconds, [outputs[f"r{job.index}"] for job in jobs]


def run_static(model: Any, tokenizer: Any, jobs: list[Job], batch_size: int) -> tuple[float, list[list[int]]]:
    """Padded batches in arrival order; each runs until its longest request has all its tokens."""
    outputs: list[list[int]] = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    for first in range(0, len(jobs), batch_size):
        batch = jobs[first : first + batch_size]
        width = max(len(job.prompt_ids) for job in batch)
        ids = torch.tensor([[pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask.to(model.device),
                do_sample=False,
                pad_token_id=pad,
                max_new_tokens=max(job.max_new_tokens for job in batch),
            )
        outputs.extend(out[row, width : width + job.max_new_tokens].tolist() for row, job in enumerate(batch))
    return time.perf_counter() - start, outputs


def run_sequential(model: Any, jobs: list[Job]) -> tuple[float, list[list[int]]]:
    outputs = []
    start = time.perf_counter()
    for job in jobs:
        with torch.no_grad():
            ids = torch.tensor([job.prompt_ids], device=model.device)
            out = model.generate(ids, do_sample=False, max_new_tokens=job.max_new_tokens)
        outputs.append(out[0, len(job.prompt_ids) :].tolist())
    return time.perf_counter() - start, outputs


Product = tuple[Callable[[torch.Tensor], torch.Tensor], int]  # a matrix product and its input width


class MatmulBound:
    """Matrix-multiply time alone, with the products a step of the engine runs on the model's own weights: the body's
    at `tokens` rows (stacked q/k/v and gate/up where the engine's lean layers stack them, else every linear layer)
    plus the output head at `rows` rows, timed on a grid of sizes (best of a few) and interpolated."""

    GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048)

    def __init__(self, model: Any) -> None:
        head = model.get_output_embeddings()
        self.head: list[Product] = [(head, head.in_features)]
        layers = list(getattr(model.get_decoder(), "layers", []))
        if lean_layers.supports_config(model.config) and layers and all(map(lean_layers.supports, layers)):
            self.body = [product for layer in layers for product in lean_layers.layer_products(layer)]
        else:
            linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
            self.body = [(linear, linear.in_features) for linear in linears]
        self._weight = head.weight
        self._timed: dict[tuple[bool, int], float] = {}

    def step_ms(self, tokens: int, rows: int) -> float:
        return self._interpolated(False, tokens) + self._interpolated(True, rows)

    def _interpolated(self, head: bool, size: int) -> float:
        upper = next((g for g in self.GRID if g >= size), self.GRID[-1])
        lower = max((g for g in self.GRID if g <= size), default=upper)
        low, high = self._ms(head, lower), self._ms(head, upper)
        return low if upper == lower else low + (high - low) * (size - lower) / (upper - lower)

    def _ms(self, head: bool, size: int) -> float:
        if (head, size) not in self._timed:
            self._timed[head, size] = self.time_ms(head, size)
        return self._timed[head, size]

    def time_ms(self, head: bool, size: int) -> float:
        """The head's (or the body's) products at `size` rows, timed now (best of a few), not from the grid."""
        return _best_ms(self.head if head else self.body, size, self._weight, repeats=5 if size <= 64 else 2)


def _best_ms(products: list[Product], rows: int, like: torch.Tensor, repeats: int) -> float:
    """The best of `repeats` runs of every product on random `rows` of `like`'s dtype and device."""
    device = like.device
    inputs = [torch.randn(rows, width, dtype=like.dtype, device=device) for _, width in products]
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first is a warm-up (and packs stacked weights)
            _sync(device)
            start = time.perf_counter()
            for (product, _), x in zip(products, inputs, strict=True):
                product(x)
            _sync(device)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_differences(outputs: list[list[int]], references: list[list[int]]) -> list[int]:
    """Per request, the index of its first token that differs from the reference's (the reference's length if none)."""
    return [
        next((i for i, (a, b) in enumerate(itertools.zip_longest(out, ref)) if a != b), len(ref))
        for out, ref in zip(outputs, references, strict=True)
    ]


def mean_first_difference(outputs: list[list[int]], references: list[list[int]]) -> float:
    """`first_differences` averaged over the requests, to one decimal."""
    firsts = first_differences(outputs, references)
    return round(sum(firsts) / len(firsts), 1)


def limit_by_kind(steps: list[StepRecord], bounds: list[float]) -> dict[str, float | None]:
    """`limit_fraction` over the decode-only steps and over the steps that ran a prompt chunk, and the decode-only
    steps' share of the step time: which kind of step the distance to the bound is in."""
    figures: dict[str, float | None] = {}
    for kind, prefill in (("decode", False), ("prefill", True)):
        chosen = [(step.seconds, bound) for step, bound in zip(steps, bounds, strict=True) if step.prefill is prefill]
        spent = sum(seconds for seconds, _ in chosen)
        figures[f"{kind}_limit_fraction"] = round(sum(bound for _, bound in chosen) / spent, 3) if spent else None
    total = sum(step.seconds for step in steps)
    decode_s = sum(step.seconds for step in steps if not step.prefill)
    figures["decode_time_share"] = round(decode_s / total, 3) if total else 0.0
    return figures


@dataclass
class Variant:
    """A float32 engine that trades exact agreement for speed (int8 weights, the few-row kernel), run on the same
    jobs: its time, outputs and probe once run."""

    prefix: str
    model: Any
    seconds: float | None = None
    outputs: list[list[int]] | None = None
    probe: EngineProbe = field(default_factory=EngineProbe)

    def run(self, tokenizer: Any, jobs: list[Job], config: Any, useful: int) -> None:
        self.seconds, self.outputs = asyncio.run(run_engine(self.model, tokenizer, jobs, config, self.probe))
        _report(f"engine {self.prefix}", self.seconds, useful)

    def figures(self, useful: int, float32_s: float, references: list[list[int]]) -> dict[str, Any]:
        """Its speed against the float32 engine's and the agreement of their greedy outputs (all None if not run)."""
        if self.seconds is None or self.outputs is None:
            keys = ("engine_tok_s", "speedup", "lone_decode_ms", "first_diff_mean", "identical")
            return {f"{self.prefix}_{key}": None for key in keys}
        firsts = first_differences(self.outputs, references)
        identical = sum(f == len(r) for f, r in zip(firsts, references, strict=True)) / len(firsts)
        return {
            f"{self.prefix}_engine_tok_s": round(useful / self.seconds, 2),
            f"{self.prefix}_speedup": round(float32_s / self.seconds, 3),
            f"{self.prefix}_lone_decode_ms": round(self.probe.lone_decode_ms, 2),
            f"{self.prefix}_first_diff_mean": round(sum(firsts) / len(firsts), 1),
            f"{self.prefix}_identical": round(identical, 3),
        }

    def summary(self, figures: dict[str, Any]) -> str:
        """One line of its figures, for the report."""
        prefix = self.prefix
        return (
            f"{prefix}: {figures[f'{prefix}_speedup']}x float32's tok/s, lone {figures[f'{prefix}_lone_decode_ms']} "
            f"ms/token; greedy outputs first differ at token {figures[f'{prefix}_first_diff_mean']} on average, "
            f"{figures[f'{prefix}_identical']} of requests identical"
        )


VARIANTS = ("int8", "few_rows")


def variant_figures(
    variants: list[Variant], useful: int, float32_s: float, references: list[list[int]]
) -> dict[str, Any]:
    """Every variant's figures, None for those not run, so that the JSON line always has the same keys."""
    ran = {variant.prefix: variant for variant in variants}
    return {
        key: value
        for prefix in VARIANTS
        for key, value in ran.get(prefix, Variant(prefix, None)).figures(useful, float32_s, references).items()
    }


def bfloat16_figures(
    model: Any,
    bf16_model: Any,
    tokenizer: Any,
    jobs: list[Job],
    subset: list[Job],
    config: EngineConfig,
    engine_s: float,
    engine_out: list[list[int]],
) -> dict[str, Any]:
    """The bfloat16 engine's speed against float32's and its outputs against bfloat16 `generate` and float32."""
    useful = sum(job.max_new_tokens for job in jobs)
    probe = EngineProbe()
    bf16_s, bf16_out = asyncio.run(run_engine(bf16_model, tokenizer, jobs, config, probe))
    _report("engine bf16", bf16_s, useful)
    _, references = run_sequential(bf16_model, subset)
    _, batched = run_static(bf16_model, tokenizer, subset, len(subset))  # the reference against itself, batched
    bf16_subset = [bf16_out[job.index] for job in subset]
    float32_subset = [engine_out[job.index] for job in subset]
    return {
        "bf16_engine_tok_s": round(useful / bf16_s, 2),
        "bf16_lone_decode_ms": round(probe.lone_decode_ms, 2),
        "bf16_ratio_float32": round(engine_s / bf16_s, 3),
        "bf16_matches_generate": sum(out == ref for out, ref in zip(bf16_subset, references, strict=True)),
        "bf16_first_diff_mean": mean_first_difference(bf16_out, engine_out),
        "bf16_subset_first_diff_mean": mean_first_difference(bf16_subset, float32_subset),
        "bf16_generate_first_diff_mean": mean_first_difference(references, float32_subset),
        "bf16_generate_batched_matches": sum(out == ref for out, ref in zip(batched, references, strict=True)),
        "bf16_logprob_diff_mean": round(logprob_difference(model, bf16_model, subset, engine_out), 4),
        "bf16_lone_bound_ms": round(weight_bytes(bf16_model) / read_bytes_per_ms(), 2),
    }


def logprob_difference(model: Any, other: Any, jobs: list[Job], outputs: list[list[int]]) -> float:
    """The mean absolute difference per generated token of the two models' log-probabilities of `model`'s own
    greedy `outputs`, each sequence teacher-forced through both."""
    total, count = 0.0, 0
    with torch.no_grad():
        for job in jobs:
            generated = outputs[job.index]
            ids = torch.tensor([job.prompt_ids + generated])
            start = len(job.prompt_ids) - 1
            picked = ids[0, start + 1 :].unsqueeze(1)
            scores = [
                torch.log_softmax(m(ids).logits[0, start:-1].float(), dim=-1).gather(1, picked) for m in (model, other)
            ]
            total += float((scores[0] - scores[1]).abs().sum())
            count += len(generated)
    return total / max(1, count)


def weight_bytes(model: Any) -> int:
    """The bytes of the weights a decode step reads: every linear layer's once (a tied head counted as the head)."""
    linears = {id(m): m for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(m.weight.numel() * m.weight.element_size() for m in linears.values())


def read_bytes_per_ms(megabytes: int = 512, repeats: int = 5) -> float:
    """This machine's read bandwidth (bytes/ms) with torch's threads: the best of a few sums over a buffer far
    larger than the caches."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / (best * 1e3)


def padding_figures(model: Any, tokenizer: Any, jobs: list[Job], config: EngineConfig, useful: int) -> dict[str, Any]:
    """The engine way with exact row counts against padded ones, alternating twice (the machine drifts)."""
    exact_s, padded_s = [], []
    for _ in range(2):
        with exact_rows():
            exact_s.append(asyncio.run(run_engine(model, tokenizer, jobs, config))[0])
        _report("engine exact", exact_s[-1], useful)
        padded_s.append(asyncio.run(run_engine(model, tokenizer, jobs, config))[0])
        _report("engine padded", padded_s[-1], useful)
    return {
        "exact_rows_tok_s": round(useful / min(exact_s), 2),
        "padded_rows_tok_s": round(useful / min(padded_s), 2),
        "padded_speedup": round(min(exact_s) / min(padded_s), 3),
    }


@contextlib.contextmanager
def exact_rows() -> Iterator[None]:
    """Products at their exact row counts while inside (the behaviour before padding), for `--exact-rows`."""
    padded = prepack.row_bucket
    prepack.row_bucket = lambda rows: rows
    try:
        yield
    finally:
        prepack.row_bucket = padded


def _report(label: str, seconds: float, useful: int) -> None:
    print(f"{label:<14} {seconds:7.2f} s  {useful / seconds:8.1f} useful tok/s   peak RSS {peak_rss_mb():.0f} MB")


def _greedy(max_new_tokens: int) -> GenerationParams:
    return GenerationParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)


async def _drain(stream: Any) -> list[int]:
    return [token async for delta in stream for token in delta.token_ids]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, finishes in under a minute")
    parser.add_argument("--all-at-once", action="store_true", help="the old workload: 32 requests, all in one batch")
    parser.add_argument("--requests", type=int, default=None, help="default 64 (32 with --all-at-once)")
    parser.add_argument("--sequential-every", type=int, default=None, help="one-at-a-time on every K-th request")
    parser.add_argument("--skip-library", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--quantize", choices=("none", "int8"), default="none", help="int8: also the int8 engine")
    parser.add_argument("--float32-few-rows", action="store_true", help="also the engine with the few-row kernel")
    parser.add_argument("--no-bfloat16", action="store_true", help="skip the bfloat16 engine")
    parser.add_argument("--exact-rows", action="store_true", help="also the engine with unpadded products, alternated")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.manual_seed(0)
    model, tokenizer, name = load(args.quick, args.device, args.dtype)
    variants = [Variant("int8", load_int8(args.quick, args.device, args.dtype))] if args.quantize == "int8" else []
    if args.float32_few_rows:
        variants.append(Variant("few_rows", load_float32_few_rows(args.quick, args.device, args.dtype)))
    ignoring_eos(model)
    if args.all_at_once:
        count = max_running = args.requests or 32
        jobs, shape = make_workload(model.config.vocab_size, count, (16, 256), (16, 128)), "all at once"
    else:
        count, max_running = args.requests or 64, MAX_RUNNING
        jobs, shape = busy_workload(model.config.vocab_size, count), "busy"
    every = args.sequential_every or (1 if args.quick or args.all_at_once else 4)
    useful = sum(job.max_new_tokens for job in jobs)
    print(f"model: {name} on {model.device} ({model.dtype}); torch threads {torch.get_num_threads()}")
    print(f"workload ({shape}): {len(jobs)} requests, max_running {max_running}, {useful} useful tokens")

    config = engine_config(jobs, max_running)
    probe = EngineProbe()
    engine_s, engine_out = asyncio.run(run_engine(model, tokenizer, jobs, config, probe))
    mean_rows, lone_ms = probe.mean_decode_rows, probe.lone_decode_ms
    _report("engine", engine_s, useful)
    # The bound right after the engine's run, before the other ways: the machine's speed drifts over minutes.
    bound = MatmulBound(model)
    step_bounds = [bound.step_ms(step.tokens, step.rows) / 1e3 for step in probe.steps]
    limit_s = sum(step_bounds)
    for variant in variants:
        variant.run(tokenizer, jobs, config, useful)
    padding = padding_figures(model, tokenizer, jobs, config, useful) if args.exact_rows else {}
    library_s = library_out = None
    if not args.skip_library:
        library_s, library_out = run_library(model, jobs, config)
        _report("library CB", library_s, useful)
    static_s, static_out = run_static(model, tokenizer, jobs, max_running)
    _report(f"static b={max_running}", static_s, useful)
    subset = jobs[::every]
    sequential_s, sequential_out = run_sequential(model, subset)
    sequential_tok_s = sum(job.max_new_tokens for job in subset) / sequential_s
    print(f"{'sequential':<14} {sequential_s:7.2f} s  {sequential_tok_s:8.1f} useful tok/s   ({len(subset)} requests)")

    bf16_figures: dict[str, Any] = dict.fromkeys(BFLOAT16_KEYS)
    if args.no_bfloat16 or torch.device(args.device).type != "cpu" or not native_bfloat16():
        print("bfloat16: not run (--no-bfloat16, not on the CPU, or no native bfloat16 products here)")
    else:
        bf16_model = load_bfloat16(args.quick, args.device)
        bf16_figures = bfloat16_figures(model, bf16_model, tokenizer, jobs, subset, config, engine_s, engine_out)
        del bf16_model
    one_row_ms = probe.one_row_ms
    engine_tok_s = useful / engine_s
    read_per_ms = read_bytes_per_ms()

    def matches(outputs: list[list[int]] | None) -> int | None:
        if outputs is None:
            return None
        return sum(outputs[job.index] == reference for job, reference in zip(subset, sequential_out, strict=True))

    figures = {
        "model": name,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "workload": shape,
        "requests": len(jobs),
        "max_running": max_running,
        "useful_tokens": useful,
        "engine_tok_s": round(engine_tok_s, 2),
        "library_tok_s": None if library_s is None else round(useful / library_s, 2),
        "static_tok_s": round(useful / static_s, 2),
        "sequential_tok_s": round(sequential_tok_s, 2),
        "sequential_requests": len(subset),
        "ratio_static": round(static_s / engine_s, 3),
        "ratio_sequential": round(engine_tok_s / sequential_tok_s, 3),
        "ratio_library": None if library_s is None else round(library_s / engine_s, 3),
        "engine_steps": len(probe.steps),
        "mean_decode_rows": round(mean_rows, 1),
        "matmul_only_s": round(limit_s, 2),
        "limit_tok_s": round(useful / limit_s, 2),
        "limit_fraction": round(limit_s / engine_s, 3),
        **limit_by_kind(probe.steps, step_bounds),
        "lone_decode_ms": round(lone_ms, 2),
        "matmul_one_row_ms": round(one_row_ms, 2),
        "b1_fraction": round(one_row_ms / lone_ms, 3),
        "read_gb_s": round(read_per_ms / 1e6, 1),
        "lone_bound_ms": round(weight_bytes(model) / read_per_ms, 2),
        **bf16_figures,
        "outputs_match": matches(engine_out) == len(subset),
        "engine_matches_sequential": matches(engine_out),
        "library_matches_sequential": matches(library_out),
        "static_matches_sequential": matches(static_out),
        **variant_figures(variants, useful, engine_s, engine_out),
        **padding,
        "peak_rss_mb": round(peak_rss_mb()),
    }
    print(
        f"ratios: static {figures['ratio_static']}x  sequential {figures['ratio_sequential']}x  "
        f"library {figures['ratio_library']}x"
    )
    print(
        f"limit: the engine's {len(probe.steps)} steps (mean {mean_rows:.1f} decode rows) at their matmul time alone "
        f"take {limit_s:.1f} s -> {useful / limit_s:.1f} tok/s; limit_fraction {figures['limit_fraction']}"
    )
    print(
        f"  by kind: decode-only steps {figures['decode_limit_fraction']} ({figures['decode_time_share']:.0%} of the "
        f"step time), steps with a prompt chunk {figures['prefill_limit_fraction']}"
    )
    print(f"lone request: {lone_ms:.1f} ms/token vs one-row matmuls {one_row_ms:.1f} ms: b1 {figures['b1_fraction']}")
    print(f"outputs equal to one-at-a-time greedy: engine {matches(engine_out)}/{len(subset)}")
    for variant in variants:
        print(variant.summary(figures))
    if bf16_figures["bf16_engine_tok_s"] is not None:
        print(
            f"bfloat16: {bf16_figures['bf16_engine_tok_s']} tok/s busy ({bf16_figures['bf16_ratio_float32']}x "
            f"float32's), lone {bf16_figures['bf16_lone_decode_ms']} ms/token (bound "
            f"{bf16_figures['bf16_lone_bound_ms']}); equal to bfloat16 generate {bf16_figures['bf16_matches_generate']}"
            f"/{len(subset)}; against float32: first difference at token {bf16_figures['bf16_first_diff_mean']} on "
            f"average, log-probability difference {bf16_figures['bf16_logprob_diff_mean']} per token; on the "
            f"subset first difference at {bf16_figures['bf16_subset_first_diff_mean']} (bfloat16 generate: "
            f"{bf16_figures['bf16_generate_first_diff_mean']}); bfloat16 generate in one padded batch equal to "
            f"itself one at a time {bf16_figures['bf16_generate_batched_matches']}/{len(subset)}"
        )
    print(f"lone bound: {figures['lone_bound_ms']} ms/token (weights over {figures['read_gb_s']} GB/s read)")
    if padding:
        print(f"padded rows: {padding['padded_speedup']}x the exact rows' tok/s (best of two runs each, alternated)")
    print_json(figures)


if __name__ == "__main__":
    main()
