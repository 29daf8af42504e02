"""Request lifecycle: legal transitions, channel semantics, merging, deadline."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.errors import DeadlineExceededError
from services.common.protocol.sampling_params import SamplingParams
from services.router.pacing import StreamPacing
from services.router.request import (
    IllegalTransitionError,
    OutputPiece,
    RequestState,
    RouterRequest,
    absorb,
)


def make(deadline: float | None = None) -> RouterRequest:
    return RouterRequest("r1", "client", [1, 2, 3], SamplingParams(), deadline=deadline)


def test_state_machine_edges() -> None:
    request = make()
    assert request.state is RequestState.QUEUED
    request.mark_running("engine-a")
    assert request.engine_id == "engine-a"
    with pytest.raises(IllegalTransitionError):
        request.transition(RequestState.QUEUED)
    request.push(OutputPiece(token_ids=[5], finish_reason=1))
    assert request.finished
    with pytest.raises(IllegalTransitionError):
        request.transition(RequestState.RUNNING)


def test_pieces_after_finish_are_dropped_and_fail_is_once() -> None:
    request = make()
    request.push(OutputPiece(text="a", token_ids=[1], finish_reason=1))
    request.push(OutputPiece(text="b", token_ids=[2]))
    assert request.fail(DeadlineExceededError("late")) is False
    assert request.completion_tokens == 1


def test_channel_merges_pending_pieces_and_ends() -> None:
    async def scenario() -> None:
        request = make()
        request.push(OutputPiece(text="he", token_ids=[1]))
        request.push(
            OutputPiece(text="llo", token_ids=[2, 3], finish_reason=2, completion_tokens=3)
        )
        piece = await request.next_piece()
        assert piece.text == "hello" and piece.token_ids == [1, 2, 3]
        assert piece.finish_reason == 2 and piece.completion_tokens == 3
        assert await request.next_piece() is None

    asyncio.run(scenario())


def test_consumer_wakes_on_push_and_on_error() -> None:
    async def scenario() -> None:
        request = make()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, request.push, OutputPiece(text="x", token_ids=[9]))
        assert (await request.next_piece(timeout_s=1.0)).text == "x"
        loop.call_later(0.01, request.fail, DeadlineExceededError("gone"))
        with pytest.raises(DeadlineExceededError):
            await request.next_piece(timeout_s=1.0)

    asyncio.run(scenario())


def test_timeout_when_nothing_arrives() -> None:
    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await make().next_piece(timeout_s=0.01)

    asyncio.run(scenario())


def test_deadline_helpers() -> None:
    request = make(deadline=time.monotonic() + 10)
    assert not request.expired()
    assert request.expired(now=request.deadline + 0.001)
    assert 9 < request.remaining() <= 10
    assert make().remaining() is None and not make().expired()


def test_absorb_appends_in_order_and_keeps_the_last_ending() -> None:
    merged = OutputPiece(text="a", token_ids=[1], logprobs=["lp1"])
    absorb(merged, OutputPiece(text="b", token_ids=[2], logprobs=["lp2"]))
    absorb(merged, OutputPiece(text="c", token_ids=[3], matched_stop="c", finish_reason=3))
    assert (merged.text, merged.token_ids, merged.logprobs) == ("abc", [1, 2, 3], ["lp1", "lp2"])
    assert (merged.finish_reason, merged.matched_stop) == (3, "c")


def test_stream_interval_holds_pieces_until_enough_tokens() -> None:
    async def scenario() -> None:
        request = RouterRequest("r1", "client", [1], SamplingParams(), pacing=StreamPacing.fixed(3))
        request.push(OutputPiece(text="a", token_ids=[1]))
        first = await request.next_piece(timeout_s=1.0)
        assert first.token_ids == [1]  # the first token goes at once (time to first token)
        request.push(OutputPiece(text="b", token_ids=[2]))
        request.push(OutputPiece(text="c", token_ids=[3]))
        reader = asyncio.ensure_future(request.next_piece())
        await asyncio.sleep(0.02)
        assert not reader.done()  # 2 of 3 tokens: held back
        request.push(OutputPiece(text="d", token_ids=[4]))
        piece = await asyncio.wait_for(reader, 1.0)
        assert (piece.text, piece.token_ids) == ("bcd", [2, 3, 4])
        request.push(OutputPiece(text="e", token_ids=[5]))
        request.push(OutputPiece(text="f", token_ids=[6], finish_reason=2))
        last = await request.next_piece(timeout_s=1.0)  # the end flushes what is held
        assert (last.text, last.token_ids, last.finish_reason) == ("ef", [5, 6], 2)
        assert await request.next_piece() is None

    asyncio.run(scenario())


def test_stream_interval_flushes_held_pieces_before_an_error_or_the_deadline() -> None:
    async def scenario() -> None:
        request = RouterRequest("r1", "client", [1], SamplingParams(), pacing=StreamPacing.fixed(8))
        request.push(OutputPiece(text="a", token_ids=[1]))
        await request.next_piece()
        request.push(OutputPiece(text="b", token_ids=[2]))
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, request.fail, DeadlineExceededError("gone"))
        assert (await request.next_piece(timeout_s=1.0)).text == "b"
        with pytest.raises(DeadlineExceededError):
            await request.next_piece(timeout_s=1.0)
        late = RouterRequest("r2", "client", [1], SamplingParams(), pacing=StreamPacing.fixed(8))
        late.push(OutputPiece(text="a", token_ids=[1]))
        await late.next_piece()
        late.push(OutputPiece(text="b", token_ids=[2]))
        assert (await late.next_piece(timeout_s=0.01)).text == "b"  # deadline: sent, not lost
        with pytest.raises(TimeoutError):
            await late.next_piece(timeout_s=0.01)

    asyncio.run(scenario())


def test_flush_held_sends_pieces_held_past_the_limit_and_no_others() -> None:
    async def scenario() -> None:
        request = RouterRequest("r1", "client", [1], SamplingParams(), pacing=StreamPacing(4))
        request.push(OutputPiece(text="a", token_ids=[1]))
        await request.next_piece()
        request.push(OutputPiece(text="b", token_ids=[2]))
        reader = asyncio.ensure_future(request.next_piece())
        await asyncio.sleep(0.01)
        request.flush_held(held_before=time.monotonic() - 60)  # held for less than that
        await asyncio.sleep(0.01)
        assert not reader.done()
        request.flush_held(held_before=time.monotonic())
        piece = await asyncio.wait_for(reader, 1.0)
        assert piece.token_ids == [2]
        # The interval is read again after each send: still 4 tokens for the next one.
        request.push(OutputPiece(text="c", token_ids=[3]))
        assert request._pending is not None and request._pending_tokens < request._send_at

    asyncio.run(scenario())
