"""Which grammar engine constrains our outputs: xgrammar against llguidance on the default model's tokenizer,
measured the way the engine uses them (`worker/engine/constraints.py`).

    python -m bench.grammars

Per engine: tokenizer setup, compiling a nested JSON schema, and the per-step cost of the token masks of 32
rows, over the steps of a real constrained answer (each row advanced by the tokens of a valid output), plus
correctness (every masked step allows the next token of the valid output). Needs both packages installed
(`pip install xgrammar llguidance`); the worker depends on xgrammar only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.workload import print_json
from worker.engine.loader import DEFAULT_MODEL, load_model

ROWS = 32
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "age", "tags", "address"],
}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "address": {"city": "London"}}'


def time_masks(
    matchers: list[Any],
    answer: list[int],
    bitmask: torch.Tensor,
    vocab: int,
    fill: Callable[[Any, torch.Tensor, int], object],
    apply: Callable[[torch.Tensor, torch.Tensor], object],
    accept: Callable[[Any, int], object],
) -> tuple[float, bool]:
    """Seconds per step to mask one row per matcher and apply the masks, the rows stepping through `answer` as the
    engine steps its rows, and whether every step allowed (and every matcher accepted) the answer's next token."""
    logits, allowed, masking = torch.zeros(len(matchers), vocab), True, 0.0
    for token in answer:
        started = time.perf_counter()
        for row, matcher in enumerate(matchers):
            fill(matcher, bitmask, row)
        apply(logits, bitmask)
        masking += time.perf_counter() - started
        allowed = allowed and bool((logits[:, token] > float("-inf")).all())
        logits.zero_()
        for matcher in matchers:
            allowed = bool(accept(matcher, token)) and allowed
    return masking / len(answer), allowed


def time_xgrammar_masks(
    matchers: list[Any], answer: list[int], bitmask: torch.Tensor, vocab: int
) -> tuple[float, bool]:
    """`time_masks` for xgrammar's matchers (and `TextMatcher`, which has their interface)."""
    import xgrammar

    return time_masks(
        matchers,
        answer,
        bitmask,
        vocab,
        fill=lambda matcher, mask, row: matcher.fill_next_token_bitmask(mask, row),
        apply=xgrammar.apply_token_bitmask_inplace,
        accept=lambda matcher, token: matcher.accept_token(token),
    )


def measure_xgrammar(tokenizer: Any, vocab: int, answer: list[int]) -> dict[str, float]:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    setup = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    compiled_at = time.perf_counter()
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(ROWS)]
    bitmask = xgrammar.allocate_token_bitmask(ROWS, vocab)
    mask_s, allowed = time_xgrammar_masks(matchers, answer, bitmask, vocab)
    return _figures(setup - started, compiled_at - setup, mask_s, allowed)


def measure_llguidance(tokenizer: Any, vocab: int, answer: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    table = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(table, grammar) for _ in range(ROWS)]
    compiled_at = time.perf_counter()
    bitmask = llguidance.torch.allocate_token_bitmask(ROWS, table.vocab_size)
    mask_s, allowed = time_masks(
        matchers,
        answer,
        bitmask,
        vocab,
        fill=llguidance.torch.fill_next_token_bitmask,
        apply=llguidance.torch.apply_token_bitmask_inplace,
        accept=lambda matcher, token: matcher.consume_token(token),
    )
    return _figures(setup - started, compiled_at - setup, mask_s, allowed)


def _figures(setup_s: float, compile_s: float, mask_s: float, allowed: bool) -> dict[str, Any]:
    return {
        "setup_s": round(setup_s, 3),
        "compile_ms": round(compile_s * 1000, 1),
        "mask_32_rows_ms": round(mask_s * 1000, 2),
        "valid_output_allowed": allowed,
    }


def main() -> None:
    model, tokenizer = load_model(DEFAULT_MODEL)
    vocab = int(model.get_input_embeddings().num_embeddings)
    answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    figures: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "vocab": vocab, "steps": len(answer)}
    for name, measure in (("xgrammar", measure_xgrammar), ("llguidance", measure_llguidance)):
        result = measure(tokenizer, vocab, answer)
        print(f"{name:10s} " + ", ".join(f"{key} {value}" for key, value in result.items()))
        figures |= {f"{name}_{key}": value for key, value in result.items()}
    print_json(figures)


if __name__ == "__main__":
    main()
