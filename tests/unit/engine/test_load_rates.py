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
