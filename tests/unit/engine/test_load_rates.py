"""The engine's measured prefill, decode and finish rates."""

from __future__ import annotations

import pytest

from services.engine.load_rates import StepRates


def test_rates_are_per_busy_second_after_a_window():
    rates = StepRates(window_s=0.1, weight=1.0)
    rates.record(0.05, prefill_tokens=1000, decode_tokens=10, finished=0)
    assert rates.prefill_tokens_per_s == 0.0  # window not yet full
    rates.record(0.05, prefill_tokens=0, decode_tokens=50, finished=5)
    assert rates.prefill_tokens_per_s == pytest.approx(1000 / 0.05)  # prefill steps only
    assert rates.decode_tokens_per_s == pytest.approx(60 / 0.1)
    assert rates.finished_per_s == pytest.approx(5 / 0.1)


def test_idle_steps_do_not_count_and_the_average_moves_by_its_weight():
    rates = StepRates(window_s=0.1, weight=0.5)
    rates.record(0.1, prefill_tokens=0, decode_tokens=100, finished=0)
    assert rates.decode_tokens_per_s == pytest.approx(1000)
    rates.record(5.0, prefill_tokens=0, decode_tokens=0, finished=0)  # idle: ignored
    rates.record(0.1, prefill_tokens=0, decode_tokens=300, finished=0)
    assert rates.decode_tokens_per_s == pytest.approx(2000)
    rates.reset()
    assert rates.decode_tokens_per_s == 0.0


def test_engine_reports_queued_prompt_tokens_and_rates():
    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from tests.unit.engine.fake_runner import FakeModelRunner

    runner = FakeModelRunner(vocab_size=300, num_blocks=256, block_size=4, max_model_len=256)
    config = EngineConfig(model="fake", device="cpu", max_num_batched_tokens=64)
    engine = LLMEngine(config, model_runner=runner)
    engine.rates = StepRates(window_s=1e-9, weight=1.0)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, 101)), params)
    engine.add_request("b", list(range(1, 41)), params)
    assert engine.load().queued_prompt_tokens == 140
    engine.step()  # 64 prompt tokens of "a"
    assert engine.load().queued_prompt_tokens == 76
    assert engine.rates.prefill_tokens_per_s > 0
    while engine.has_unfinished():
        engine.step()
    load = engine.load()
    assert load.queued_prompt_tokens == 0 and load.decode_tokens_per_s > 0


def test_step_cost_fit_recovers_the_step_time_model():
    from services.engine.load_rates import StepCostFit

    fit = StepCostFit(decay=0.99, min_steps=8)
    for step in range(60):
        rows, tokens = (step * 37) % 200, 64 + (step * 211) % 4000
        assert (fit.cost() is None) == (step < 8)
        fit.record(5.0 + 0.04 * rows + 0.02 * tokens, decode_rows=rows, prefill_tokens=tokens)
    cost = fit.cost()
    assert cost.fixed_ms == pytest.approx(5.0, rel=1e-4)
    assert cost.per_decode_row_ms == pytest.approx(0.04, rel=1e-4)
    assert cost.per_prefill_token_ms == pytest.approx(0.02, rel=1e-4)
    assert cost.predict_ms(100, 1000) == pytest.approx(5.0 + 4.0 + 20.0, rel=1e-4)


def test_step_cost_fit_keeps_costs_non_negative_and_bounds_stalls():
    from services.engine.load_rates import StepCostFit

    fit = StepCostFit(decay=1.0, min_steps=4, outlier_factor=3.0)
    for step in range(20):  # no decodes at all, and more rows made steps faster: never < 0
        tokens = 100 + 50 * step
        fit.record(1.0 + 0.01 * tokens, decode_rows=0, prefill_tokens=tokens)
    cost = fit.cost()
    assert cost.per_decode_row_ms == 0.0
    assert cost.fixed_ms == pytest.approx(1.0) and cost.per_prefill_token_ms == pytest.approx(0.01)
    fit.record(10_000.0, decode_rows=0, prefill_tokens=100)  # a stall counts as 3x predicted
    assert fit.cost().predict_ms(0, 100) < 2 * 2.0
    fit.reset()
    assert fit.cost() is None and fit.num_steps == 0


def test_step_rates_fit_only_steps_that_hold_prefill():
    rates = StepRates()
    for _ in range(10):
        rates.record(0.010, prefill_tokens=0, decode_tokens=64, finished=0)
    assert rates.step_cost() is None and rates.costs.num_steps == 0
    for step in range(10):
        tokens = 100 * (step + 1)
        rates.record(
            (2.0 + 0.01 * tokens) / 1e3, prefill_tokens=tokens, decode_tokens=8, finished=0
        )
    assert rates.step_cost().predict_ms(8, 500) == pytest.approx(7.0, rel=1e-3)
    rates.reset()
    assert rates.step_cost() is None


def test_step_cost_fit_charges_prefill_when_full_steps_cannot_tell_the_terms_apart():
    from services.engine.load_rates import StepCostFit

    fit = StepCostFit(decay=0.98, min_steps=8)
    for step in range(30):  # every step filled the 8,192-token budget: rows + tokens constant
        rows = 16 * step
        fit.record(150.0 + 0.05 * rows, decode_rows=rows, prefill_tokens=8192 - rows)
    cost = fit.cost()
    assert cost.per_prefill_token_ms > 0  # so a step-time target can cap the next steps
    assert cost.predict_ms(100, 8092) == pytest.approx(155.0, rel=1e-6)


def test_stop_hazard_counts_early_ends_per_token_generated():
    rates = StepRates(window_s=0.1, weight=1.0)
    rates.record(0.1, prefill_tokens=0, decode_tokens=400, finished=6, stopped_early=2)
    assert rates.stop_hazard == pytest.approx(2 / 400)
    rates.record(0.1, prefill_tokens=0, decode_tokens=400, finished=3, stopped_early=0)
    assert rates.stop_hazard == 0.0  # every finish at its limit: nothing ends early
    rates.reset()
    assert rates.stop_hazard == 0.0


def test_engine_reports_when_its_running_sequences_reach_their_limits():
    """The load's finish profile: steps until each running sequence has its max_tokens; a
    request that ends on EOS counts as stopped early, one at its limit does not."""
    from services.common.protocol import finish_profile
    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from tests.unit.engine.fake_runner import FakeModelRunner, reference_generate

    runner = FakeModelRunner(vocab_size=300, num_blocks=256, block_size=4, max_model_len=256)
    config = EngineConfig(model="fake", device="cpu", max_num_batched_tokens=512)
    engine = LLMEngine(config, model_runner=runner)
    engine.rates = StepRates(window_s=1e-9, weight=1.0)
    assert engine.load().finish_steps == () and engine.load().finish_steps_of == 0
    for index, max_tokens in enumerate((5, 9, 30, 12)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{index}", [1, 2, 3, 4 + index], params)
    engine.step()  # every prompt prefilled, one token each
    load = engine.load()
    assert load.finish_steps_of == 4
    assert list(load.finish_steps) == [4, 8, 11, 29]
    assert finish_profile.reached_by(load.finish_steps, 4, 8) == 2
    while engine.has_unfinished():
        engine.step()
    assert engine.rates.stop_hazard == 0.0  # all ended at max_tokens
    assert engine.load().finish_steps_of == 0
    prompt = [5, 6, 7]
    stop = reference_generate(prompt, 3, 300)[2]  # the third token stops it
    params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop])
    engine.add_request("stops", prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.rates.stop_hazard > 0.0
