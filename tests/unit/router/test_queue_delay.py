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
    from prometheus_client import REGISTRY

    gauge = "sluice_router_estimated_start_delay_seconds"
    assert REGISTRY.get_sample_value(gauge) == pytest.approx(5.0)  # what operators see
    gate.check([full], 9, 0)
    assert REGISTRY.get_sample_value(gauge) == pytest.approx(1.0)


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


def profiled(steps, free_slots=0, step_s=0.02, hazard=0.0, finished=40.0) -> EngineLoadView:
    from services.common.protocol import finish_profile

    values, count = finish_profile.sample(steps)
    return EngineLoadView(
        free_slots,
        0,
        1e9,
        finished,
        finish_steps=values,
        finish_steps_of=count,
        step_s=step_s,
        stop_hazard=hazard,
        profiled=True,
    )


def test_a_wave_of_long_running_requests_holds_new_ones_off_whatever_the_finish_rate():
    """256 requests of one length started within 40 steps of each other: the last wave finished
    at 40/s, but the next slot frees only when this wave reaches its limits, 100+ steps on."""
    wave = [100 + index % 40 for index in range(256)]
    estimate = estimate_start_delay([profiled(wave)], 9, 0)
    assert estimate.slot_wait_s > 100 * 0.02  # the first finish is 2 s away
    assert estimate.slot_wait_s == pytest.approx((100 + 40 * 10 / 256) * 0.02, rel=0.03)
    by_rate = estimate_start_delay([view(prefill=1e9)], 9, 0)
    assert by_rate.slot_wait_s == pytest.approx(10 / 40.0)  # what a rate alone promises


def test_spread_out_limits_free_slots_as_they_come():
    staggered = list(range(1, 257))  # one sequence reaches its limit every step
    estimate = estimate_start_delay([profiled(staggered, step_s=0.01)], 49, 0)
    assert estimate.slot_wait_s == pytest.approx(50 * 0.01, rel=0.05)


def test_early_stops_bring_the_wait_down_to_the_finish_rate():
    """Long limits but a high chance of stopping each step: expected frees ~ rows x hazard a
    step, as a finish rate of that size would say."""
    far = [4000] * 256
    assert estimate_start_delay([profiled(far)], 9, 0).slot_wait_s > 70.0  # limits only
    stopping = estimate_start_delay([profiled(far, hazard=0.01)], 9, 0)
    rate = 256 * 0.01 / 0.02  # 128 finishes a second
    assert stopping.slot_wait_s == pytest.approx(10 / rate, rel=0.1)


def test_engines_free_slots_together_and_past_the_last_limit_the_rate_counts():
    one = profiled([50] * 100, step_s=0.02)  # frees 100 slots at 1.0 s
    two = profiled([10] * 100, step_s=0.05)  # frees 100 slots at 0.5 s
    assert estimate_start_delay([one, two], 99, 0).slot_wait_s == pytest.approx(0.5, rel=1e-3)
    assert estimate_start_delay([one, two], 150, 0).slot_wait_s == pytest.approx(1.0, rel=1e-3)
    beyond = estimate_start_delay([one, two], 239, 0)  # 40 more than both batches hold
    assert beyond.slot_wait_s == pytest.approx(1.0 + 40 / 80.0)


def test_an_engine_without_a_profile_leaves_the_estimate_to_the_finish_rate():
    mixed = [profiled([100] * 64), view(prefill=1e9)]
    assert estimate_start_delay(mixed, 9, 0).slot_wait_s == pytest.approx(10 / 80.0)


def test_the_reported_profile_reaches_the_estimate():
    """From the engine's load message: steps to each limit, the decode rate (a step's time is
    the batch over it) and the hazard; sequences paused for slot turns turn it off."""
    steps = engine_pb2.EngineLoad(
        running=8,
        finish_steps=[30, 30, 31, 31, 32, 32, 33, 33],
        finish_steps_of=8,
        decode_tokens_per_s=400.0,  # 8 rows: 50 steps a second
        prefill_tokens_per_s=1e9,
        finished_per_s=100.0,
    )
    engine = connection(inflight=8, max_num_seqs=8, load=steps)
    seen = EngineLoadView.of_connection(engine)
    assert seen.profiled and seen.step_s == pytest.approx(0.02) and seen.finish_steps_of == 8
    with pytest.raises(ResourceExhaustedError, match="wait about 0.6s"):
        QueueDelayGate(0.5).check([engine], 0, 0)  # the first limit is 30 steps = 0.6 s away
    engine.capacity.engine_max_inflight = 32
    engine.last_load = engine_pb2.EngineLoad(
        running=20,
        waiting=0,
        finish_steps=[5] * 8,
        finish_steps_of=8,
        decode_tokens_per_s=400.0,
        finished_per_s=10.0,
    )  # 12 paused for a slot turn
    assert not EngineLoadView.of_connection(engine).profiled
    old = engine_pb2.EngineLoad(running=8, decode_tokens_per_s=400.0, finished_per_s=10.0)
    engine.capacity.engine_max_inflight = 0
    engine.last_load = old  # an engine that reports no profile
    assert not EngineLoadView.of_connection(engine).profiled


def test_no_finish_yet_means_no_basis_even_with_limits_far_away():
    """Limits are upper bounds: until a request has finished, how often sequences stop before
    theirs is unknown, so nothing is refused on time (a burst at start-up is not turned away
    on the bound of max_tokens alone)."""
    far = profiled([4000] * 256, finished=0.0)
    assert estimate_start_delay([far], 9, 0) is None
    assert estimate_start_delay([profiled([4000] * 256)], 9, 0).slot_wait_s > 70.0
