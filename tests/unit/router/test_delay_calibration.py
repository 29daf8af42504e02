"""The queue-delay calibration: a bounded, decaying high quantile of observed over predicted."""

from __future__ import annotations

import math
import random

import pytest

from services.router.delay_calibration import DelayCalibration
from tests.fake_clock import FakeClock


def calibration(clock: FakeClock, **settings) -> DelayCalibration:
    values = dict(min_predicted_s=0.2, quantile=0.9, window=100, min_samples=10, decay_s=10.0)
    values.update(refresh_interval_s=0.0)  # every refresh recomputes
    values.update(settings)
    return DelayCalibration(clock=clock, **values)


def observe(cal: DelayCalibration, clock: FakeClock, key: object, predicted_s, ratio) -> None:
    """A request predicted to wait `predicted_s` whose first token comes `ratio` times later."""
    arrival = clock.now
    cal.track(key, predicted_s, arrival, 0.0)
    cal.started(key, arrival + ratio * predicted_s)


def test_converges_to_the_ratio_of_a_steady_sequence():
    clock = FakeClock(100.0)
    cal = calibration(clock)
    for i in range(200):
        clock.now += 0.05
        observe(cal, clock, i, 0.5 + (i % 5) * 0.1, 1.6)
    assert cal.refresh() == pytest.approx(1.6)
    assert cal.observations == 200


def test_follows_a_high_quantile_not_the_mean():
    clock = FakeClock()
    cal = calibration(clock, window=1000)
    rng = random.Random(7)
    ratios = [rng.uniform(1.0, 2.0) for _ in range(1000)]
    for i, ratio in enumerate(ratios):
        observe(cal, clock, i, 1.0, ratio)
    factor = cal.refresh()
    assert factor == pytest.approx(sorted(ratios)[899])
    assert factor > sum(ratios) / len(ratios) + 0.3  # the mean (~1.5) would let the tail in


def test_the_window_forgets_an_older_regime():
    clock = FakeClock()
    cal = calibration(clock)
    for i in range(100):
        observe(cal, clock, i, 1.0, 3.0)
    assert cal.refresh() == pytest.approx(3.0)
    for i in range(100, 200):
        observe(cal, clock, i, 1.0, 1.2)
    assert cal.refresh() == pytest.approx(1.2)


def test_no_correction_before_enough_samples():
    clock = FakeClock()
    cal = calibration(clock)
    for i in range(9):
        observe(cal, clock, i, 1.0, 2.5)
    assert cal.refresh() == 1.0
    observe(cal, clock, 9, 1.0, 2.5)
    assert cal.refresh() == pytest.approx(2.5)


def test_an_outlier_moves_the_quantile_by_one_rank_and_ratios_are_clamped():
    clock = FakeClock()
    cal = calibration(clock, max_factor=4.0, min_factor=0.5)
    for i in range(99):
        observe(cal, clock, i, 1.0, 1.0 + i / 1000)  # 1.000 .. 1.098
    before = cal.refresh()
    observe(cal, clock, "stalled", 1.0, 500.0)
    assert before <= cal.refresh() <= before + 0.001  # one rank at most, not 500
    for i in range(100):
        observe(cal, clock, ("slow", i), 1.0, 50.0)
    assert cal.refresh() == 4.0  # the upper bound
    for i in range(100):
        observe(cal, clock, ("fast", i), 1.0, 0.01)
    assert cal.refresh() == 0.5  # the lower bound


def test_decays_toward_one_without_observations():
    clock = FakeClock()
    cal = calibration(clock, decay_s=10.0, max_age_s=60.0)
    for i in range(50):
        observe(cal, clock, i, 1.0, 3.0)
    assert cal.refresh() == pytest.approx(3.0)
    clock.now += 10.0
    assert cal.refresh() == pytest.approx(1.0 + 2.0 / math.e)
    assert cal.factor() == pytest.approx(1.0 + 2.0 / math.e)  # what the gauge reads
    clock.now += 50.0
    assert cal.refresh() < 1.01
    # Long past the window's age: a few new starts are not enough to bring the old ones back.
    clock.now += 10.0
    for i in range(3):
        observe(cal, clock, ("new", i), 1.0, 1.1)
    assert cal.refresh() == 1.0


def test_only_meaningful_predictions_are_followed():
    clock = FakeClock()
    cal = calibration(clock, min_samples=1)
    assert not cal.track("no rates", None, 0.0, 0.0)
    assert not cal.track("short", 0.1, 0.0, 0.0)  # under min_predicted_s
    assert cal.track("long", 1.0, 0.0, 0.0)
    cal.started("no rates", 5.0)
    cal.started("short", 5.0)
    assert cal.observations == 0 and cal.pending == 1
    cal.started("long", 2.0)
    cal.started("long", 9.0)  # a second report of the same start is ignored
    assert cal.observations == 1 and cal.refresh() == pytest.approx(2.0)


def test_the_own_prefill_is_not_counted_as_waiting():
    clock = FakeClock()
    cal = calibration(clock, min_samples=1)
    cal.track("r", 1.0, 10.0, 0.25)
    cal.started("r", 10.0 + 1.0 + 0.25)  # waited as predicted, then prefilled for 0.25 s
    assert cal.refresh() == pytest.approx(1.0)


def test_requests_still_waiting_past_their_prediction_count_as_late():
    clock = FakeClock()
    cal = calibration(clock)
    for i in range(20):
        cal.track(i, 0.5, clock.now, 0.0)
    clock.now += 0.4
    assert cal.refresh() == 1.0  # none late yet: nothing known
    clock.now += 0.8  # 1.2 s waited, 2.4x the prediction, and still no first token
    assert cal.refresh() == pytest.approx(2.4)
    for i in range(20):
        cal.forget(i)  # cancelled: no longer evidence
    clock.now += 0.1
    assert cal.pending == 0
    assert cal.refresh() == 1.0


def test_a_request_that_never_starts_is_dropped_after_the_age_limit():
    clock = FakeClock()
    cal = calibration(clock, min_samples=1, max_age_s=60.0)
    cal.track("lost", 1.0, clock.now, 0.0)
    clock.now += 30.0
    assert cal.refresh() == 4.0  # late by 30x: clamped
    clock.now += 31.0
    cal.refresh()
    assert cal.pending == 0
    clock.now += 100.0
    assert cal.refresh() == pytest.approx(1.0)


def test_the_quantile_is_recomputed_at_most_every_interval():
    clock = FakeClock()
    cal = calibration(clock, refresh_interval_s=0.02)
    for i in range(20):
        observe(cal, clock, i, 1.0, 2.0)
    assert cal.refresh() == pytest.approx(2.0)
    for i in range(20, 60):
        observe(cal, clock, i, 1.0, 3.0)
    assert cal.refresh() == pytest.approx(2.0)  # the same instant: the last quantile
    clock.now += 0.02
    assert cal.refresh() == pytest.approx(3.0, rel=0.01)


@pytest.mark.parametrize(
    "settings",
    [
        {"quantile": 0.0},
        {"quantile": 1.5},
        {"min_factor": 1.5},
        {"max_factor": 0.9},
        {"min_samples": 0},
        {"min_samples": 101},
        {"decay_s": 0.0},
        {"min_predicted_s": 0.0},
        {"refresh_interval_s": -1.0},
    ],
)
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError):
        calibration(FakeClock(), **settings)
