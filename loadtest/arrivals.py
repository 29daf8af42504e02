"""Arrival schedules computed up front, as offsets in seconds from the start of a run.

The runner honours these absolute times open-loop: a request is sent at its time whether or
not earlier ones have answered, so a slow server shows up as latency, never as a slower
schedule. Kinds:
- ``constant``: exactly 1/rate apart (first request at 0).
- ``exponential``: Poisson arrivals, exponential inter-arrival times with mean 1/rate.
- ``gamma``: gamma inter-arrival times with shape = burstiness B and mean 1/rate, so the
  coefficient of variation is 1/sqrt(B): B = 1 is Poisson, B < 1 burstier, B > 1 smoother.
Either a count (``num_requests``) or a length (``duration_s``: every arrival before it) ends it.
"""

from __future__ import annotations

import numpy as np

from services.common.errors import InvalidArgumentError

ARRIVAL_KINDS = ("constant", "exponential", "gamma")


def inter_arrival_times(
    kind: str, rate: float, count: int, *, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """`count` gaps in seconds between consecutive requests."""
    _check(kind, rate, burstiness)
    if count < 0:
        raise InvalidArgumentError(f"count must be >= 0, got {count}")
    rng = np.random.default_rng(seed)
    mean = 1.0 / rate
    if kind == "constant":
        return np.full(count, mean)
    if kind == "exponential":
        return rng.exponential(mean, size=count)
    return rng.gamma(shape=burstiness, scale=mean / burstiness, size=count)


def arrival_times(
    kind: str,
    rate: float,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Send times (seconds from the start, non-decreasing, first one 0.0)."""
    if (num_requests is None) == (duration_s is None):
        raise InvalidArgumentError("give exactly one of num_requests and duration_s")
    _check(kind, rate, burstiness)
    if num_requests is not None:
        if num_requests < 1:
            raise InvalidArgumentError(f"num_requests must be >= 1, got {num_requests}")
        gaps = inter_arrival_times(kind, rate, num_requests - 1, burstiness=burstiness, seed=seed)
        return [0.0, *np.cumsum(gaps).tolist()]
    if duration_s is None or duration_s <= 0:
        raise InvalidArgumentError(f"duration_s must be > 0 seconds, got {duration_s}")
    times = [0.0]
    # Draw in chunks from one generator until the schedule passes duration_s.
    rng_seed = seed
    while times[-1] < duration_s:
        expected = int((duration_s - times[-1]) * rate * 1.2) + 16
        gaps = inter_arrival_times(kind, rate, expected, burstiness=burstiness, seed=rng_seed)
        rng_seed += 1_000_003
        times.extend((times[-1] + np.cumsum(gaps)).tolist())
    return [t for t in times if t < duration_s]


def _check(kind: str, rate: float, burstiness: float) -> None:
    if kind not in ARRIVAL_KINDS:
        raise InvalidArgumentError(f"arrival must be one of {ARRIVAL_KINDS}, got {kind!r}")
    if not rate > 0 or rate == float("inf"):
        raise InvalidArgumentError(f"rate must be a finite number > 0 requests/s, got {rate}")
    if not burstiness > 0:
        raise InvalidArgumentError(f"burstiness must be > 0, got {burstiness}")
