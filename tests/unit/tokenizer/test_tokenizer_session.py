"""One DetokenizeSession multiplexing many requests: deltas, stops, errors, limits, freeing."""

from __future__ import annotations

import random

from services.tokenizer.detokenize import REPLACEMENT_CHARACTER
from services.tokenizer.session import (
    DecodeOptions,
    DetokenizeSession,
    SessionLimits,
    Update,
)


def _session(smollm, **limits) -> DetokenizeSession:
    return DetokenizeSession(smollm.decode, smollm.vocab_size, SessionLimits(**limits))


def test_many_requests_in_one_message_each_get_their_text(smollm) -> None:
    texts = {
        f"r{i}": text
        for i, text in enumerate(
            ["Hello there, friend.", " 世界你好 😀!", "Ω≈ç and 🇫🇷 flags", " plain ascii text"] * 16
        )
    }
    ids = {rid: smollm.encode_text(text, False) for rid, text in texts.items()}
    session = _session(smollm)
    received = {rid: "" for rid in texts}
    closed = set()
    rng = random.Random(0)
    positions = dict.fromkeys(texts, 0)
    first = True
    while len(closed) < len(texts):
        updates = []
        for rid, token_ids in ids.items():
            if rid in closed:
                continue
            step = rng.randint(1, 8)  # the router sends up to a response's worth at once
            chunk = token_ids[positions[rid] : positions[rid] + step]
            positions[rid] += step
            finished = positions[rid] >= len(token_ids)
            options = DecodeOptions() if first else None
            updates.append(Update(rid, chunk, options, finished=finished))
        first = False
        for delta in session.handle(updates):
            assert not delta.error_code
            assert REPLACEMENT_CHARACTER not in delta.text
            received[delta.request_id] += delta.text
            if delta.closed:
                closed.add(delta.request_id)
    assert received == {rid: smollm.decode(ids[rid], True) for rid in texts}
    assert session.live_requests == 0


def test_stop_string_is_cut_reported_and_state_freed(smollm) -> None:
    ids = smollm.encode_text("The answer is 42. END of story", False)
    session = _session(smollm)
    options = DecodeOptions(stop=(" END",))
    out, hit = "", None
    for index, token_id in enumerate(ids):
        deltas = session.handle([Update("a", [token_id], options if index == 0 else None)])
        for delta in deltas:
            out += delta.text
            assert "END" not in out
            if delta.stop_hit:
                hit = delta
    assert hit is not None and hit.closed and hit.matched_stop == " END"
    assert out == "The answer is 42."
    assert session.live_requests == 0
    # Tokens the engine produced before the abort landed are dropped quietly.
    assert session.handle([Update("a", ids[:2])]) == []


def test_include_stop_str_in_output(smollm) -> None:
    ids = smollm.encode_text("one two three four", False)
    session = _session(smollm)
    options = DecodeOptions(stop=("three",), include_stop_str_in_output=True)
    deltas = session.handle([Update("a", ids, options)])
    assert [(d.text, d.stop_hit, d.closed) for d in deltas] == [("one two three", True, True)]


def test_finish_flushes_held_back_text(smollm) -> None:
    session = _session(smollm)
    ids = smollm.encode_text("wait for the STO", False)
    deltas = session.handle([Update("a", ids, DecodeOptions(stop=("STOP",)))])
    assert "".join(d.text for d in deltas) == "wait for the "
    deltas = session.handle([Update("a", [], finished=True)])
    assert [(d.text, d.closed, d.stop_hit) for d in deltas] == [("STO", True, False)]


def test_unknown_request_fails_only_its_own_item(smollm) -> None:
    session = _session(smollm)
    hello = smollm.encode_text("Hello", False)
    deltas = session.handle(
        [Update("ghost", hello), Update("real", hello, DecodeOptions(), finished=True)]
    )
    by_id = {d.request_id: d for d in deltas}
    assert by_id["ghost"].error_code == "NOT_FOUND"
    assert by_id["real"].text == "Hello" and by_id["real"].closed


def test_cancel_frees_state_without_text(smollm) -> None:
    session = _session(smollm)
    ids = smollm.encode_text("some text STO", False)
    session.handle([Update("a", ids, DecodeOptions(stop=("STOP",)))])
    assert session.live_requests == 1
    deltas = session.handle([Update("a", [], cancel=True)])
    assert [(d.text, d.closed) for d in deltas] == [("", True)]
    assert session.live_requests == 0


def test_cap_on_concurrent_requests_is_per_item(smollm) -> None:
    session = _session(smollm, max_requests=2)
    updates = [Update(f"r{i}", [42], DecodeOptions()) for i in range(3)]
    deltas = session.handle(updates)
    errors = [d for d in deltas if d.error_code]
    assert [(d.request_id, d.error_code) for d in errors] == [("r2", "RESOURCE_EXHAUSTED")]
    assert session.live_requests == 2
    session.handle([Update("r0", [], finished=True)])
    assert not any(d.error_code for d in session.handle([Update("r3", [], DecodeOptions())]))


def test_bad_options_and_duplicates_are_item_errors(smollm) -> None:
    session = _session(smollm)
    deltas = session.handle(
        [
            Update("a", [1], DecodeOptions(stop=("",))),
            Update("b", [42], DecodeOptions()),
            Update("b", [42], DecodeOptions()),
            Update("", [42], DecodeOptions()),
        ]
    )
    codes = [(d.request_id, d.error_code) for d in deltas if d.error_code]
    assert codes == [("a", "INVALID_ARGUMENT"), ("b", "ALREADY_EXISTS"), ("", "INVALID_ARGUMENT")]
    assert session.live_requests == 1  # "b" keeps decoding


def test_out_of_vocabulary_ids_do_not_crash(smollm) -> None:
    session = _session(smollm)
    hello = smollm.encode_text("Hello", False)
    deltas = session.handle(
        [Update("a", [smollm.vocab_size + 5, *hello, 10**9], DecodeOptions(), finished=True)]
    )
    assert [(d.text, d.closed, d.error_code) for d in deltas] == [("Hello", True, "")]


def test_prompt_tail_and_special_tokens_options(smollm) -> None:
    session = _session(smollm)
    prompt = smollm.encode_text("<|im_start|>assistant\n", False)
    answer = smollm.encode_text("Paris<|im_end|>", False)
    deltas = session.handle(
        [
            Update("skip", answer, DecodeOptions(prompt_tail_ids=tuple(prompt)), finished=True),
            Update("keep", answer, DecodeOptions(skip_special_tokens=False), finished=True),
        ]
    )
    assert {d.request_id: d.text for d in deltas} == {"skip": "Paris", "keep": "Paris<|im_end|>"}


def test_close_frees_everything(smollm) -> None:
    session = _session(smollm)
    session.handle([Update(f"r{i}", [42], DecodeOptions()) for i in range(10)])
    assert session.live_requests == 10
    session.close()
    assert session.live_requests == 0
