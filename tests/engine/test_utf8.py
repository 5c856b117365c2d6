"""The UTF-8 masks over random byte-level vocabularies (partial characters, surrogates, overlong forms, bytes
that never occur in UTF-8), checked against Python's own strict decoder, and through xgrammar on the tiny
byte-level tokenizer."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import torch
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st

from testing.tiny_models import build_tokenizer
from worker.engine.constraints import Grammars, json_schema_format, mask_rows
from worker.engine.outputs import IncrementalDetokenizer
from worker.engine.utf8 import COMPLETE, INVALID, STATES, Utf8Masks, pack_bits

# Every proper prefix of a valid encoded character: characters 64 apart share all but their last byte.
PREFIXES = {
    chr(point).encode()[:length]
    for point in range(0x80, 0x110000, 64)
    if not 0xD800 <= point <= 0xDFFF
    for length in range(1, len(chr(point).encode()))
}
EDGES = [
    0x00,
    0x41,
    0x7F,
    0x80,
    0x8F,
    0x90,
    0x9F,
    0xA0,
    0xBF,
    0xC0,
    0xC1,
    0xC2,
    0xDF,
    0xE0,
    0xE1,
    0xEC,
    0xED,
    0xEE,
    0xEF,
    0xF0,
    0xF1,
    0xF3,
    0xF4,
    0xF5,
    0xF8,
    0xFE,
    0xFF,
]
BYTES = st.one_of(st.sampled_from(EDGES), st.integers(0, 255))
TOKENS = st.lists(BYTES, max_size=6).map(bytes)
VOCABULARIES = st.lists(TOKENS, min_size=1, max_size=48)


def valid_prefix(data: bytes) -> bool:
    """Whether some bytes after `data` make it valid UTF-8: all but a short tail decodes, the tail starts a
    character."""
    for tail in range(4):
        head = data[: len(data) - tail]
        try:
            head.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if tail == 0 or data[len(head) :] in PREFIXES:
            return True
    return False


def allowed(masks: Utf8Masks, state: int) -> list[int]:
    return [token for token in range(masks.vocab) if masks.next_state[state][token] != INVALID]


@settings(max_examples=300, deadline=None)
@given(VOCABULARIES, st.lists(st.integers(0, 10**6), max_size=24))
def test_the_masks_allow_exactly_the_tokens_that_keep_the_output_a_valid_prefix(
    vocabulary: list[bytes], choices: list[int]
) -> None:
    masks = Utf8Masks(vocabulary, stop_ids=[], hidden_ids=[])
    output, state = b"", COMPLETE
    for choice in choices:
        for token, data in enumerate(vocabulary):
            assert (masks.next_state[state][token] != INVALID) == valid_prefix(output + data), (output, data)
        options = allowed(masks, state)
        if not options:
            break
        token = options[choice % len(options)]
        output, state = output + vocabulary[token], masks.next_state[state][token]
        assert valid_prefix(output)
        assert (state == COMPLETE) == _decodes(output)


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(VOCABULARIES, st.lists(st.integers(0, 10**6), max_size=24))
def test_with_single_byte_tokens_a_character_can_always_be_completed(
    vocabulary: list[bytes], choices: list[int]
) -> None:
    vocabulary = [bytes([byte]) for byte in range(256)] + vocabulary
    masks = Utf8Masks(vocabulary, stop_ids=[], hidden_ids=[])
    output, state = b"", COMPLETE
    for choice in choices:
        options = allowed(masks, state)
        token = options[choice % len(options)]
        output, state = output + vocabulary[token], masks.next_state[state][token]
        completion = _shortest_completion(masks, vocabulary, state)
        assert completion is not None and _decodes(output + completion)


def _shortest_completion(masks: Utf8Masks, vocabulary: list[bytes], state: int) -> bytes | None:
    """Bytes of allowed tokens from `state` back to a character boundary (breadth first over the states)."""
    paths, queue = {state: b""}, deque([state])
    while queue:
        current = queue.popleft()
        if current == COMPLETE:
            return paths[current]
        for token in allowed(masks, current):
            following = masks.next_state[current][token]
            if following not in paths:
                paths[following] = paths[current] + vocabulary[token]
                queue.append(following)
    return None


def test_stop_tokens_only_at_a_boundary_hidden_tokens_never_and_empty_tokens_anywhere() -> None:
    vocabulary = [b"<eos>", b"<pad>", b"", b"a", b"\xe2", b"\x82", b"\xac"]
    masks = Utf8Masks(vocabulary, stop_ids=[0], hidden_ids=[0, 1])
    assert allowed(masks, COMPLETE) == [0, 2, 3, 4]
    after_lead = masks.next_state[COMPLETE][4]
    assert allowed(masks, after_lead) == [2, 5, 6]
    assert all(masks.next_state[state][2] == state for state in range(STATES))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 200), st.randoms(use_true_random=False))
def test_packed_masks_are_in_xgrammars_layout(rows: int, vocab: int, random: Any) -> None:
    """Also that padding bits are 1: xgrammar's CPU kernel writes -inf past the logits for a 0 there."""
    wanted = torch.tensor([[random.random() < 0.5 for _ in range(vocab)] for _ in range(rows)])
    logits = torch.zeros(wanted.shape)
    xgrammar.apply_token_bitmask_inplace(logits, pack_bits(wanted))
    assert torch.equal(logits == 0, wanted)


TOKENIZER = build_tokenizer()
GRAMMARS = Grammars(TOKENIZER, len(TOKENIZER) + 6, (TOKENIZER.eos_token_id,))  # a padded model vocabulary
TOKEN_BYTES = xgrammar.TokenizerInfo.from_huggingface(TOKENIZER, vocab_size=len(TOKENIZER) + 6).decoded_vocab


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([1, 3, 6]), st.lists(st.integers(0, 10**6), min_size=40, max_size=40))
def test_any_answer_the_masks_allow_decodes_and_keeps_its_schemas_length(max_length: int, choices: list[int]) -> None:
    """Random walks through the combined mask on the tiny byte-level tokenizer: whatever path is taken, the
    answer's bytes are valid UTF-8 and its string has at most `max_length` characters as the caller counts."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": max_length}},
        "required": ["name"],
        "additionalProperties": False,
    }
    matcher = GRAMMARS.matcher(json_schema_format(schema))
    prefix = b'{"name": "'
    for byte in prefix:
        assert matcher.accept_token(TOKEN_BYTES.index(bytes([byte])))
    output = prefix
    for choice in choices:
        scores = torch.zeros(1, len(TOKEN_BYTES))
        mask_rows(scores, {0: matcher})
        scores[0, GRAMMARS.control_tokens()] = float("-inf")  # as the engine does for JSON formats
        options = (scores[0] > float("-inf")).nonzero().flatten().tolist()
        assert options and TOKENIZER.pad_token_id not in options and TOKENIZER.bos_token_id not in options
        token = options[choice % len(options)]
        assert matcher.accept_token(token)
        if token == TOKENIZER.eos_token_id:
            break
        output += TOKEN_BYTES[token]
    if matcher.is_terminated():
        assert len(json.loads(output.decode("utf-8"))["name"]) <= max_length
    else:
        assert valid_prefix(output)


def test_the_surrogate_the_issue_found_is_refused() -> None:
    matcher = GRAMMARS.matcher(json_schema_format({"type": "string", "maxLength": 3}))
    assert matcher.accept_token(TOKEN_BYTES.index(b'"')) and matcher.accept_token(TOKEN_BYTES.index(b"\xed"))
    assert not matcher.accept_token(TOKEN_BYTES.index(b"\xac"))  # ED AC starts U+DB00-U+DB3F: surrogates
    assert matcher.accept_token(TOKEN_BYTES.index(b"\x9f"))  # ED 9F: below the surrogates
    assert not matcher.accept_token(TOKENIZER.eos_token_id)  # mid-character
    assert matcher.accept_token(TOKEN_BYTES.index(b"\xbf"))  # U+D7FF


def test_without_a_grammar_a_split_character_is_held_back_and_only_an_end_inside_it_shows_u_fffd() -> None:
    emoji = TOKENIZER.encode("😀", add_special_tokens=False)
    assert len(emoji) == 3
    detokenizer = IncrementalDetokenizer(TOKENIZER, [5, 6])
    assert [detokenizer.push([token]) for token in emoji] == ["", "", "😀"]
    cut = IncrementalDetokenizer(TOKENIZER, [5, 6])
    assert [cut.push([token]) for token in emoji[:2]] == ["", ""] and cut.finish() == "\ufffd"
