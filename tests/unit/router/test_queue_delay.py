"""Admission by time: the queueing-delay estimate and the gate that refuses on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from protos.sluice.v1 import engine_pb2
from services.common.errors import ResourceExhaustedError
from services.router.admission import AdmissionQueue
from services.router.dispatch import EngineCapacity
from services.router.queue_delay import (
    EngineLoadView,
    QueueDelayGate,
    estimate_start_delay,
)


def view(free_slots=0, queued=0, prefill=40_000.0, finished=40.0) -> EngineLoadView:
    return EngineLoadView(free_slots, queued, prefill, finished)


def test_free_slots_and_no_queue_start_at_once():
    estimate = estimate_start_delay([view(free_slots=10)], 0, 0)
    assert estimate is not None and estimate.delay_s == 0.0


def test_slot_wait_counts_the_requests_ahead_over_the_finish_rate():
    estimate = estimate_start_delay([view(free_slots=2, prefill=1e9)], 81, 0)
    assert estimate.slot_wait_s == pytest.approx(80 / 40.0)
    assert estimate.delay_s == pytest.approx(2.0)


def test_prefill_wait_counts_queued_prompt_tokens_and_engines_add_up():
    one = estimate_start_delay([view(free_slots=100, queued=80_000)], 0, 40_000)
    assert one.prefill_wait_s == pytest.approx(120_000 / 40_000)
    two = estimate_start_delay(
        [view(free_slots=50, queued=40_000), view(free_slots=50, queued=40_000)], 0, 40_000
    )
    assert two.prefill_wait_s == pytest.approx(120_000 / 80_000)


def test_no_measured_rate_means_no_estimate():
    assert estimate_start_delay([view(free_slots=0, finished=0.0)], 5, 0) is None
    assert estimate_start_delay([view(free_slots=9, queued=10, prefill=0.0)], 0, 0) is None


def connection(free_blocks=100, inflight=0, max_num_seqs=8, load=None):
    capacity = EngineCapacity(engine_id="e", ready=True, max_num_seqs=max_num_seqs)
    capacity.inflight = inflight
    capacity.free_blocks = free_blocks
    return SimpleNamespace(capacity=capacity, last_load=load)


def busy_load(**fields) -> engine_pb2.EngineLoad:
    values = dict(queued_prompt_tokens=0, prefill_tokens_per_s=10_000.0, finished_per_s=10.0)
    values.update(fields)
    return engine_pb2.EngineLoad(**values)


def test_gate_refuses_with_a_retry_after_of_the_excess():
    gate = QueueDelayGate(2.0, min_retry_after_s=0.5)
    full = connection(inflight=8, load=busy_load())
    gate.check([full], 19, 0)  # 20th for a slot at 10/s: 2.0 s, at the bound
    with pytest.raises(ResourceExhaustedError) as caught:
        gate.check([full], 49, 0)  # 5.0 s
    assert caught.value.retry_after_s == pytest.approx(3.0)
    assert gate.refused == 1 and gate.last_estimate.delay_s == pytest.approx(5.0)


def test_gate_is_off_at_zero_and_without_reports():
    QueueDelayGate(0.0).check([connection(inflight=8, load=busy_load())], 10_000, 10**9)
    QueueDelayGate(1.0).check([connection(inflight=8, load=None)], 10_000, 0)
    QueueDelayGate(1.0).check([], 10_000, 0)


def test_gate_refuses_on_queued_prompt_tokens():
    gate = QueueDelayGate(1.0)
    with pytest.raises(ResourceExhaustedError, match="wait about 3.0s"):
        gate.check([connection(inflight=1, load=busy_load(queued_prompt_tokens=30_000))], 0, 0)


def test_requests_placed_beyond_the_batch_wait_for_a_slot_too():
    """An engine that takes more in flight than it runs (LoRA slot time-slicing: several
    batches) holds the excess waiting for batch slots; a new request queues behind them, those
    in its report and those placed since."""
    estimate = estimate_start_delay([view(free_slots=-30, prefill=1e9)], 9, 0)
    assert estimate.slot_wait_s == pytest.approx(40 / 40.0)
    engine = connection(inflight=30, max_num_seqs=8, load=busy_load(running=8, waiting=14))
    engine.capacity.engine_max_inflight = 32  # four batches in flight
    assert EngineLoadView.of_connection(engine).free_slots == -22  # 14 reported, 8 on the way
    with pytest.raises(ResourceExhaustedError, match="wait about 2.3s"):
        QueueDelayGate(2.0).check([engine], 0, 0)  # 23rd for a slot at 10/s
    engine.last_load = busy_load(running=4, waiting=0)
    engine.capacity.inflight = 4  # half the batch free: starts at once
    QueueDelayGate(0.1).check([engine], 0, 0)


def test_sequences_paused_for_slot_turns_leave_the_estimate_to_the_in_flight_cap():
    """Paused sequences count as running; turns free batch room at a rate the engine does not
    report, so only the router's own cap on what it places there counts."""
    engine = connection(inflight=30, max_num_seqs=8, load=busy_load(running=26, waiting=4))
    engine.capacity.engine_max_inflight = 32
    assert EngineLoadView.of_connection(engine).free_slots == 2
    QueueDelayGate(0.1).check([engine], 1, 0)


def test_prompts_sent_after_the_engines_last_report_count_as_queued() -> None:
    """A burst outruns the engine's reports (one a step, and a step may take a second): the
    prompts sent since the load it last reported are queued there all the same."""
    import asyncio

    from services.router.engine_pool import EngineConnection

    async def scenario() -> None:
        pool = EngineConnection("127.0.0.1:1", None, None, lambda: None)
        try:
            pool.capacity.max_num_seqs = pool.capacity.engine_max_inflight = 64
            pool.capacity.inflight = 30
            pool.last_load = busy_load(running=0, waiting=0, queued_prompt_tokens=1_000)
            pool._count_sent([engine_pb2.SubmitRequest(prompt_token_ids=[1] * 500)] * 2)
            pool._note_taken(2, has_updates=True)  # an engine that counts
            pool._count_sent([engine_pb2.SubmitRequest(prompt_token_ids=[1] * 500)] * 30)
            assert pool.unreported == (30, 15_000)
            view = EngineLoadView.of_connection(pool)
            assert view.queued_prompt_tokens == 16_000
            with pytest.raises(ResourceExhaustedError, match="wait about 1.6s"):
                QueueDelayGate(1.0).check([pool], 0, 0)  # 16k tokens at 10k tokens/s
            pool._note_taken(2)  # a load-only step before the engine took any of them
            assert pool.unreported == (30, 15_000)
            pool._note_taken(22, has_updates=True)  # its load counts the first 20 of them
            assert pool.unreported == (10, 5_000)
            pool._note_taken(32)
            assert pool.unreported == (0, 0)
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_an_engine_that_does_not_count_submits_leaves_the_report_as_it_is() -> None:
    import asyncio

    from services.router.engine_pool import EngineConnection

    async def scenario() -> None:
        pool = EngineConnection("127.0.0.1:1", None, None, lambda: None)
        try:
            pool._count_sent([engine_pb2.SubmitRequest(prompt_token_ids=[1, 2])] * 3)
            pool._note_taken(0)  # a load-only step: nothing taken in yet, or no count at all
            assert pool.unreported == (3, 6)
            pool._note_taken(0, has_updates=True)  # updates, yet no count: predates the field
            assert pool.unreported == (0, 0)
            pool._count_sent([engine_pb2.SubmitRequest(prompt_token_ids=[1, 2])])
            assert pool.unreported == (0, 0)
        finally:
            await pool.close()

    asyncio.run(scenario())


class _Request:
    def __init__(self, priority: int, tokens: int) -> None:
        self.priority = priority
        self.num_prompt_tokens = tokens

    def expired(self, now=None) -> bool:
        return False


def test_queue_counts_what_goes_ahead_per_priority():
    queue = AdmissionQueue(100, 10_000)
    assert queue.ahead_of(0) == (0, 0)
    for priority, tokens in ((0, 10), (1, 20), (1, 30), (5, 40)):
        queue.admit(_Request(priority, tokens))
    assert queue.ahead_of(0) == (1, 10)
    assert queue.ahead_of(1) == (3, 60)
    assert queue.ahead_of(9) == (4, 100)
    assert queue.ahead_of(-1) == (0, 0)  # a more urgent request skips the whole queue
