"""Prompt logprobs: each prompt token's log-probability given the tokens before it, from the prefill's own logits.

The library computes logits only where a token is sampled (a prompt's last position). For a step that prefills a
prompt being scored, `library.install_prompt_scoring` asks the model for the logits of that prompt's positions too
(`rows`), then hands them here (`PromptScores.add`) and gives the library back exactly the rows it asked for. A
prompt prefilled in chunks is scored chunk by chunk; the log-softmax runs in float32 over at most `_ROWS` positions
at a time, so a long prompt never holds a tokens x vocabulary float32 matrix.

Everything here runs in the library's thread; the engine reads a request's scores on its loop once its first
output arrives, which the library sends after the step that ran the prompt's last chunk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

_ROWS = 64  # positions per log-softmax: 64 x a 152k vocabulary is 39 MB of float32


@dataclass
class PromptScores:
    """One prompt being scored: position `p`'s logits score token `p + 1`, so a prompt of `n` tokens has `n - 1`
    scores, each (log-probability, [(alternative id, log-probability)] of the `top` most likely)."""

    prompt_ids: list[int]
    top: int
    scores: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    failed: str | None = None  # why it could not be scored (the request then fails alone)

    @property
    def complete(self) -> bool:
        return self.failed is None and len(self.scores) == len(self.prompt_ids) - 1

    def positions(self, past: int, query: int) -> range:
        """The positions of a chunk [past, past + query) still to score. A chunk that starts past what is scored
        (positions the model did not run, as a prefix-cache hit skips them) cannot be: that prompt fails."""
        if self.failed is None and past > len(self.scores):
            self.failed = f"positions {len(self.scores)} to {past} of the prompt were not run"
        if self.failed is not None:
            return range(0)
        return range(max(past, len(self.scores)), min(past + query, len(self.prompt_ids) - 1))

    def add(self, logits: torch.Tensor, positions: range) -> None:
        """Scores `positions` from their logits ([len(positions), vocab], any dtype)."""
        for start in range(0, len(positions), _ROWS):
            rows = logits[start : start + _ROWS]
            first = positions.start + start
            logprobs = rows.float().log_softmax(-1)
            targets = torch.tensor(self.prompt_ids[first + 1 : first + 1 + len(rows)], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
            if self.top:
                values, ids = logprobs.topk(min(self.top, logprobs.shape[-1]), dim=-1)
                tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
            else:
                tops = [[] for _ in chosen]
            self.scores.extend(zip(chosen, tops, strict=True))


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """A scored prompt's chunk in one step: `first_row` is the batch row (the flattened query index) of
    `positions.start`."""

    scores: PromptScores
    first_row: int
    positions: range


def plan(chunks: Iterable[tuple[str, int, int]], scoring: Mapping[str, PromptScores]) -> list[ChunkRows]:
    """The rows to score in a step whose batch runs `chunks` (library id, past length, query length) in order."""
    planned, row = [], 0
    for library_id, past, query in chunks:
        scores = scoring.get(library_id)
        if scores is not None and scores.failed is None and not scores.complete:  # the library may run on
            positions = scores.positions(past, query)
            if positions:
                planned.append(ChunkRows(scores, row + positions.start - past, positions))
        row += query
    return planned


def rows(planned: list[ChunkRows]) -> list[int]:
    """Every batch row whose logits the plan needs, in plan order."""
    return [chunk.first_row + offset for chunk in planned for offset in range(len(chunk.positions))]


def score(planned: list[ChunkRows], logits: torch.Tensor) -> None:
    """Adds each chunk's scores from `logits`, the rows of `rows(planned)` in that order ([rows, vocab])."""
    start = 0
    for chunk in planned:
        count = len(chunk.positions)
        try:
            chunk.scores.add(logits[start : start + count], chunk.positions)
        except Exception as error:  # never into the library's thread: one prompt fails, not the batch
            chunk.scores.failed = f"{type(error).__name__}: {error}"
        start += count
