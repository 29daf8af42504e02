"""OutputStreamer: detokenize messages per engine step, pieces back per request, first tokens
first, tokens the pacing would hold kept as ids until their response is due."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from protos.sluice.v1 import common_pb2, engine_pb2, tokenizer_pb2
from services.common.protocol.sampling_params import SamplingParams
from services.router.pacing import StreamPacing
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


def test_a_step_is_one_message_and_first_tokens_are_pushed_first() -> None:
    running = {
        rid: RouterRequest(rid, "", [1, 2], SamplingParams(), detokenizer_open=True)
        for rid in ("a", "b", "c", "d")
    }
    running["a"].push(OutputPiece(token_ids=[7]))  # a and c already streamed; b and d are new
    running["c"].push(OutputPiece(token_ids=[7]))
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    streamer.on_step("engine", _step("a", "b", "c", "d"))
    (message,) = tokenizer.sent
    assert sorted(u.request_id for u in message.updates) == ["a", "b", "c", "d"]
    order: list[str] = []
    for rid, request in running.items():
        request._wake = lambda rid=rid: order.append(rid)  # records who is woken, in order
    streamer.on_detokenized(_answer(message))
    assert order == ["b", "d", "a", "c"]
    assert running["b"]._pending.text == "B"
    assert (running["a"]._pending.text, running["a"]._pending.token_ids) == ("A", [7, 10])


def test_with_answers_outstanding_the_text_of_each_request_stays_in_order() -> None:
    """The tokenizer is behind (the last step's message is unanswered): answers pair with
    their steps by sequence number, and each request's text arrives in order."""
    running = {
        rid: RouterRequest(rid, "", [1], SamplingParams(), detokenizer_open=True)
        for rid in ("old", "new")
    }
    running["old"].push(OutputPiece(token_ids=[7]))
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    streamer.on_step("engine", _step("old", "new"))
    streamer.on_step("engine", _step("old", "new"))  # "new" still has no text
    ids = [sorted(u.request_id for u in m.updates) for m in tokenizer.sent]
    assert ids == [["new", "old"], ["new", "old"]]
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


def _streaming(interval: int, **params: object) -> RouterRequest:
    """A request that has had its first response read, paced at `interval` tokens."""
    request = RouterRequest(
        "r",
        "",
        [1],
        SamplingParams(**params),
        detokenizer_open=True,
        pacing=StreamPacing.fixed(interval),
    )
    request.push(OutputPiece(text="first", token_ids=[7]))
    piece = asyncio.run(request.next_piece())
    assert piece.token_ids == [7]
    return request


def _token_step(token: int, *, finish_reason: int = 0, logprob: float | None = None):
    step = engine_pb2.EngineStep()
    update = step.updates.add(request_id="r", token_ids=[token], finish_reason=finish_reason)
    if logprob is not None:
        update.logprobs.add(token_id=token, logprob=logprob)
    if finish_reason:
        update.usage.prompt_tokens = 1
    return step


def _numbered(message: tokenizer_pb2.DetokenizeRequest) -> tokenizer_pb2.DetokenizeResponse:
    """Each update's text: its token ids written out, so a test sees what was decoded."""
    response = tokenizer_pb2.DetokenizeResponse(sequence_number=message.sequence_number)
    for update in message.updates:
        text = "".join(f"<{t}>" for t in update.token_ids)
        response.deltas.add(request_id=update.request_id, text=text, closed=update.finished)
    return response


def test_tokens_the_pacing_would_hold_go_to_the_detokenizer_together_when_due() -> None:
    """At 4 tokens per response the detokenizer sees the request once per 4 steps, with the 4
    tokens (and their logprobs) in order; the piece it answers is due at once."""
    request = _streaming(4, logprobs=0)
    tokenizer = _Tokenizer()
    streamer = OutputStreamer({"r": request}, tokenizer, _Releaser())
    for token in (11, 12, 13):
        streamer.on_step("engine", _token_step(token, logprob=-token / 10))
    assert tokenizer.sent == []  # held as ids: nothing to decode yet
    assert request.undecoded_ids == [11, 12, 13]
    streamer.on_step("engine", _token_step(14, logprob=-1.4))
    (message,) = tokenizer.sent
    assert [list(u.token_ids) for u in message.updates] == [[11, 12, 13, 14]]
    assert request.undecoded_ids == [] and request.undecoded_logprobs == []
    woken: list[bool] = []
    request._wake = lambda: woken.append(True)
    streamer.on_detokenized(_numbered(message))
    assert woken == [True]
    piece = request._pending
    assert (piece.text, piece.token_ids) == ("<11><12><13><14>", [11, 12, 13, 14])
    assert [round(p.logprob, 2) for p in piece.logprobs] == [-1.1, -1.2, -1.3, -1.4]
    assert request.completion_tokens == 5


def test_requests_with_stop_strings_are_decoded_every_step() -> None:
    """A stop string must be seen at the step that completes it, so the engine stops there."""
    request = _streaming(4, stop=["END"])
    tokenizer = _Tokenizer()
    streamer = OutputStreamer({"r": request}, tokenizer, _Releaser())
    for token in (11, 12):
        streamer.on_step("engine", _token_step(token))
    assert [[list(u.token_ids) for u in m.updates] for m in tokenizer.sent] == [[[11]], [[12]]]
    assert request.undecoded_ids == []


def test_the_last_step_takes_the_held_tokens_with_it() -> None:
    request = _streaming(8)
    tokenizer = _Tokenizer()
    streamer = OutputStreamer({"r": request}, tokenizer, _Releaser())
    streamer.on_step("engine", _token_step(11))
    streamer.on_step("engine", _token_step(12, finish_reason=common_pb2.FINISH_REASON_LENGTH))
    (message,) = tokenizer.sent
    (update,) = message.updates
    assert (list(update.token_ids), update.finished) == ([11, 12], True)
    streamer.on_detokenized(_numbered(message))
    piece = request._pending
    assert (piece.text, piece.token_ids) == ("<11><12>", [11, 12])
    assert piece.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (piece.prompt_tokens, piece.completion_tokens) == (1, 3)
    assert request.finished


def test_held_tokens_past_the_hold_limit_are_decoded_and_sent_at_once() -> None:
    old, new = _streaming(8), _streaming(8)
    new.request_id = "n"
    gone = _streaming(8)
    gone.request_id = "g"
    running = {"r": old, "n": new, "g": gone}
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    streamer.on_step("engine", _token_step(11))  # old's token, held
    now = time.monotonic()
    new.hold_undecoded([21], [], now + 10)  # held later than the limit looks back to
    gone.hold_undecoded([31], [], now - 1)
    gone.close()  # ended meanwhile (cancelled): its held ids are dropped, never decoded
    streamer.flush_undecoded(now + 5)
    (message,) = tokenizer.sent
    assert [(u.request_id, list(u.token_ids)) for u in message.updates] == [("r", [11])]
    assert new.undecoded_ids == [21] and gone.undecoded_ids == []
    woken: list[bool] = []
    old._wake = lambda: woken.append(True)
    streamer.on_detokenized(_numbered(message))
    assert woken == [True]  # one token, yet due: the hold limit passed
    assert old._pending.text == "<11>" and not old._pending.finish_reason
    streamer.flush_undecoded(now + 5)
    assert len(tokenizer.sent) == 1  # nothing else was overdue


def test_an_update_the_engine_gathered_is_decoded_at_once_not_held_again() -> None:
    """An engine that honours the session's pacing sends a held request's tokens several to an
    update: those are due as they come, even when fewer than the interval (a time flush)."""
    request = _streaming(8)
    tokenizer = _Tokenizer()
    streamer = OutputStreamer({"r": request}, tokenizer, _Releaser())
    step = engine_pb2.EngineStep()
    step.updates.add(request_id="r", token_ids=[11, 12, 13])
    streamer.on_step("engine", step)
    (message,) = tokenizer.sent
    assert [list(u.token_ids) for u in message.updates] == [[11, 12, 13]]
    streamer.on_step("engine", _token_step(14))  # one token: the pacing holds it as before
    assert len(tokenizer.sent) == 1 and request.undecoded_ids == [14]


def test_submits_let_the_engine_hold_tokens_unless_stop_strings_are_checked() -> None:
    from services.router.convert import submit_pb

    plain = RouterRequest("a", "", [1], SamplingParams())
    stopping = RouterRequest("b", "", [1], SamplingParams(stop=["END"]))
    assert submit_pb(plain).hold_tokens and not submit_pb(stopping).hold_tokens


def test_each_engine_session_is_told_the_pacing_once_and_on_change() -> None:
    from services.router.engine_pool import EngineConnection

    class Call:
        def __init__(self) -> None:
            self.written: list[engine_pb2.EngineRequest] = []

        async def write(self, message: engine_pb2.EngineRequest) -> None:
            self.written.append(message)

    async def scenario() -> list[engine_pb2.EngineRequest]:
        connection = EngineConnection("127.0.0.1:1", None, None, lambda: None)
        connection.capacity.ready = True  # as after _connected
        call = Call()
        writer = asyncio.get_running_loop().create_task(connection._write(call))
        connection.set_pacing(4, 250)
        await asyncio.sleep(0.01)
        connection.submit(engine_pb2.SubmitRequest(request_id="x"))  # pacing unchanged
        await asyncio.sleep(0.01)
        connection.set_pacing(4, 250)  # the same again: nothing to send
        await asyncio.sleep(0.01)
        connection.set_pacing(8, 250)
        await asyncio.sleep(0.01)
        writer.cancel()
        await connection.close()
        return call.written

    written = asyncio.run(scenario())
    assert [m.HasField("pacing") for m in written] == [True, False, True]
    assert [m.pacing.tokens_per_update for m in written if m.HasField("pacing")] == [4, 8]
    assert written[0].pacing.max_hold_ms == 250 and len(written[1].submits) == 1


def test_a_lost_message_names_the_requests_whose_text_it_carried() -> None:
    """A request's last tokens go out in a message that unpins it from its tokenizer replica;
    if that replica dies before answering, only the forgotten message knows whose text is
    lost, so the router can fail the request instead of leaving its stream open."""
    running = {"r": _streaming(1), "s": _streaming(1)}
    running["s"].request_id = "s"
    tokenizer = _Tokenizer()
    streamer = OutputStreamer(running, tokenizer, _Releaser())
    streamer.on_step("engine", _token_step(11, finish_reason=common_pb2.FINISH_REASON_LENGTH))
    (last,) = tokenizer.sent
    assert [update.finished for update in last.updates] == [True]
    assert streamer.forget_pending({last.sequence_number}) == [running["r"]]
    assert streamer.forget_pending({last.sequence_number}) == []  # forgotten once
