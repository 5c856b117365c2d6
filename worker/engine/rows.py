"""Per-request treatment of a batch row, for the requests that ask for it (`GenerationParams.per_row`): penalties,
a response format's token mask, a seeded draw, and log-probabilities. Other rows never pay for it.

A `RowState` is made on the event loop when the request is submitted and then read and advanced only by the
library's thread, in the sampler, once per token; log-probabilities go back to the loop through a deque.

Seeded draws use a generator seeded from (seed, index of the token in the whole output): the same seed gives
the same tokens whatever else is in the batch, on any worker, and after a resume, which continues the index.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.engine.types import GenerationParams, TokenLogprob

_MASK64 = (1 << 64) - 1


@dataclass(eq=False)
class RowState:
    params: GenerationParams
    context: list[int]  # the prompt (and, on a resume, what was delivered): the repetition penalty sees it
    generated: list[int] = field(default_factory=list)  # the whole output so far, delivered tokens included
    matcher: Any = None  # the response format's grammar matcher
    logprobs: deque[TokenLogprob] = field(default_factory=deque)  # one per token, taken by the loop

    def penalize(self, row: torch.Tensor) -> None:
        """Applies the request's penalties to its logits row, in place (before temperature, as vLLM and
        transformers do): repetition over prompt and output (transformers' rule: divide positive logits,
        multiply negative ones), presence and frequency over the output (OpenAI's rule: subtract)."""
        params = self.params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(self.context) | set(self.generated)), dtype=torch.long)
            values = row[seen]
            penalty = params.repetition_penalty
            row[seen] = torch.where(values < 0, values * penalty, values / penalty)
        if (params.presence_penalty or params.frequency_penalty) and self.generated:
            counts = torch.bincount(torch.tensor(self.generated), minlength=row.size(0))[: row.size(0)].to(row.dtype)
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from `probs` with this request's generator for the next position."""
        assert self.params.seed is not None
        generator = torch.Generator(device=probs.device).manual_seed(token_seed(self.params.seed, len(self.generated)))
        return int(torch.multinomial(probs, 1, generator=generator))

    def accept(self, token: int, scores: torch.Tensor) -> None:
        """Records the token drawn from `scores` (the row as sampled): grammar state, output, log-probabilities."""
        if self.params.logprobs is not None:
            self.logprobs.append(token_logprob(scores, token, self.params.logprobs))
        if self.matcher is not None and not self.matcher.is_terminated():
            self.matcher.accept_token(token)
        self.generated.append(token)


def token_logprob(scores: torch.Tensor, token: int, alternatives: int) -> TokenLogprob:
    """The token's log-probability under `scores` (one row, as sampled), and the `alternatives` most likely."""
    logprobs = torch.log_softmax(scores, dim=-1)
    top: list[tuple[int, float]] = []
    if alternatives:
        values, ids = torch.topk(logprobs, min(alternatives, logprobs.size(0)))
        top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True) if v > float("-inf")]
    return TokenLogprob(float(logprobs[token]), top)


def token_seed(seed: int, position: int) -> int:
    """A generator seed for one output position (splitmix64 of the two): nearby seeds and positions give
    unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # manual_seed takes it as non-negative int64
