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
    forbidden: torch.Tensor | None = None  # token ids masked besides the matcher's (control characters in JSON)
    logprobs: deque[TokenLogprob] = field(default_factory=deque)  # one per token, taken by the loop
    _seen: set[int] | None = None  # prompt and output tokens, for the repetition penalty (built on first use)
    _counts: torch.Tensor | None = None  # occurrences of each token in the output (built on first use)

    def penalize(self, row: torch.Tensor) -> None:
        """Applies the request's penalties to its logits row, in place (before temperature, as vLLM and
        transformers do): repetition over prompt and output (transformers' rule: divide positive logits,
        multiply negative ones), presence and frequency over the output (OpenAI's rule: subtract)."""
        params = self.params
        if params.repetition_penalty != 1.0:
            if self._seen is None:
                self._seen = {*self.context, *self.generated}
            seen = torch.tensor(list(self._seen), dtype=torch.long)
            values = row[seen]
            penalty = params.repetition_penalty
            row[seen] = torch.where(values < 0, values * penalty, values / penalty)
        if params.presence_penalty or params.frequency_penalty:
            if self._counts is None:
                generated = torch.tensor(self.generated, dtype=torch.long)
                self._counts = torch.zeros(row.size(0), dtype=row.dtype)
                self._counts.index_add_(0, generated, torch.ones(len(generated), dtype=row.dtype))
            counts = self._counts
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from `probs` with this request's generator for the next position."""
        assert self.params.seed is not None
        generator = torch.Generator(device=probs.device).manual_seed(token_seed(self.params.seed, len(self.generated)))
        return int(torch.multinomial(probs, 1, generator=generator))

    def accept(self, token: int, logprob: TokenLogprob | None) -> None:
        """Records the token drawn for this request: grammar state, output, and its log-probability if asked."""
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.matcher is not None and not self.matcher.is_terminated():
            self.matcher.accept_token(token)
        self.generated.append(token)
        if self._seen is not None:
            self._seen.add(token)
        if self._counts is not None and token < self._counts.size(0):
            self._counts[token] += 1


def token_logprobs(
    scores: torch.Tensor, tokens: torch.Tensor, rows: list[tuple[int, RowState]]
) -> dict[int, TokenLogprob]:
    """Each listed row's drawn token's log-probability under its row of `scores` (as sampled) and its most
    likely alternatives, by row: one log-softmax and one top-k for all of them."""
    asking = [(row, state.params.logprobs) for row, state in rows if state.params.logprobs is not None]
    if not asking:
        return {}
    logprobs = torch.log_softmax(scores[[row for row, _ in asking]], dim=-1)
    most = max(alternatives for _, alternatives in asking)
    values, ids = torch.topk(logprobs, min(most, logprobs.size(-1))) if most else (None, None)
    found = {}
    for index, (row, alternatives) in enumerate(asking):
        top: list[tuple[int, float]] = []
        if values is not None and ids is not None and alternatives:
            pairs = zip(ids[index, :alternatives].tolist(), values[index, :alternatives].tolist(), strict=True)
            top = [(token, value) for token, value in pairs if value > float("-inf")]
        found[row] = TokenLogprob(float(logprobs[index, int(tokens[row])]), top)
    return found


def token_seed(seed: int, position: int) -> int:
    """A generator seed for one output position (splitmix64 of the two): nearby seeds and positions give
    unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # manual_seed takes it as non-negative int64
