"""Stream pacing: one token per response under the message budget, more above it, bounded."""

from __future__ import annotations

import asyncio

import pytest

from services.common.protocol.sampling_params import SamplingParams
from services.router.pacing import RATE_WINDOW_S, StreamPacing
from services.router.request import OutputPiece, RouterRequest


def feed(pacing: StreamPacing, tokens_per_s: float, seconds: float, start: float = 0.0) -> float:
    """Report `tokens_per_s` as 100 steps per second for `seconds`; returns the end time."""
    steps = int(seconds * 100)
    for index in range(1, steps + 1):
        pacing.observe(round(tokens_per_s / 100), start + index / 100)
    return start + steps / 100


def test_adaptive_interval_follows_the_token_rate_against_the_budget() -> None:
    pacing = StreamPacing(message_budget=4000, max_interval=8)
    assert pacing.adaptive and pacing.interval == 1
    end = feed(pacing, 3000, 1.0)
    assert pacing.interval == 1  # under the budget: one message per token
    end = feed(pacing, 9600, 1.0, end)
    assert pacing.interval == 3  # ceil(9600 / 4000)
    assert pacing.tokens_per_s == pytest.approx(9600, rel=0.05)
    end = feed(pacing, 100_000, 1.0, end)
    assert pacing.interval == 8  # capped
    feed(pacing, 500, 1.0, end)
    assert pacing.interval == 1  # back down once the load falls


def test_idle_windows_bring_the_interval_back_to_one() -> None:
    pacing = StreamPacing(message_budget=1000)
    end = feed(pacing, 5000, 1.0)
    assert pacing.interval == 5
    pacing.idle(end + RATE_WINDOW_S)  # too soon: the window is still open
    assert pacing.interval == 5
    pacing.idle(end + 3 * RATE_WINDOW_S)  # the window's rate counts its quiet tail too
    assert 1 <= pacing.interval < 5
    pacing.idle(end + 6 * RATE_WINDOW_S)  # then a window without any token
    assert pacing.interval == 1 and pacing.tokens_per_s == 0


def test_fixed_interval_never_changes() -> None:
    pacing = StreamPacing.fixed(4)
    assert not pacing.adaptive
    feed(pacing, 1_000_000, 1.0)
    assert pacing.interval == 4
    with pytest.raises(ValueError):
        StreamPacing.fixed(0)


def test_requests_read_the_shared_interval_after_each_send() -> None:
    async def scenario() -> None:
        pacing = StreamPacing(message_budget=1000)
        request = RouterRequest("r1", "client", [1], SamplingParams(), pacing=pacing)
        request.push(OutputPiece(text="a", token_ids=[1]))
        assert (await request.next_piece(timeout_s=1.0)).token_ids == [1]
        feed(pacing, 3000, 1.0)  # the router got busy: 3 tokens per response from now on
        assert pacing.interval == 3
        request.push(OutputPiece(text="b", token_ids=[2]))  # due at the interval read before
        assert (await request.next_piece(timeout_s=1.0)).token_ids == [2]
        for token in (3, 4):
            request.push(OutputPiece(text="x", token_ids=[token]))
        reader = asyncio.ensure_future(request.next_piece())
        await asyncio.sleep(0.01)
        assert not reader.done()
        request.push(OutputPiece(text="y", token_ids=[5]))
        assert (await asyncio.wait_for(reader, 1.0)).token_ids == [3, 4, 5]

    asyncio.run(scenario())


def test_a_timeout_sends_held_tokens_first_then_raises() -> None:
    async def scenario() -> None:
        pacing = StreamPacing.fixed(4)
        request = RouterRequest("r1", "client", [1], SamplingParams(), pacing=pacing)
        request.push(OutputPiece(text="a", token_ids=[1]))
        assert (await request.next_piece(timeout_s=1.0)).token_ids == [1]  # the first: at once
        request.push(OutputPiece(text="b", token_ids=[2]))  # held: 1 of the 4 a response wants
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert (await request.next_piece(timeout_s=0.05)).token_ids == [2]
        assert 0.04 <= loop.time() - started < 0.5
        started = loop.time()
        with pytest.raises(TimeoutError):  # nothing at all: the time is up
            await request.next_piece(timeout_s=0.05)
        assert loop.time() - started >= 0.04
        for token in (3, 4, 5, 6):  # a full response before the timeout: no waiting for it
            request.push(OutputPiece(text="c", token_ids=[token]))
        assert (await request.next_piece(timeout_s=5.0)).token_ids == [3, 4, 5, 6]
        assert request._waiter is None

    asyncio.run(scenario())
