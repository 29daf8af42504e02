"""The incremental detokenizer: complete UTF-8 deltas that concatenate to the full decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.tokenizer.detokenize import CUT_BACK_AT, REPLACEMENT_CHARACTER, IncrementalDetokenizer

# Pieces of real text: ASCII, accents, CJK, emoji (4-byte, flags, ZWJ sequences, skin tones).
PIECES = [
    "Hello",
    " world",
    ",",
    " the",
    " café",
    " naïve",
    " 世界",
    "你好",
    "。",
    " 日本語のテキスト",
    " 😀",
    "🇫🇷",
    " 👩‍👩‍👧",
    "👍🏽",
    " —",
    " \n",
    "  ",
    " Ω≈ç√",
    " 🤖🦀",
    "ok",
    "\t1234",
]

texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=30).map("".join)
split_sizes = st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=50)


def _stream(detokenizer: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    deltas = []
    position = 0
    index = 0
    while position < len(ids):
        size = sizes[index % len(sizes)]
        index += 1
        deltas.append(detokenizer.add(ids[position : position + size]))
        position += size
    deltas.append(detokenizer.flush())
    return deltas


def _smollm_decode(smollm):
    return smollm.decode


def _fallback_decode(tokenizer):
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, sizes=split_sizes)
def test_byte_level_real_text_deltas_are_complete(smollm, text: str, sizes: list[int]) -> None:
    ids = smollm.encode_text(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm.decode, smollm.vocab_size)
    deltas = _stream(detokenizer, ids, sizes)
    for delta in deltas:
        assert REPLACEMENT_CHARACTER not in delta
    assert "".join(deltas) == smollm.decode(ids, True) == text


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, sizes=split_sizes)
def test_byte_fallback_real_text_deltas_are_complete(byte_fallback, text, sizes) -> None:
    ids = byte_fallback.encode(text, add_special_tokens=False).ids
    assert any(byte_fallback.id_to_token(i).startswith("<0x") for i in ids) or text.isascii()
    decode = _fallback_decode(byte_fallback)
    detokenizer = IncrementalDetokenizer(decode, byte_fallback.get_vocab_size())
    deltas = _stream(detokenizer, ids, sizes)
    for delta in deltas:
        assert REPLACEMENT_CHARACTER not in delta
    assert "".join(deltas) == decode(ids, True)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=49152 + 100), min_size=0, max_size=40),
    sizes=split_sizes,
    skip=st.booleans(),
)
def test_random_ids_concatenate_to_full_decode(smollm, ids, sizes, skip) -> None:
    """Any ids (specials, invalid byte runs, ids past the vocabulary) still add up exactly."""
    detokenizer = IncrementalDetokenizer(smollm.decode, smollm.vocab_size, skip_special_tokens=skip)
    deltas = _stream(detokenizer, ids, sizes)
    in_vocab = [i for i in ids if i < smollm.vocab_size]
    assert "".join(deltas) == smollm.decode(in_vocab, skip)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prompt=texts, answer=texts, sizes=split_sizes)
def test_prompt_tail_gives_the_first_word_its_space(byte_fallback, prompt, answer, sizes) -> None:
    """SentencePiece decoders drop a leading space unless the prompt's tail is context."""
    decode = _fallback_decode(byte_fallback)
    prompt_ids = byte_fallback.encode(prompt, add_special_tokens=False).ids
    answer_ids = byte_fallback.encode(" " + answer, add_special_tokens=False).ids[1:]
    full = decode(prompt_ids + answer_ids, True)
    prompt_text = decode(prompt_ids, True)
    detokenizer = IncrementalDetokenizer(
        decode, byte_fallback.get_vocab_size(), prompt_tail_ids=prompt_ids[-6:]
    )
    deltas = _stream(detokenizer, answer_ids, sizes)
    if not prompt_text.endswith(REPLACEMENT_CHARACTER):
        assert prompt_text + "".join(deltas) == full
    for delta in deltas[:-1]:
        assert REPLACEMENT_CHARACTER not in delta


def test_leading_space_with_and_without_context(byte_fallback) -> None:
    decode = _fallback_decode(byte_fallback)
    ids = byte_fallback.encode("the world", add_special_tokens=False).ids
    alone = IncrementalDetokenizer(decode, byte_fallback.get_vocab_size())
    assert alone.add(ids[1:]) + alone.flush() == "world"
    with_tail = IncrementalDetokenizer(
        decode, byte_fallback.get_vocab_size(), prompt_tail_ids=ids[:1]
    )
    assert with_tail.add(ids[1:]) + with_tail.flush() == " world"


def test_emoji_split_into_byte_tokens_waits_until_complete(byte_fallback) -> None:
    decode = _fallback_decode(byte_fallback)
    ids = byte_fallback.encode("a😀", add_special_tokens=False).ids
    byte_ids = [i for i in ids if byte_fallback.id_to_token(i).startswith("<0x")]
    assert len(byte_ids) == 4
    detokenizer = IncrementalDetokenizer(decode, byte_fallback.get_vocab_size())
    first = detokenizer.add(ids[: len(ids) - 4])
    assert first == "a"
    assert [detokenizer.add([i]) for i in byte_ids] == ["", "", "", "😀"]


def test_unfinished_character_is_flushed_as_a_full_decode_shows_it(smollm) -> None:
    ids = smollm.encode_text("世", add_special_tokens=False)
    emoji_ids = smollm.encode_text("😀", add_special_tokens=False)
    partial = (ids + emoji_ids)[:-1]
    detokenizer = IncrementalDetokenizer(smollm.decode, smollm.vocab_size)
    streamed = detokenizer.add(partial)
    assert REPLACEMENT_CHARACTER not in streamed
    assert streamed + detokenizer.flush() == smollm.decode(partial, True)


def test_ids_beyond_the_vocabulary_decode_to_nothing(smollm) -> None:
    detokenizer = IncrementalDetokenizer(smollm.decode, smollm.vocab_size)
    assert detokenizer.add([smollm.vocab_size, smollm.vocab_size + 10_000, 2**31]) == ""
    hello = smollm.encode_text("Hello", add_special_tokens=False)
    assert detokenizer.add([*hello, smollm.vocab_size + 1]) + detokenizer.flush() == "Hello"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(smollm, skip: bool) -> None:
    ids = smollm.encode_text("Hi<|im_end|> there", add_special_tokens=False)
    assert smollm.eos_token_ids[0] in ids
    detokenizer = IncrementalDetokenizer(smollm.decode, smollm.vocab_size, skip_special_tokens=skip)
    text = "".join(detokenizer.add([i]) for i in ids) + detokenizer.flush()
    assert text == ("Hi there" if skip else "Hi<|im_end|> there")


def test_window_stays_bounded_on_long_streams(smollm) -> None:
    """Per-step work is O(new tokens): the decoded window never grows with the sequence."""
    ids = smollm.encode_text("The quick brown fox 🦊 jumps over 世界. " * 200, False)
    detokenizer = IncrementalDetokenizer(smollm.decode, smollm.vocab_size)
    largest = 0
    pieces = []
    for token_id in ids:
        pieces.append(detokenizer.add([token_id]))
        largest = max(largest, detokenizer.window_size)
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == smollm.decode(ids, True)
    assert largest <= CUT_BACK_AT + 4


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=400), min_size=0, max_size=60),
    sizes=split_sizes,
    skip=st.booleans(),
)
def test_random_byte_fallback_ids_concatenate_to_full_decode(byte_fallback, ids, sizes, skip):
    """Random runs of byte tokens add up to the full decode whenever it is valid UTF-8.

    (A byte-fallback decoder turns a whole run of byte tokens into U+FFFD once an invalid byte
    joins it, retroactively; characters streamed before that are not taken back.)"""
    decode = _fallback_decode(byte_fallback)
    vocab_size = byte_fallback.get_vocab_size()
    detokenizer = IncrementalDetokenizer(decode, vocab_size, skip_special_tokens=skip)
    deltas = _stream(detokenizer, ids, sizes)
    full = decode([i for i in ids if i < vocab_size], skip)
    if REPLACEMENT_CHARACTER not in full:
        assert "".join(deltas) == full
        assert all(REPLACEMENT_CHARACTER not in delta for delta in deltas)
