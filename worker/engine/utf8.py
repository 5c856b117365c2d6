"""Keeping a constrained output valid UTF-8 token by token, for byte-level and byte-fallback tokenizers, whose
tokens can hold part of a character (a lead byte, continuation bytes) or bytes that are never valid.

xgrammar 0.2.9 checks most of UTF-8 but lets a surrogate through (`ED AC 89`): the grammar counted one
character where the caller decodes three U+FFFD, so a schema's `maxLength` broke. Here the bytes so far leave
the decoder in one of 8 states (a character complete, or so many continuation bytes still needed with the
range of the next one); per state, the tokens whose bytes keep the output valid UTF-8 (possibly ending
mid-character) are precomputed once per tokenizer as a bitmask in xgrammar's layout, and each step ANDs the
row's state's mask into the grammar's. Stop tokens are allowed only when a character is complete, and the
tokens the detokenizer drops (special tokens) never, so the text the grammar sees is the text the caller gets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

COMPLETE = 0  # the state at a character boundary
INVALID = 255  # not a state: the bytes are not valid UTF-8 from there
# By state: (continuation bytes still needed, lowest and highest allowed next byte). States 1-3 need that many
# of any continuation byte; 4-7 are the second bytes UTF-8 narrows (RFC 3629, section 4).
_STATES: tuple[tuple[int, int, int], ...] = (
    (0, 0, 0),
    (1, 0x80, 0xBF),
    (2, 0x80, 0xBF),
    (3, 0x80, 0xBF),
    (2, 0xA0, 0xBF),  # after E0: no overlong three-byte form
    (2, 0x80, 0x9F),  # after ED: no UTF-16 surrogate (U+D800-U+DFFF)
    (3, 0x90, 0xBF),  # after F0: no overlong four-byte form
    (3, 0x80, 0x8F),  # after F4: nothing above U+10FFFF
)
STATES = len(_STATES)


_NARROWED = {0xE0: 4, 0xED: 5, 0xF0: 6, 0xF4: 7}  # lead bytes whose second byte has a narrower range


def _after_lead(byte: int) -> int:
    if byte < 0x80:
        return COMPLETE
    if byte in _NARROWED:
        return _NARROWED[byte]
    if 0xC2 <= byte <= 0xDF:
        return 1
    if 0xE1 <= byte <= 0xEF:
        return 2
    if 0xF1 <= byte <= 0xF3:
        return 3
    return INVALID  # a continuation byte, C0, C1 (overlong two-byte forms) or F5-FF


_AFTER_LEAD = bytes(_after_lead(byte) for byte in range(256))


def advance(state: int, data: bytes) -> int:
    """The decoder's state after `data` from `state`, or `INVALID` as soon as a byte cannot follow."""
    for byte in data:
        if state == COMPLETE:
            state = _AFTER_LEAD[byte]
            if state == INVALID:
                return INVALID
        else:
            needed, low, high = _STATES[state]
            if not low <= byte <= high:
                return INVALID
            state = needed - 1  # states 1-2 are "that many of any continuation byte"; 0 is complete
    return state


class Utf8Masks:
    """For one tokenizer: per state, which tokens may come next (`packed`, xgrammar's int32 bitmask layout) and
    the state each leads to (`next_state[state][token]`). Built once per tokenizer: 0.07-0.2 s on a 49k vocabulary."""

    def __init__(self, token_bytes: Sequence[bytes], stop_ids: Iterable[int], hidden_ids: Iterable[int]) -> None:
        """`token_bytes`: each token's bytes as it appears in the text; `stop_ids`: the tokens that end the
        answer; `hidden_ids`: tokens the detokenizer drops (never allowed, unless they are stop tokens)."""
        vocab = len(token_bytes)
        self.vocab = vocab
        self.next_state = [bytearray([INVALID]) * vocab for _ in _STATES]
        stops = set(stop_ids)
        hidden = set(hidden_ids) | stops
        for token, data in enumerate(token_bytes):
            if token in hidden:
                if token in stops:
                    self.next_state[COMPLETE][token] = COMPLETE
            elif not data:  # no text: it changes nothing
                for state in range(STATES):
                    self.next_state[state][token] = state
            elif 0x80 <= data[0] <= 0xBF:  # starts with a continuation byte: only mid-character
                for state in range(1, STATES):
                    self.next_state[state][token] = advance(state, data)
            else:  # starts a character: only at a boundary
                self.next_state[COMPLETE][token] = advance(COMPLETE, data)
        allowed = torch.stack([torch.frombuffer(row, dtype=torch.uint8) != INVALID for row in self.next_state])
        self.packed = pack_bits(allowed)

    def restrict(self, bitmask_row: torch.Tensor, state: int) -> None:
        """ANDs, in place, the tokens allowed in `state` into one row of an xgrammar token bitmask."""
        bitmask_row &= self.packed[state]


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """Boolean rows over a vocabulary as int32 words, token `i` at bit `i % 32` of word `i // 32` (xgrammar's
    layout, 1 = allowed). The padding bits of the last word are 1, as in xgrammar's own masks: its CPU kernel
    (0.2.9) writes -inf for each 0 bit, past the end of the logits too."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.ones(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    values = (padded.view(rows, words, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)
