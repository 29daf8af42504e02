"""StepStats: one log line per interval with the steps' rates and the engine's queues."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.engine.config import EngineConfig
from services.engine.step_stats import QueueState, StepStats
from tests.fake_clock import FakeClock


def test_a_line_is_due_once_an_interval_with_steps_has_passed() -> None:
    clock = FakeClock(100.0)
    stats = StepStats(10.0, clock)
    clock.now += 30.0
    assert not stats.due()  # idle: nothing to say
    for _ in range(40):
        stats.record(0.02, prompt_tokens=100, generated_tokens=50)
    stats.record(0.0, 0, 0)  # an empty turn is no step
    assert stats.due()
    state = QueueState(running=50, paused=7, waiting=3, used_blocks=25, total_blocks=100)
    line = stats.line(state)
    assert "over 30.0s: 1.3 steps/s (mean 20.0 ms, busy 3%)" in line
    assert "prompt 133 tok/s, generated 67 tok/s" in line
    assert "running 50, paused 7, waiting 3; KV 25.0% used" in line and "LoRA" not in line
    assert not stats.due()  # the next interval starts empty


def test_lora_counters_are_per_interval() -> None:
    clock = FakeClock(100.0)
    stats = StepStats(5.0, clock)
    base = dict(running=1, paused=0, waiting=0, used_blocks=0, total_blocks=10)
    stats.record(0.01, 0, 1)
    clock.now += 5.0
    first = stats.line(QueueState(**base, slot_writes=20, pauses=10, resident_adapters=4))
    assert "LoRA 4 resident, 4.0 slot writes/s, 2.0 pauses/s" in first
    stats.record(0.01, 0, 1)
    clock.now += 10.0
    second = stats.line(QueueState(**base, slot_writes=30, pauses=10, resident_adapters=4))
    assert "1.0 slot writes/s, 0.0 pauses/s" in second


def test_the_share_planned_ahead_and_the_plain_steps_reasons_are_per_interval() -> None:
    clock = FakeClock(100.0)
    stats = StepStats(5.0, clock)
    base = dict(running=1, paused=0, waiting=0, used_blocks=0, total_blocks=10)
    for index in range(20):
        stats.record(0.01, 0, 1, planned_ahead=index >= 2)
    clock.now += 5.0
    reasons = {"idle": 1, "KV blocks short": 1}
    first = stats.line(QueueState(**base, plain_step_reasons=reasons, host_wait_s=2.0))
    assert first.endswith(
        "; 90% planned ahead (plain: 1 idle, 1 KV blocks short); host waiting for the device 40%"
    )
    for _ in range(10):
        stats.record(0.01, 0, 1, planned_ahead=True)
    clock.now += 5.0
    reasons = {"idle": 1, "KV blocks short": 1, "empty plan": 0}
    second = QueueState(**base, plain_step_reasons=reasons, host_wait_s=2.25)  # 0.25 s of 5
    assert stats.line(second).endswith("; 100% planned ahead; host waiting for the device 5%")
    stats.record(0.01, 0, 1)
    clock.now += 5.0
    assert "planned ahead" not in stats.line(QueueState(**base))  # a runner that cannot


def test_zero_turns_the_lines_off_and_bad_values_are_refused() -> None:
    clock = FakeClock(100.0)
    stats = StepStats(0.0, clock)
    stats.record(0.01, 1, 1)
    clock.now += 1e6
    assert not stats.due()
    for bad in (-1.0, float("nan"), "10", True):
        with pytest.raises(InvalidArgumentError, match="stats_log_interval_s"):
            EngineConfig(model="fake", device="cpu", stats_log_interval_s=bad)
