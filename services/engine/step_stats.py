"""StepStats: what the engine's steps did over the last interval, as one log line.

The engine records every step (its time, prompt and generated tokens) and, once per
`--stats-log-interval-s` (10 s by default; 0: never), logs a line an operator can read at a
glance: steps per second and their mean time (a launched step's own time: on a GPU its CUDA
event span, so "busy" is the share of the interval the device spent on steps), prompt and
generated tokens per second, the
sequences running, paused for a LoRA slot and waiting, the KV cache in use and, with adapters,
the slot writes and pauses of the interval. No torch; the engine passes its counters in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueState:
    """The engine's sequences and KV cache at the end of an interval."""

    running: int
    paused: int
    waiting: int
    used_blocks: int
    total_blocks: int
    slot_writes: int = 0  # LoRA slot writes since the engine started (with adapters)
    pauses: int = 0  # sequences paused for a LoRA slot since the engine started
    resident_adapters: int = -1  # -1: adapters off


class StepStats:
    """Sums of the steps since the last line, and when the next line is due."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._start = clock()
        self._steps = 0
        self._busy_s = 0.0
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._last_writes = 0
        self._last_pauses = 0

    def record(self, step_time_s: float, prompt_tokens: int, generated_tokens: int) -> None:
        if prompt_tokens or generated_tokens:
            self._steps += 1
            self._busy_s += step_time_s
        self._prompt_tokens += prompt_tokens
        self._generated_tokens += generated_tokens

    def due(self) -> bool:
        """Whether a line is due: the interval passed and some step ran in it."""
        return self.interval_s > 0 and self._steps > 0 and self._elapsed() >= self.interval_s

    def line(self, state: QueueState) -> str:
        """The interval's line; starts the next interval."""
        elapsed = max(self._elapsed(), 1e-9)
        steps = self._steps
        mean_ms = 1e3 * self._busy_s / steps if steps else 0.0
        used = 100.0 * state.used_blocks / state.total_blocks if state.total_blocks else 0.0
        text = (
            f"engine stats over {elapsed:.1f}s: {steps / elapsed:.1f} steps/s "
            f"(mean {mean_ms:.1f} ms, busy {100.0 * self._busy_s / elapsed:.0f}%), "
            f"prompt {self._prompt_tokens / elapsed:,.0f} tok/s, "
            f"generated {self._generated_tokens / elapsed:,.0f} tok/s; "
            f"running {state.running}, paused {state.paused}, waiting {state.waiting}; "
            f"KV {used:.1f}% used"
        )
        if state.resident_adapters >= 0:
            writes = state.slot_writes - self._last_writes
            pauses = state.pauses - self._last_pauses
            text += (
                f"; LoRA {state.resident_adapters} resident, {writes / elapsed:.1f} slot "
                f"writes/s, {pauses / elapsed:.1f} pauses/s"
            )
        self._last_writes, self._last_pauses = state.slot_writes, state.pauses
        self._start = self._clock()
        self._steps = 0
        self._busy_s = 0.0
        self._prompt_tokens = self._generated_tokens = 0
        return text

    def _elapsed(self) -> float:
        return self._clock() - self._start
