"""Calibration of the start-delay estimate by the start delays admitted requests really saw.

The estimate of queue_delay.py comes from the engines' reported rates; it misses whatever the
rates do not capture (a step's launch and read overheads, the variance of finishes, prefix-cache
hits, a rate measured on a different mix), by a factor that depends on the engine and the
workload. So the router checks it against what happens: for each admitted request whose
prediction was meaningful (rates measured, at least `min_predicted_s`) it keeps the predicted
delay, and when the request's first token comes back from its engine it takes the observed start
delay (arrival to first token, less the request's own prefill at the engines' reported rate, so
that the ratio compares like with like) over the prediction. The correction is a high quantile
(`quantile`, 0.9 by default) of that ratio over the last `window` requests, not a mean: the
bound is about the admitted requests' slowest starts, and a mean lets the tail through.

- Bounded: each ratio is clamped to [`min_factor`, `max_factor`], a stalled request moves the
  quantile by one rank at most, and no correction is given before `min_samples`.
- Censored starts count: a tracked request still waiting past its prediction is known to have a
  ratio of at least its wait so far over the prediction, and counts with that lower bound. At the
  onset of overload the slow starts are the ones not seen yet; without them the quantile would
  learn only from the quick ones and lag behind by a queue's worth of admissions.
- Decays: with no new evidence the correction returns to 1 with time constant `decay_s`, and
  samples older than `max_age_s` are forgotten, so an idle period or a burst long past cannot
  keep the router refusing (a refused request gives no evidence); nor can it refuse everything:
  a request with no queue ahead is estimated at 0 whatever the factor.

Plain Python (no gRPC, no torch); the clock is injected, so it is tested in milliseconds.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable

# The quantile is recomputed at most this often: a recompute sorts the window and scans every
# followed request (tens of microseconds with hundreds queued), too much for each admission.
REFRESH_INTERVAL_S = 0.02


class DelayCalibration:
    """The factor by which observed start delays exceed the estimate; see the module docstring."""

    def __init__(
        self,
        *,
        min_predicted_s: float,
        quantile: float = 0.9,
        window: int = 256,
        min_samples: int = 16,
        min_factor: float = 0.5,
        max_factor: float = 4.0,
        decay_s: float = 10.0,
        max_age_s: float = 60.0,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError("quantile must be in (0, 1]")
        if not 0.0 < min_factor <= 1.0 <= max_factor:
            raise ValueError("need 0 < min_factor <= 1 <= max_factor")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("need 1 <= min_samples <= window")
        if min_predicted_s <= 0.0 or decay_s <= 0.0 or max_age_s <= 0.0:
            raise ValueError("min_predicted_s, decay_s and max_age_s must be > 0")
        if refresh_interval_s < 0.0:
            raise ValueError("refresh_interval_s must be >= 0")
        self.min_predicted_s = min_predicted_s
        self.quantile = quantile
        self.min_samples = min_samples
        self.min_factor = min_factor
        self.max_factor = max_factor
        self.decay_s = decay_s
        self.max_age_s = max_age_s
        self.refresh_interval_s = refresh_interval_s
        self._clock = clock
        self._ratios: deque[tuple[float, float]] = deque(maxlen=window)  # (observed at, ratio)
        # key -> (arrival + own prefill: when its wait ends if it starts at once, predicted s)
        self._pending: dict[Hashable, tuple[float, float]] = {}
        self.observations = 0  # starts taken into the window, ever
        # The quantile as of the last refresh and when its evidence was last new: read (never
        # written) by `factor`, so a metrics scrape on another thread may call it.
        self._quantile = 1.0
        self._evidence_at = -math.inf
        self._refreshed_at = -math.inf

    # ---- evidence ----------------------------------------------------------------------------
    def track(
        self, key: Hashable, predicted_s: float | None, arrival: float, own_prefill_s: float
    ) -> bool:
        """Follow an admitted request predicted to start its prefill `predicted_s` after its
        `arrival` (time.monotonic() seconds); its own prefill is expected to take
        `own_prefill_s`. Only meaningful predictions are followed: None (no rates measured) and
        short ones (the ratio would be noise) are not. True if followed."""
        if predicted_s is None or predicted_s < self.min_predicted_s:
            return False
        # The first token marks the end of the request's own prefill: its start is that long
        # before, so the wait is measured from arrival + own prefill.
        self._pending[key] = (arrival + max(own_prefill_s, 0.0), predicted_s)
        return True

    def started(self, key: Hashable, first_token_at: float) -> None:
        """A followed request's first token came at `first_token_at`: one sample of the ratio."""
        entry = self._pending.pop(key, None)
        if entry is None:
            return
        since, predicted_s = entry
        now = self._clock()
        self._ratios.append((now, self._clamp(max(first_token_at - since, 0.0) / predicted_s)))
        self.observations += 1
        self._evidence_at = now

    def forget(self, key: Hashable) -> None:
        """The request ended without a start (cancelled, failed): it says nothing more."""
        self._pending.pop(key, None)

    # ---- the correction ----------------------------------------------------------------------
    def refresh(self) -> float:
        """Recompute the quantile from the window and the overdue pending requests (at most every
        `refresh_interval_s`); the factor now."""
        now = self._clock()
        if now - self._refreshed_at >= self.refresh_interval_s:
            self._recompute(now)
        return self.factor(now)

    def factor(self, now: float | None = None) -> float:
        """The multiplier for the estimate: the last quantile, decayed toward 1 since the last
        new evidence. Reads only, so safe from another thread."""
        if now is None:
            now = self._clock()
        quantile, evidence_at = self._quantile, self._evidence_at
        idle_s = max(now - evidence_at, 0.0)
        return 1.0 + (quantile - 1.0) * math.exp(-idle_s / self.decay_s)

    def _recompute(self, now: float) -> None:
        self._refreshed_at = now
        oldest = now - self.max_age_s
        ratios = self._ratios
        while ratios and ratios[0][0] < oldest:
            ratios.popleft()
        samples = [ratio for _, ratio in ratios]
        stale = []
        overdue = False
        for key, (since, predicted_s) in self._pending.items():
            if since < oldest:
                stale.append(key)  # its first token never came: an engine lost, not a rate
                continue
            lower_bound = (now - since) / predicted_s
            if lower_bound > 1.0:  # late already: its ratio is at least this
                samples.append(self._clamp(lower_bound))
                overdue = True
        for key in stale:
            del self._pending[key]
        if overdue:
            self._evidence_at = now
        if len(samples) < self.min_samples:
            self._quantile = 1.0
            return
        samples.sort()
        rank = max(math.ceil(self.quantile * len(samples)) - 1, 0)
        self._quantile = samples[rank]

    def _clamp(self, ratio: float) -> float:
        return min(max(ratio, self.min_factor), self.max_factor)

    @property
    def pending(self) -> int:
        """Followed requests that have not started yet."""
        return len(self._pending)
