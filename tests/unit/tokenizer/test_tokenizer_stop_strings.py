"""Stop strings across arbitrary text splits: cut at the right place, never leaked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgumentError
from services.tokenizer.stop_strings import StopStringMatcher

alphabet = st.sampled_from(list("abc XY世😀\n"))
small_text = st.text(alphabet=alphabet, min_size=0, max_size=40)
stops_strategy = st.lists(
    st.text(alphabet=alphabet, min_size=1, max_size=5), min_size=1, max_size=3
)
splits = st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=30)


def _expected(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: feed one character at a time; the first stop to complete wins (the longest
    of those completing at the same character)."""
    for end in range(1, len(text) + 1):
        ending_here = [stop for stop in stops if text[:end].endswith(stop)]
        if ending_here:
            stop = max(ending_here, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def _pieces(text: str, sizes: list[int]) -> list[str]:
    pieces, position, index = [], 0, 0
    while position < len(text):
        size = sizes[index % len(sizes)]
        index += 1
        pieces.append(text[position : position + size])
        position += size
    return pieces


@settings(max_examples=200, deadline=None)
@given(text=small_text, stops=stops_strategy, sizes=splits, include=st.booleans())
def test_matches_across_boundaries_and_never_leaks(text, stops, sizes, include) -> None:
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    expected_output, expected_stop = _expected(text, stops, include)
    emitted = ""
    matched = None
    for piece in _pieces(text, sizes):
        out, matched = matcher.feed(piece)
        emitted += out
        # Never leak: what was emitted so far is always a prefix of the final answer.
        assert expected_output.startswith(emitted)
        assert len(matcher.held) < max(len(stop) for stop in stops)
        if matched is not None:
            break
    if matched is None:
        emitted += matcher.flush()
    assert matched == expected_stop
    assert emitted == expected_output


def test_held_back_prefix_resolves_into_a_stop_or_is_released() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("The result</ans") == ("The result", None)
    assert matcher.held == "</ans"
    assert matcher.feed("wer") == ("", None)
    assert matcher.feed(">trailing") == ("", "</answer>")
    released = StopStringMatcher(["</answer>"])
    assert released.feed("x</answer") == ("x", None)
    assert released.feed("!") == ("</answer!", None)
    assert released.held == ""


def test_partial_then_mismatch_then_flush() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", None)
    assert matcher.feed("AR") == ("STAR", None)
    assert matcher.feed("S") == ("", None)
    assert matcher.flush() == "S"


def test_include_stop_and_first_completed_match_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w"], include_stop_str_in_output=True)
    assert matcher.feed("hello world") == ("hello w", "lo w")
    exclusive = StopStringMatcher(["world", "lo w"])
    assert exclusive.feed("hel") == ("he", None)
    assert exclusive.feed("lo world") == ("l", "lo w")
    # "b" completes before "abc" does, whatever the split.
    assert StopStringMatcher(["abc", "b"]).feed("xabc") == ("xa", "b")


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize(
    ("stops", "fragment"),
    [([""], "empty"), (["x"] * 17, "at most 16"), (["y" * 257], "longer than 256")],
)
def test_bad_stop_lists_are_invalid_arguments(stops, fragment) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        StopStringMatcher(stops)
