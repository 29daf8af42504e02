"""Incremental, UTF-8-safe detokenization of one generated sequence.

Decoding token by token breaks text: a byte-level BPE token or a byte-fallback token (`<0xE2>`)
may hold part of a character (emoji, CJK), which decodes to U+FFFD until the rest arrives, and
SentencePiece decoders drop the leading space of the first token they see. So, like vLLM's and
TGI's prefix/read offsets, we decode a short window of recent tokens (which starts with a few
tokens of context, the prompt's tail at first) and emit only the part past what was already
emitted, holding back a trailing U+FFFD run until the character completes. The window is cut
back to its last few tokens whenever its text ends cleanly, so each step costs O(new tokens)
rather than O(sequence length), and the state is a handful of ids and two integers. The cut
lands only where the shorter window still decodes the same: on a character boundary (its text
does not start with U+FFFD; a byte-fallback run is decoded as a whole, so this matters) and with
the same trailing U+FFFD run.

Invariant: the concatenation of all deltas plus `flush()` equals the decode of all tokens (with
the same skip_special_tokens). Bytes that never form valid UTF-8 are emitted as the U+FFFD a full
decode shows once the next character arrives, or at `flush()`; after `MAX_UNRESOLVED_TOKENS`
tokens without new text they are emitted anyway, all but the last U+FFFD (exact for byte-level
BPE, whose unfinished character is one U+FFFD; a bound on state for byte-fallback runs).
One exception: a byte-fallback decoder turns a whole run of `<0x..>` tokens into U+FFFD once an
invalid byte joins it, retroactively; characters of that run streamed earlier stay streamed.
Ids outside the vocabulary (dummy models have larger vocabularies) decode to "".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"
# Tokens kept as context when the window is cut back; enough for leading-space rules.
CONTEXT_TOKENS = 4
# Prompt tokens searched for a clean starting context (a byte-fallback run may need several).
PROMPT_TAIL_TOKENS = 8
# The window is cut back once it holds this many tokens and its text ends cleanly.
CUT_BACK_AT = 2 * CONTEXT_TOKENS + 2
# Bound on tokens held while the text keeps ending in U+FFFD. Valid text resolves within a few
# tokens (a byte-fallback run of CJK sent in misaligned chunks can take longer, so this is
# generous); past it the bytes are treated as invalid for good and emitted as U+FFFD.
MAX_UNRESOLVED_TOKENS = 512

Decode = Callable[[list[int], bool], str]


class IncrementalDetokenizer:
    """Turns a stream of token ids into complete text deltas (see the module docstring)."""

    __slots__ = (
        "_decode",
        "_vocab_size",
        "_skip_special_tokens",
        "_window",
        "_emitted",
        "_stalled",
    )

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
        tail = [int(i) for i in prompt_tail_ids[-PROMPT_TAIL_TOKENS:] if 0 <= i < vocab_size]
        window: list[int] = []
        text = ""
        # Context must start on a character boundary and end cleanly; drop what does not.
        for start in range(len(tail)):
            candidate = tail[start:]
            candidate_text = decode(candidate, skip_special_tokens)
            if candidate_text.startswith(REPLACEMENT_CHARACTER):
                continue
            if not candidate_text.endswith(REPLACEMENT_CHARACTER):
                window, text = candidate, candidate_text
            break
        self._window: list[int] = window
        self._emitted = len(text)  # characters of decode(window) already emitted (or context)
        self._stalled = 0  # tokens appended since the emitted text last grew

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
        emitted = self._emitted
        if text.endswith(REPLACEMENT_CHARACTER):
            end = len(text.rstrip(REPLACEMENT_CHARACTER))
            if end > emitted:
                self._stalled = 0
            else:
                self._stalled += len(new)
                if self._stalled > MAX_UNRESOLVED_TOKENS:
                    # Invalid for good; only the last U+FFFD may still become a character.
                    end = len(text) - 1
        else:
            self._stalled = 0
        delta = ""
        if end > emitted:
            delta = text[emitted:end]
            self._emitted = emitted = end
        pending = len(text) - emitted
        if len(window) >= CUT_BACK_AT and (pending == 0 or self._stalled > MAX_UNRESOLVED_TOKENS):
            self._cut_back(text, pending)
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
        self._stalled = 0
        return delta

    def _cut_back(self, text: str, pending: int) -> None:
        """Keep only the last few tokens, starting on a character boundary, such that the
        not-yet-emitted tail (`pending` U+FFFD characters) decodes the same way."""
        trailing_run = len(text) - len(text.rstrip(REPLACEMENT_CHARACTER))
        window = self._window
        for keep in range(CONTEXT_TOKENS, min(len(window), CONTEXT_TOKENS + 4)):
            candidate = window[-keep:]
            candidate_text = self._decode(candidate, self._skip_special_tokens)
            if candidate_text.startswith(REPLACEMENT_CHARACTER):
                continue
            candidate_run = len(candidate_text) - len(candidate_text.rstrip(REPLACEMENT_CHARACTER))
            if candidate_run != trailing_run or len(candidate_text) < pending:
                continue
            self._window = candidate
            self._emitted = len(candidate_text) - pending
            return
