"""Arrival schedules: exact constant spacing, Poisson by KS test, gamma dispersion."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from loadtest.arrivals import arrival_times, inter_arrival_times
from services.common.errors import InvalidArgumentError


def test_constant_arrivals_are_exactly_spaced() -> None:
    times = arrival_times("constant", 8.0, num_requests=50)
    assert times[0] == 0.0
    assert len(times) == 50
    assert np.allclose(np.diff(times), 0.125, rtol=0, atol=1e-12)


def test_duration_keeps_every_arrival_before_it() -> None:
    times = arrival_times("constant", 4.0, duration_s=3.0)
    assert times == pytest.approx([i * 0.25 for i in range(12)])
    poisson = arrival_times("exponential", 50.0, duration_s=10.0, seed=3)
    assert max(poisson) < 10.0
    assert 400 < len(poisson) < 600  # 500 expected, sd ~22


def test_exponential_inter_arrivals_pass_a_ks_test() -> None:
    rate = 5.0
    gaps = np.diff(arrival_times("exponential", rate, num_requests=4001, seed=11))
    result = stats.kstest(gaps, "expon", args=(0, 1 / rate))
    assert result.pvalue > 0.01
    # ...and the test has power: the same gaps are not uniform with that mean.
    assert stats.kstest(gaps, "uniform", args=(0, 2 / rate)).pvalue < 1e-6


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(burstiness: float) -> None:
    rate = 10.0
    gaps = inter_arrival_times("gamma", rate, 40_000, burstiness=burstiness, seed=5)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_smaller_burstiness_is_burstier() -> None:
    cvs = [
        np.std(g) / np.mean(g)
        for g in (
            inter_arrival_times("gamma", 1.0, 20_000, burstiness=b, seed=1) for b in (0.2, 1, 5)
        )
    ]
    assert cvs[0] > cvs[1] > cvs[2]


def test_same_seed_same_schedule_other_seed_differs() -> None:
    a = arrival_times("gamma", 3.0, num_requests=20, burstiness=0.5, seed=9)
    assert a == arrival_times("gamma", 3.0, num_requests=20, burstiness=0.5, seed=9)
    assert a != arrival_times("gamma", 3.0, num_requests=20, burstiness=0.5, seed=10)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "uniform", "rate": 1.0, "num_requests": 3},
        {"kind": "constant", "rate": 0.0, "num_requests": 3},
        {"kind": "constant", "rate": float("inf"), "num_requests": 3},
        {"kind": "gamma", "rate": 1.0, "num_requests": 3, "burstiness": 0.0},
        {"kind": "constant", "rate": 1.0},
        {"kind": "constant", "rate": 1.0, "num_requests": 3, "duration_s": 2.0},
        {"kind": "constant", "rate": 1.0, "num_requests": 0},
        {"kind": "constant", "rate": 1.0, "duration_s": -1.0},
    ],
)
def test_bad_schedules_are_invalid_arguments(kwargs: dict) -> None:
    kind = kwargs.pop("kind")
    rate = kwargs.pop("rate")
    with pytest.raises(InvalidArgumentError):
        arrival_times(kind, rate, **kwargs)
