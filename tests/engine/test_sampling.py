"""The fused sampler: greedy rows are an argmax, sampled rows honour temperature, top-k and top-p."""

from __future__ import annotations

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.engine.library import argument_rows
from worker.engine.sampling import FusedSampler

VOCAB = 50


def sampler() -> FusedSampler:
    processors = ContinuousBatchingLogitsProcessorList(
        LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(50), TopPLogitsWarper(0.9)]),
        per_request_processors=True,
    )
    return FusedSampler(argument_rows(processors), None, {})


def args_for(rows: list[tuple[float, int, float]]) -> torch.Tensor:
    """The library's argument layout: one int32 row per processor, floats stored as their bits."""
    temperature = torch.tensor([r[0] for r in rows], dtype=torch.float32).view(torch.int32)
    top_k = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    top_p = torch.tensor([r[2] for r in rows], dtype=torch.float32).view(torch.int32)
    return torch.stack([temperature, top_k, top_p])


def draw(rows: list[tuple[float, int, float]], logits: torch.Tensor, times: int = 200) -> list[set[int]]:
    seen: list[set[int]] = [set() for _ in rows]
    fused = sampler()
    for _ in range(times):
        scores = fused(None, logits.clone(), args_for(rows))  # type: ignore[arg-type]
        output = torch.zeros(2, len(rows), dtype=torch.int64)
        fused.sample(scores.unsqueeze(0), output)
        for row, token in enumerate(output[0].tolist()):
            seen[row].add(token)
    return seen


def test_greedy_rows_take_the_argmax_beside_sampled_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    seen = draw([(1.0, 1, 1.0), (1.0, VOCAB, 1.0), (1.0, 1, 1.0)], logits)
    assert seen[0] == {int(logits[0].argmax())} and seen[2] == {int(logits[2].argmax())}
    assert len(seen[1]) > 5  # a flat-ish distribution, sampled


def test_top_k_limits_the_candidates() -> None:
    torch.manual_seed(1)
    logits = torch.zeros(1, VOCAB)
    logits[0, [7, 11, 13]] = torch.tensor([5.0, 4.9, 4.8])
    assert draw([(1.0, 2, 1.0)], logits)[0] <= {7, 11}


def test_top_p_keeps_the_nucleus() -> None:
    torch.manual_seed(2)
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 3], logits[0, 4] = 10.0, 9.0  # about 73 % and 27 % of the mass
    assert draw([(1.0, VOCAB, 0.5)], logits)[0] == {3}
    assert draw([(1.0, VOCAB, 0.99)], logits)[0] == {3, 4}


def test_low_temperature_sharpens() -> None:
    torch.manual_seed(3)
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 1.0
    assert draw([(0.01, VOCAB, 1.0)], logits)[0] == {9}
    assert len(draw([(5.0, VOCAB, 1.0)], logits)[0]) > 10
