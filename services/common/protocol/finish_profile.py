"""When an engine's running sequences reach their token limits: a small profile for admission.

A router that refuses requests by their expected queueing delay (services/router/queue_delay.py)
needs to know when batch slots free up. A rate of finishes says so only where finishes are
spread out; requests with one output length that started together finish together, and in the
gap between two such waves a rate from the last wave promises slots that free seconds later.
Each running sequence has a hard bound: it ends at the latest after `max_tokens` minus the
tokens it has (prompt + max_tokens never passes the model's length). The engine reports those
bounds, in steps, sorted and sampled at evenly spaced ranks (at most `POINTS` values: the
first, the last and ranks between), with the number of sequences they describe; the router
reads the count that have reached their bound by a given step from it (`reached_by`), adding
the sequences that end earlier on a stop token or abort at the engine's measured rate.

Shared by the engine (writes) and the router (reads), so both use one rank convention.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

POINTS = 17  # values a profile carries at most


def profile_ranks(count: int, points: int) -> list[int]:
    """The 0-based ranks, among `count` sorted values, that a profile of `points` values
    samples: the first, the last and evenly spaced ranks between."""
    if points <= 0 or count <= 0:
        return []
    if points == 1:
        return [count - 1]
    return [round(index * (count - 1) / (points - 1)) for index in range(points)]


def sample(steps: Iterable[int], points: int = POINTS) -> tuple[tuple[int, ...], int]:
    """Each sequence's steps to its bound (clamped at 0) as a profile: (values, count)."""
    ordered = sorted(steps)
    count = len(ordered)
    ranks = profile_ranks(count, min(count, points))
    return tuple(max(int(ordered[rank]), 0) for rank in ranks), count


def reached_by(
    values: Sequence[int], count: int, steps: float, ranks: Sequence[int] | None = None
) -> float:
    """How many of the `count` sequences described by `values` have reached their bound within
    `steps` steps: the rank read off the profile, linear between its samples (`ranks`: the
    profile's, profile_ranks(count, len(values)), where the caller keeps them)."""
    if count <= 0 or not values or steps < values[0]:
        return 0.0
    if steps >= values[-1]:
        return float(count)
    if ranks is None:
        ranks = profile_ranks(count, len(values))
    index = bisect.bisect_right(values, steps) - 1  # values[index] <= steps < values[index + 1]
    low, high = values[index], values[index + 1]
    rank_low, rank_high = ranks[index] + 1, ranks[index + 1] + 1  # 1-based: sequences reached
    return rank_low + (steps - low) / (high - low) * (rank_high - rank_low)
