"""Incremental detokenization and stop strings, on the tiny byte-level tokenizer (multi-byte characters split
over several tokens)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testing.tiny_models import build_tokenizer
from worker.engine.outputs import IncrementalDetokenizer, StopStringMatcher

TOKENIZER = build_tokenizer()


def stream_text(ids: list[int], chunk: int = 1, prompt: list[int] | None = None) -> str:
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt or [5, 6])
    pieces = [detokenizer.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return "".join(pieces) + detokenizer.finish()


@pytest.mark.parametrize("text", ["emoji 😀🚀🎉 done", "日本語の文章 中文字符", "mixed 한국어 😀 and ascii", "🎉"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_the_full_decode(text: str, chunk: int) -> None:
    ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    assert len(TOKENIZER.encode("😀", add_special_tokens=False)) > 1 or chunk > 0
    assert stream_text(ids, chunk) == TOKENIZER.decode(ids) == text


def test_no_piece_ends_in_a_broken_character() -> None:
    ids = TOKENIZER("😀🚀🎉日本語", add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    pieces = [detokenizer.push([token]) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.finish() == "😀🚀🎉日本語"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TOKENIZER) - 1), max_size=40), st.integers(1, 4))
def test_random_token_sequences_match_the_full_decode(ids: list[int], chunk: int) -> None:
    assert stream_text(ids, chunk) == TOKENIZER.decode(ids, skip_special_tokens=True)


def test_stop_string_split_across_pieces_is_never_emitted() -> None:
    matcher = StopStringMatcher(["STOP"])
    emitted = []
    for piece in ["hello S", "T", "O", "P world"]:
        text, hit = matcher.feed(piece, final=False)
        emitted.append(text)
        if hit:
            break
    assert "".join(emitted) == "hello "
    assert hit


def test_false_stop_prefix_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    first, _ = matcher.feed("a STO", final=False)
    second, hit = matcher.feed("RM", final=True)
    assert first + second == "a STORM" and not hit


def test_earliest_stop_string_wins() -> None:
    text, hit = StopStringMatcher(["world", "lo"]).feed("hello world", final=False)
    assert (text, hit) == ("hel", True)


def test_random_split_points_give_the_same_text() -> None:
    rng = random.Random(3)
    source = "abc<end>def"
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(source)), 3))
        parts = [source[i:j] for i, j in zip([0, *cuts], [*cuts, len(source)], strict=True)]
        matcher = StopStringMatcher(["<end>"])
        out = ""
        for part in parts:
            text, hit = matcher.feed(part, final=False)
            out += text
            if hit:
                break
        assert out == "abc" and hit


def test_resumed_detokenizer_completes_a_character_split_by_a_crash() -> None:
    ids = TOKENIZER("ab😀cd", add_special_tokens=False)["input_ids"]
    cut = next(i for i in range(1, len(ids)) if TOKENIZER.decode(ids[:i]).endswith("\ufffd"))
    before = TOKENIZER.decode(ids[: cut - 1])  # what the first attempt could deliver as text
    resumed = IncrementalDetokenizer(TOKENIZER, [5, 6, *ids[:cut]], unread=1)
    after = resumed.push(ids[cut:]) + resumed.finish()
    assert before + after == "ab😀cd"
