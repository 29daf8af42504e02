"""The sampled profile of when running sequences reach their token limits."""

from __future__ import annotations

import random

import pytest

from services.common.protocol import finish_profile


def test_ranks_take_the_first_the_last_and_even_steps_between():
    ranks = finish_profile.profile_ranks(256, 17)
    assert len(ranks) == 17 and ranks[0] == 0 and ranks[-1] == 255
    assert {b - a for a, b in zip(ranks, ranks[1:], strict=False)} <= {15, 16}
    assert finish_profile.profile_ranks(5, 5) == [0, 1, 2, 3, 4]
    assert finish_profile.profile_ranks(1, 1) == [0]
    assert finish_profile.profile_ranks(0, 17) == []


def test_sample_sorts_clamps_and_keeps_at_most_the_points():
    values, count = finish_profile.sample([7, -2, 3, 0])
    assert (values, count) == ((0, 0, 3, 7), 4)
    values, count = finish_profile.sample(range(1000, 0, -1))
    assert count == 1000 and len(values) == finish_profile.POINTS
    assert values[0] == 1 and values[-1] == 1000 and list(values) == sorted(values)
    assert finish_profile.sample([]) == ((), 0)


def test_reached_by_reads_the_rank_off_the_profile():
    rng = random.Random(7)
    steps = [rng.randrange(0, 400) for _ in range(300)]
    values, count = finish_profile.sample(steps)
    exact = sorted(steps)
    for probe in (0, 10, 57, 123.5, 200, 399, 500):
        truth = sum(value <= probe for value in exact)
        assert finish_profile.reached_by(values, count, probe) == pytest.approx(truth, abs=12)
    assert finish_profile.reached_by(values, count, -1) == 0.0
    assert finish_profile.reached_by(values, count, exact[-1]) == count


def test_a_wave_reads_as_a_wave():
    """256 sequences with 100-120 steps left: none free before 100 steps, all by 120."""
    values, count = finish_profile.sample([100 + index % 21 for index in range(256)])
    assert finish_profile.reached_by(values, count, 99.9) == 0.0
    assert 100 < finish_profile.reached_by(values, count, 110) < 160
    assert finish_profile.reached_by(values, count, 120) == 256
