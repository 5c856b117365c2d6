"""What keeping constrained output valid UTF-8 costs (`worker/engine/utf8.py`): building the masks once per
tokenizer, and the per-step masks of 32 rows with and without them, on the default model's 49k vocabulary.

    python -m bench.utf8_mask

The rows step through a valid answer with multi-byte characters (split over byte-level tokens), as the engine
steps its rows: xgrammar fills each row's mask, the UTF-8 mask is ANDed in (or not), the mask is applied.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import xgrammar
from transformers import AutoTokenizer

from bench.grammars import time_xgrammar_masks
from bench.workload import print_json
from worker.engine.constraints import TextMatcher, hidden_tokens
from worker.engine.loader import DEFAULT_MODEL, resolve_source
from worker.engine.utf8 import Utf8Masks

ROWS = 32
REPEATS = 5
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "city": {"type": "string"}},
    "required": ["name", "city"],
}
ANSWER = '{"name": "Zoë 日本 😀", "city": "Zürich"}'


def step_time(make_matcher: Callable[[], Any], vocab: int, answer: list[int]) -> tuple[float, bool]:
    """Mean seconds per step for 32 rows' masks over `REPEATS` passes through the answer (fresh matchers each),
    and whether every step allowed the answer's next token."""
    bitmask = xgrammar.allocate_token_bitmask(ROWS, vocab)
    total, allowed = 0.0, True
    for _ in range(REPEATS):
        step_s, ok = time_xgrammar_masks([make_matcher() for _ in range(ROWS)], answer, bitmask, vocab)
        total, allowed = total + step_s, allowed and ok
    return total / REPEATS, allowed


def restrict_time(masks: Utf8Masks, vocab: int) -> float:
    """Mean seconds to AND the UTF-8 masks into 32 rows of a bitmask: the whole added per-step work, measured
    alone (the grammar's own masks vary more than this from run to run on a shared machine)."""
    bitmask = xgrammar.allocate_token_bitmask(ROWS, vocab)
    started = time.perf_counter()
    for step in range(1000):
        for row in range(ROWS):
            masks.restrict(bitmask[row], (row + step) % len(masks.next_state))
    return (time.perf_counter() - started) / 1000


def main() -> None:
    gguf = resolve_source(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    vocab = len(tokenizer)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(SCHEMA))
    started = time.perf_counter()
    masks = Utf8Masks(info.decoded_vocab, info.stop_token_ids, hidden_tokens(tokenizer))
    build_s = time.perf_counter() - started
    answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    plain_s, plain_ok = step_time(lambda: xgrammar.GrammarMatcher(compiled), vocab, answer)
    utf8_s, utf8_ok = step_time(lambda: TextMatcher(xgrammar.GrammarMatcher(compiled), masks), vocab, answer)
    restrict_s = restrict_time(masks, vocab)
    figures = {
        "model": "SmolLM2-135M-Instruct",
        "vocab": vocab,
        "steps": len(answer),
        "utf8_masks_build_s": round(build_s, 3),
        "mask_32_rows_ms_grammar_only": round(plain_s * 1000, 3),
        "mask_32_rows_ms_with_utf8": round(utf8_s * 1000, 3),
        "utf8_restrict_32_rows_us": round(restrict_s * 1e6, 1),
        "valid_answer_allowed": plain_ok and utf8_ok,
    }
    print(f"UTF-8 masks built in {build_s:.3f} s over {vocab} tokens")
    print(f"32 rows' masks per step: {plain_s * 1000:.3f} ms grammar only, {utf8_s * 1000:.3f} ms with UTF-8")
    print(f"ANDing the UTF-8 masks into 32 rows alone: {restrict_s * 1e6:.1f} us")
    print_json(figures)


if __name__ == "__main__":
    main()
