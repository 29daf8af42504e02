"""OutputStreamer: detokenize messages per engine step, pieces back per request, first tokens
first."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from protos.sluice.v1 import engine_pb2, tokenizer_pb2
from services.engine.sampling_params import SamplingParams
from services.router.request import OutputPiece, RouterRequest
from services.router.streaming import OutputStreamer


class _Tokenizer:
    def __init__(self) -> None:
        self.sent: list[tokenizer_pb2.DetokenizeRequest] = []
        self._number = 0

    def next_sequence_number(self) -> int:
        self._number += 1
        return self._number

    def send(self, request: tokenizer_pb2.DetokenizeRequest) -> None:
        self.sent.append(request)


class _Releaser:
    def engine_finished(self, request: RouterRequest) -> None:
        pass

    def end_request(self, request: RouterRequest, error: object) -> None:
        request.close()

    def capacity_changed(self) -> None:
        pass


def _step(*request_ids: str) -> engine_pb2.EngineStep:
    step = engine_pb2.EngineStep()
    for rid in request_ids:
        step.updates.add(request_id=rid, token_ids=[10])
    return step


def _answer(message: tokenizer_pb2.DetokenizeRequest) -> tokenizer_pb2.DetokenizeResponse:
    """What the tokenizer would say: each update's request id upper-cased as its text."""
    response = tokenizer_pb2.DetokenizeResponse(sequence_number=message.sequence_number)
    for update in message.updates:
        response.deltas.add(request_id=update.request_id, text=update.request_id.upper())
    return response


def test_first_tokens_go_ahead_in_a_message_of_their_own_and_are_pushed_first() -> None:
    running = {
        rid: RouterRequest(rid, "", [1, 2], SamplingParams(), detokenizer_open=True)
        for rid in ("a", "b", "c", "d")
    }
    running["a"].push(OutputPiece(token_ids=[7]))  # a and c already streamed; b and d are new
    running["c"].push(OutputPiece(token_ids=[7]))
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    streamer.on_step("engine", _step("a", "b", "c", "d"))
    first, rest = tokenizer.sent  # sent in this order, so the tokenizer answers it first
    assert [u.request_id for u in first.updates] == ["b", "d"]
    assert [u.request_id for u in rest.updates] == ["a", "c"]
    assert first.sequence_number != rest.sequence_number
    order: list[str] = []
    for rid, request in running.items():
        request._wake = lambda rid=rid: order.append(rid)  # records who is woken, in order
    streamer.on_detokenized(_answer(first))
    assert order == ["b", "d"]
    streamer.on_detokenized(_answer(rest))
    assert order == ["b", "d", "a", "c"]
    assert running["b"]._pending.text == "B"
    assert (running["a"]._pending.text, running["a"]._pending.token_ids) == ("A", [7, 10])


def test_a_step_of_one_kind_is_one_message() -> None:
    running = {
        rid: RouterRequest(rid, "", [1], SamplingParams(), detokenizer_open=True)
        for rid in ("a", "b")
    }
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    streamer.on_step("engine", _step("a", "b"))  # both new
    (message,) = tokenizer.sent
    streamer.on_detokenized(_answer(message))
    streamer.on_step("engine", _step("a", "b"))  # both streaming now
    assert len(tokenizer.sent) == 2
    assert [u.request_id for u in tokenizer.sent[1].updates] == ["a", "b"]


def test_with_answers_outstanding_a_step_is_one_message() -> None:
    """The tokenizer is behind (the last step's messages are unanswered): the next step goes as
    one message, first tokens still pushed first; per request the text stays in order."""
    running = {
        rid: RouterRequest(rid, "", [1], SamplingParams(), detokenizer_open=True)
        for rid in ("old", "new")
    }
    running["old"].push(OutputPiece(token_ids=[7]))
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    streamer.on_step("engine", _step("old", "new"))
    streamer.on_step("engine", _step("old", "new"))  # "new" still has no text
    ids = [[u.request_id for u in m.updates] for m in tokenizer.sent]
    assert ids == [["new"], ["old"], ["old", "new"]]
    order: list[str] = []
    for rid, request in running.items():
        request._wake = lambda rid=rid: order.append(rid)
    for message in tokenizer.sent:
        streamer.on_detokenized(_answer(message))
    assert order == ["new", "old", "new", "old"]
    assert running["new"]._pending.text == "NEWNEW"
    assert running["new"].completion_tokens == 2


def _phase_counts() -> dict[str, float]:
    return {
        phase: REGISTRY.get_sample_value(
            "sluice_router_first_token_phase_seconds_count", {"phase": phase}
        )
        or 0.0
        for phase in ("tokenize", "queue", "engine", "detokenize")
    }


def test_first_text_records_the_phases_of_time_to_first_token_once() -> None:
    now = time.monotonic()
    text = RouterRequest("t", "", [1], SamplingParams(), detokenizer_open=True, arrival=now - 0.5)
    text.tokenized_at, text.placed_at = now - 0.4, now - 0.3
    ids = RouterRequest("i", "", [1], SamplingParams(), detokenizer_open=True, arrival=now - 0.5)
    ids.placed_at = now - 0.45  # came with token ids: no tokenize phase
    running = {"t": text, "i": ids}
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    before = _phase_counts()
    for _ in range(2):  # the second step is no first token: nothing more is recorded
        streamer.on_step("engine", _step(*running))
        streamer.on_detokenized(_answer(tokenizer.sent[-1]))
    after = _phase_counts()
    added = {phase: after[phase] - before[phase] for phase in after}
    assert added == {"tokenize": 1, "queue": 2, "engine": 2, "detokenize": 2}
    assert 0 < text.first_step_at - text.placed_at < 5  # seconds, stamped at the first step
    assert text.completion_tokens == 2
