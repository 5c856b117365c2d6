"""One pass of logits processing and sampling that costs greedy rows only an argmax.

The library samples every row of a batch once any request samples: per-request temperature, a full-vocabulary
sort for top-k, another for top-p, and a multinomial draw, even for greedy rows (which we run as top_k=1).
On a 49k vocabulary that was a third of a 32-request decode step on CPU. Here greedy rows take an argmax,
top-k uses `topk` instead of a sort, top-p sorts only the rows that ask for it, and only sampled rows draw.

It reads the per-row values that the library's own per-request processors already write into
`logits_processor_args`, so request submission is unchanged. Not for CUDA graphs: it branches on the batch.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopKLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)


class FusedSampler:
    """Stands in for the model runner's logits-processor list and its `_sample` (transformers 5.24)."""

    do_processing = True

    def __init__(self, processors: Any) -> None:
        rows = {}
        for index, processor in enumerate(p for p in processors.logits_processor if hasattr(p, "fill_defaults")):
            rows[type(processor)] = index
        self._temperature_row = rows[ContinuousBatchingTemperatureLogitsWarper]
        self._top_k_row = rows[ContinuousBatchingTopKLogitsWarper]
        self._top_p_row = rows[ContinuousBatchingTopPLogitsWarper]
        self._sampled_rows: torch.Tensor | None = None  # set by __call__, read by sample() in the same forward

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, args: torch.Tensor) -> torch.Tensor:
        count = scores.size(0)
        top_k = args[self._top_k_row, :count]
        sampled = (top_k != 1).nonzero().squeeze(1)
        self._sampled_rows = sampled if sampled.numel() else None
        if self._sampled_rows is None:
            return scores
        temperature = args[self._temperature_row, :count].view(torch.float32)[sampled]
        top_p = args[self._top_p_row, :count].view(torch.float32)[sampled]
        rows = scores[sampled] / temperature.unsqueeze(1)
        rows = _top_k(rows, top_k[sampled].to(torch.int64))
        rows = _top_p(rows, top_p)
        scores[sampled] = rows
        return scores

    def sample(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        logits = scores[0]
        next_tokens = logits.argmax(dim=-1)
        sampled = self._sampled_rows
        if sampled is not None:
            probs = torch.softmax(logits[sampled], dim=-1)
            next_tokens[sampled] = torch.multinomial(probs, num_samples=1).squeeze(1)
        output_ids[0, : next_tokens.size(0)].copy_(next_tokens)


def _top_k(rows: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = rows.size(-1)
    limited = (top_k > 0) & (top_k < vocab)  # the engine sends the vocabulary size for "no top-k"
    if not bool(limited.any()):
        return rows
    top_k = top_k.clamp(1, vocab)
    largest = int(top_k[limited].max())
    thresholds = torch.topk(rows, largest, dim=-1).values.gather(1, (top_k.clamp(max=largest) - 1).unsqueeze(1))
    return rows.masked_fill((rows < thresholds) & limited.unsqueeze(1), float("-inf"))


def _top_p(rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    nucleus = (top_p < 1).nonzero().squeeze(1)
    if not nucleus.numel():
        return rows
    subset = rows[nucleus]
    sorted_logits, sorted_indices = torch.sort(subset, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p[nucleus]).unsqueeze(1)
    remove[..., -1:] = False  # always keep the most likely token
    rows[nucleus] = subset.masked_fill(remove.scatter(1, sorted_indices, remove), float("-inf"))
    return rows


def install(manager: Any) -> bool:
    """Puts the fused sampler into a started-up manager's model runner; False where CUDA graphs forbid it."""
    runner = manager.batch_processor.model_runner
    if getattr(runner, "use_cuda_graph_varlen", False) or getattr(runner, "use_cuda_graph_decode", False):
        return False
    sampler = FusedSampler(manager.logit_processor)
    runner.logit_processor = sampler
    runner._sample = sampler.sample
    return True
