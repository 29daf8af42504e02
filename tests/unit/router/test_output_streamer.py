"""OutputStreamer: one detokenize message per engine step, pieces back per request, first tokens
first."""

from __future__ import annotations

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
