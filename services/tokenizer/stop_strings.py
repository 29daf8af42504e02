"""Stop strings matched across token boundaries, without ever leaking part of one.

Text arrives in arbitrary pieces. `StopStringMatcher.feed` searches the text held back so far
plus the new piece; on a match it returns the text before the stop (plus the stop itself when
`include_stop_str_in_output`) and the stop that matched. Otherwise it releases everything except
the longest suffix that is a prefix of some stop string: that suffix might become a stop with
the next piece, so it is held until resolved. The held text is therefore shorter than the
longest stop string, which bounds the state. The stop that completes first in the text wins (as
if the text arrived one character at a time, so the result does not depend on how it was split);
of two that complete at the same character, the longer one.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.errors import InvalidArgumentError


class StopStringMatcher:
    """Per-request stop string state (see the module docstring)."""

    __slots__ = ("_stops", "_include", "_held", "_longest", "_first_characters")

    def __init__(
        self,
        stops: Sequence[str],
        *,
        include_stop_str_in_output: bool = False,
        max_stops: int = 16,
        max_length: int = 256,
    ) -> None:
        if len(stops) > max_stops:
            raise InvalidArgumentError(f"at most {max_stops} stop strings, got {len(stops)}")
        for stop in stops:
            if not stop:
                raise InvalidArgumentError("stop strings must not be empty")
            if len(stop) > max_length:
                raise InvalidArgumentError(
                    f"stop string of {len(stop)} characters is longer than {max_length}"
                )
        self._stops = tuple(dict.fromkeys(stops))
        self._include = include_stop_str_in_output
        self._held = ""
        self._longest = max((len(stop) for stop in self._stops), default=0)
        self._first_characters = frozenset(stop[0] for stop in self._stops)

    @property
    def held(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._held

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to emit, the matched stop string or None)."""
        if not self._stops:
            return text, None
        if not text:
            return "", None
        buffer = self._held + text
        match_end = -1
        matched: str | None = None
        for stop in self._stops:
            position = buffer.find(stop)
            if position < 0:
                continue
            end = position + len(stop)
            if (
                matched is None
                or end < match_end
                or (end == match_end and len(stop) > len(matched))
            ):
                match_end, matched = end, stop
        if matched is not None:
            self._held = ""
            cut = match_end if self._include else match_end - len(matched)
            return buffer[:cut], matched
        hold = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """The held-back text (no stop can complete any more)."""
        held, self._held = self._held, ""
        return held

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop."""
        longest = min(len(buffer), self._longest - 1)
        first_characters = self._first_characters
        for length in range(longest, 0, -1):
            if buffer[-length] not in first_characters:
                continue
            suffix = buffer[-length:]
            for stop in self._stops:
                if stop.startswith(suffix):
                    return length
        return 0
