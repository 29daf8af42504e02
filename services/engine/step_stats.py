"""StepStats: what the engine's steps did over the last interval, as one log line.

The engine records every step (its time, prompt and generated tokens) and, once per
`--stats-log-interval-s` (10 s by default; 0: never), logs a line an operator can read at a
glance: steps per second and their mean time (a launched step's own time: on a GPU its CUDA
event span, so "busy" is the share of the interval the device spent on steps), prompt and
generated tokens per second, the
sequences running, paused for a LoRA slot and waiting, the KV cache in use, with adapters
the slot writes and pauses of the interval and, where the runner launches steps without
waiting, the share of steps planned before the step ahead of them was read (the others waited
for it: the device idles meanwhile) with the commonest reasons why not, and the share of the
interval the host spent blocked reading launched steps (near 0% with the device below 100%
busy: the host, not the device, sets the pace). No torch; the engine passes its counters in.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
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
    swapped: int = -1  # paused sequences with their KV in host memory (-1: no swap space)
    swap_outs: int = 0  # paused sequences moved to host memory since the engine started
    resident_adapters: int = -1  # -1: adapters off
    # Steps not planned ahead since the engine started, by reason (None: it never plans ahead).
    plain_step_reasons: Mapping[str, int] | None = None
    # Seconds the host has spent blocked reading launched steps' ids since the engine started.
    host_wait_s: float = 0.0


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
        self._last_swap_outs = 0
        self._last_wait_s = 0.0
        self._ahead = 0
        self._last_reasons: Counter[str] = Counter()

    def record(
        self,
        step_time_s: float,
        prompt_tokens: int,
        generated_tokens: int,
        *,
        planned_ahead: bool = False,
    ) -> None:
        if prompt_tokens or generated_tokens:
            self._steps += 1
            self._busy_s += step_time_s
            self._ahead += planned_ahead
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
            if state.swapped >= 0:
                swap_outs = state.swap_outs - self._last_swap_outs
                text += (
                    f", {state.swapped} paused in host memory "
                    f"({swap_outs / elapsed:.1f} swapped out/s)"
                )
        if state.plain_step_reasons is not None:
            text += self._ahead_text(state.plain_step_reasons)
            waited = state.host_wait_s - self._last_wait_s
            text += f"; host waiting for the device {100.0 * waited / elapsed:.0f}%"
        self._last_writes, self._last_pauses = state.slot_writes, state.pauses
        self._last_swap_outs = state.swap_outs
        self._last_wait_s = state.host_wait_s
        self._start = self._clock()
        self._steps = self._ahead = 0
        self._busy_s = 0.0
        self._prompt_tokens = self._generated_tokens = 0
        return text

    def _ahead_text(self, reasons: Mapping[str, int]) -> str:
        """The interval's share of steps planned ahead and its plain steps' three commonest
        reasons, e.g. `; 97% planned ahead (plain: 5 idle, 2 KV blocks short)`."""
        share = 100.0 * self._ahead / self._steps if self._steps else 0.0
        totals = Counter(reasons)
        interval = totals - self._last_reasons
        self._last_reasons = totals
        text = f"; {share:.0f}% planned ahead"
        if interval:
            common = ", ".join(f"{count} {reason}" for reason, count in interval.most_common(3))
            text += f" (plain: {common})"
        return text

    def _elapsed(self) -> float:
        return self._clock() - self._start
