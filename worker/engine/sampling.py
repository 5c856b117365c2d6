"""One pass of logits processing and sampling that costs greedy rows only an argmax.

The library samples every row of a batch once any request samples: per-request temperature, a full-vocabulary
sort for top-k, another for top-p, and a multinomial draw, even for greedy rows (which we run as top_k=1).
On a 49k vocabulary that was a third of a 32-request decode step on CPU. Here greedy rows take an argmax,
top-k uses `topk` instead of a sort, top-p sorts only the rows that ask for it, and only sampled rows draw.

It reads the per-row values that the library's own per-request processors already write into
`logits_processor_args`, so request submission is unchanged. Rows of requests that need their own treatment
(penalties, a response format, a seed, log-probabilities: `worker.engine.rows`) are found through the batch's
requests, in the order the library lays out its logits rows. Not for CUDA graphs: it branches on the batch.
`library.py` installs it and tells it where those values and requests are (`ArgumentRows`, `batch_ids`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from worker.engine.constraints import mask_rows
from worker.engine.rows import RowState, token_logprobs


@dataclass(frozen=True, slots=True)
class ArgumentRows:
    """Which row of the library's per-request argument tensor holds each value (one int32 row per processor)."""

    temperature: int
    top_k: int
    top_p: int


class FusedSampler:
    """Stands in for the model runner's logits-processor list and its `_sample` (`library.py` puts it there).
    `batch_ids()` gives the library ids of the requests that get a logits row this step, in row order; `row_states`
    (library request id -> `RowState`) is the engine's, read here from the library's thread."""

    do_processing = True

    def __init__(
        self, rows: ArgumentRows, batch_ids: Callable[[], list[str]] | None, row_states: Mapping[str, RowState]
    ) -> None:
        self._temperature_row = rows.temperature
        self._top_k_row = rows.top_k
        self._top_p_row = rows.top_p
        self._sampled_rows: torch.Tensor | None = None  # set by __call__, read by sample() in the same forward
        self._batch_ids = batch_ids  # which requests the rows are
        self._row_states = row_states
        self._special: list[tuple[int, RowState]] = []  # set by __call__, read by sample()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, args: torch.Tensor) -> torch.Tensor:
        count = scores.size(0)
        self._special = self._special_rows(count)
        if self._special:
            _treat_rows(scores, self._special)
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
            draws = torch.multinomial(probs, num_samples=1).squeeze(1)
            seeded = {row: state for row, state in self._special if state.params.seed is not None}
            for position, row in enumerate(sampled.tolist()):
                if row in seeded:
                    draws[position] = seeded[row].draw(probs[position])
            next_tokens[sampled] = draws
        logprobs = token_logprobs(logits, next_tokens, self._special)
        for row, state in self._special:
            state.accept(int(next_tokens[row]), logprobs.get(row))
        output_ids[0, : next_tokens.size(0)].copy_(next_tokens)

    def _special_rows(self, count: int) -> list[tuple[int, RowState]]:
        """(row, state) of the rows whose requests need their own treatment. The library lays out one logits row
        per request that gets a token this step, in batch order."""
        if not self._row_states or self._batch_ids is None:
            return []
        ids = self._batch_ids()
        states = ((row, self._row_states.get(request_id)) for row, request_id in enumerate(ids[:count]))
        return [(row, state) for row, state in states if state is not None]


def _treat_rows(scores: torch.Tensor, special: list[tuple[int, RowState]]) -> None:
    """Penalties, then the response formats' masks, on the rows that need them (before temperature)."""
    for row, state in special:
        state.penalize(scores[row])
    constrained = {row: state.matcher for row, state in special if state.matcher is not None}
    if constrained:
        mask_rows(scores, constrained)
    for row, state in special:
        if state.forbidden is not None:
            scores[row, state.forbidden] = float("-inf")


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
