"""Turning the library's cumulative token lists into text deltas: incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# How many prompt tokens to keep as decoding context, so tokenizers that merge a leading space into the next
# token (sentencepiece) decode the first generated token as they would in the full text (vLLM does the same).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing token list into text pieces whose concatenation is the full decode.

    A multi-byte character (emoji, CJK) split over several byte-level tokens decodes to U+FFFD until its last
    byte arrives; such text is held back until it is whole, or until `finish()` gives up on it.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], unread: int = 0) -> None:
        """`unread`: how many of the last prompt tokens are output not yet turned into text (on a resume, the
        bytes of a character the earlier attempt had not completed)."""
        self._tokenizer = tokenizer
        self._tokens = list(prompt_ids[-(_CONTEXT_TOKENS + unread) :])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens) - unread

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds new tokens and returns the text they complete (possibly empty)."""
        self._tokens.extend(token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Returns whatever text is still held back, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._tokens[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full_text = decode(self._tokens[self._prefix_offset :], skip_special_tokens=True)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text) :]


class StopStringMatcher:
    """Finds the first stop string in streamed text and holds back text that could still start one.

    Text is released only once no stop string can begin in it, so the reader never sees part of a stop
    string; the stop string itself is never emitted (as in vLLM's default).
    """

    def __init__(self, stop: Sequence[str], pending: str = "") -> None:
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._pending = pending  # on a resume: text the earlier attempt had held back

    def feed(self, text: str, *, final: bool) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). After a hit, nothing more is emitted."""
        self._pending += text
        if not self._stop:
            released, self._pending = self._pending, ""
            return released, False
        hits = [index for s in self._stop if (index := self._pending.find(s)) != -1]
        if hits:
            released, self._pending = self._pending[: min(hits)], ""
            return released, True
        cut = len(self._pending) if final else max(0, len(self._pending) - self._holdback)
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return released, False
