"""OutputStreamer: one detokenize message per engine step, pieces back per request, first tokens
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


def test_one_message_per_step_and_first_tokens_are_pushed_first() -> None:
    running = {
        rid: RouterRequest(rid, "", [1, 2], SamplingParams(), detokenizer_open=True)
        for rid in ("a", "b", "c")
    }
    running["a"].push(OutputPiece(token_ids=[7]))  # a and c already streamed; b is new
    running["c"].push(OutputPiece(token_ids=[7]))
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    step = engine_pb2.EngineStep()
    for rid in ("a", "b", "c"):
        step.updates.add(request_id=rid, token_ids=[10])
    streamer.on_step("engine", step)
    (message,) = tokenizer.sent
    assert [u.request_id for u in message.updates] == ["a", "b", "c"]
    order: list[str] = []
    for rid, request in running.items():
        request._wake = lambda rid=rid: order.append(rid)  # records who is woken, in order
    response = tokenizer_pb2.DetokenizeResponse(sequence_number=message.sequence_number)
    for rid in ("a", "b", "c"):
        response.deltas.add(request_id=rid, text=rid.upper())
    streamer.on_detokenized(response)
    assert order == ["b", "a", "c"]
    assert running["b"]._pending.text == "B"
    assert (running["a"]._pending.text, running["a"]._pending.token_ids) == ("A", [7, 10])


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
        step = engine_pb2.EngineStep()
        for rid in running:
            step.updates.add(request_id=rid, token_ids=[10])
        streamer.on_step("engine", step)
        response = tokenizer_pb2.DetokenizeResponse(
            sequence_number=tokenizer.sent[-1].sequence_number
        )
        for rid in running:
            response.deltas.add(request_id=rid, text="x")
        streamer.on_detokenized(response)
    after = _phase_counts()
    added = {phase: after[phase] - before[phase] for phase in after}
    assert added == {"tokenize": 1, "queue": 2, "engine": 2, "detokenize": 2}
    assert 0 < text.first_step_at - text.placed_at < 5  # seconds, stamped at the first step
    assert text.completion_tokens == 2
