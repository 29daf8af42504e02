"""The engine's measured service rates, reported with its load for time-based admission.

A router refuses a request that could not start within its queue-delay bound
(services/router/queue_delay.py); for that it needs how fast this engine actually works through
prompts and finishes requests on this GPU, model and mix, not a count. `StepRates` watches every
step: its wall time, how many prompt tokens it prefilled, how many tokens it generated and how
many requests it finished. It sums them over windows of busy time (`window_s`; idle time between
steps is not counted) and keeps an exponential average of each window's rates:

- prefill tokens/s over the busy time of steps that held prefill work (a mixed step counts whole:
  decodes slow the prefill down, and that is the rate a queued prompt sees);
- decode tokens/s and finished requests/s over all busy time.

Plain Python; each `record` is a few additions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Window:
    busy_s: float = 0.0
    prefill_busy_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    finished: int = 0


class StepRates:
    """Exponentially averaged prefill, decode and finish rates over busy windows."""

    def __init__(self, *, window_s: float = 0.5, weight: float = 0.3) -> None:
        if window_s <= 0 or not 0.0 < weight <= 1.0:
            raise ValueError("window_s must be > 0 and weight in (0, 1]")
        self.window_s = window_s
        self.weight = weight
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0
        self.finished_per_s = 0.0
        self._window = _Window()

    def record(
        self, elapsed_s: float, *, prefill_tokens: int, decode_tokens: int, finished: int
    ) -> None:
        """One step's wall time and work."""
        if elapsed_s <= 0.0 or (prefill_tokens == 0 and decode_tokens == 0 and finished == 0):
            return
        window = self._window
        window.busy_s += elapsed_s
        window.prefill_tokens += prefill_tokens
        if prefill_tokens:
            window.prefill_busy_s += elapsed_s
        window.decode_tokens += decode_tokens
        window.finished += finished
        if window.busy_s >= self.window_s:
            self._fold(window)
            self._window = _Window()

    def _fold(self, window: _Window) -> None:
        def blend(old: float, new: float) -> float:
            return new if old == 0.0 else old + self.weight * (new - old)

        if window.prefill_busy_s > 0.0:
            rate = window.prefill_tokens / window.prefill_busy_s
            self.prefill_tokens_per_s = blend(self.prefill_tokens_per_s, rate)
        self.decode_tokens_per_s = blend(
            self.decode_tokens_per_s, window.decode_tokens / window.busy_s
        )
        if window.finished or self.finished_per_s:
            self.finished_per_s = blend(self.finished_per_s, window.finished / window.busy_s)

    def reset(self) -> None:
        """Forget everything (after a warm-up, whose steps say nothing about serving)."""
        self.prefill_tokens_per_s = self.decode_tokens_per_s = self.finished_per_s = 0.0
        self._window = _Window()
