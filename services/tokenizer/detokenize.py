"""Incremental, UTF-8-safe detokenization of one generated sequence.

Decoding token by token breaks text: a byte-level BPE token or a byte-fallback token (`<0xE2>`)
may hold part of a character (emoji, CJK), which decodes to U+FFFD until the rest arrives, and
SentencePiece decoders drop the leading space of the first token they see. So, like vLLM's and
TGI's prefix/read offsets, we decode a short window of recent tokens (which starts with a few
tokens of context, the prompt's tail at first) and emit only the part past what was already
emitted, holding back a trailing U+FFFD run until the character completes. The window is cut
back to its last few tokens whenever its text ends cleanly, so each step costs O(new tokens)
rather than O(sequence length), and the state is a handful of ids and one integer.

Invariant: the concatenation of all deltas plus `flush()` equals the decode of all tokens (with
the same skip_special_tokens), except in the pathological case of more than
`MAX_UNRESOLVED_TOKENS` tokens in a row that never form valid UTF-8, which are then emitted as
U+FFFD to keep the window bounded. Ids outside the vocabulary (dummy models have larger
vocabularies) decode to "".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"
# Tokens kept as context when the window is cut back; enough for leading-space rules.
CONTEXT_TOKENS = 4
# The window is cut back once it holds this many tokens and its text ends cleanly.
CUT_BACK_AT = 2 * CONTEXT_TOKENS + 2
# A UTF-8 character is at most 4 bytes; this many tokens without completing one means the bytes
# are invalid for good, and are emitted (as U+FFFD, exactly as a full decode shows them).
MAX_UNRESOLVED_TOKENS = 16

Decode = Callable[[list[int], bool], str]


class IncrementalDetokenizer:
    """Turns a stream of token ids into complete text deltas (see the module docstring)."""

    __slots__ = ("_decode", "_vocab_size", "_skip_special_tokens", "_window", "_emitted", "_held")

    def __init__(
        self,
        decode: Decode,
        vocab_size: int,
        *,
        skip_special_tokens: bool = True,
        prompt_tail_ids: Sequence[int] = (),
    ) -> None:
        self._decode = decode
        self._vocab_size = vocab_size
        self._skip_special_tokens = skip_special_tokens
        window = [int(i) for i in prompt_tail_ids[-CONTEXT_TOKENS:] if 0 <= i < vocab_size]
        text = decode(window, skip_special_tokens) if window else ""
        if text.endswith(REPLACEMENT_CHARACTER):
            # The prompt ends inside a character: no clean boundary to start from.
            window, text = [], ""
        self._window: list[int] = window
        self._emitted = len(text)  # characters of decode(window) already emitted (or context)
        self._held = 0  # tokens appended since the window's text last ended cleanly

    @property
    def window_size(self) -> int:
        """Tokens currently kept (bounded; exposed for tests)."""
        return len(self._window)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append new tokens; return the newly completed text (possibly "")."""
        vocab_size = self._vocab_size
        new = [i for i in token_ids if 0 <= i < vocab_size]
        if not new:
            return ""
        window = self._window
        window.extend(new)
        text = self._decode(window, self._skip_special_tokens)
        end = len(text)
        self._held += len(new)
        if text.endswith(REPLACEMENT_CHARACTER) and self._held <= MAX_UNRESOLVED_TOKENS:
            end = len(text.rstrip(REPLACEMENT_CHARACTER))
        else:
            self._held = 0
        delta = ""
        if end > self._emitted:
            delta = text[self._emitted : end]
            self._emitted = end
        if self._held == 0 and len(window) >= CUT_BACK_AT:
            self._window = window[-CONTEXT_TOKENS:]
            self._emitted = len(self._decode(self._window, self._skip_special_tokens))
        return delta

    def flush(self) -> str:
        """The text still held back (an unfinished character shows as U+FFFD, as in a full
        decode); the detokenizer is empty afterwards."""
        if not self._window:
            return ""
        text = self._decode(self._window, self._skip_special_tokens)
        delta = text[self._emitted :] if len(text) > self._emitted else ""
        self._window = []
        self._emitted = 0
        self._held = 0
        return delta
