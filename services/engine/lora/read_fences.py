"""Which step last read each LoRA slot, so a slot write waits for that step and no later one.

A slot write runs on a side stream and must not start before every launched step that reads the
slot's old adapter has ended. Waiting for everything issued on the step stream is always safe,
but it makes the write's host-to-device copy (80-odd MB for an 8B model's rank-16 adapter)
start exactly when the step in flight ends, when the next step's own small input copies start
too and may queue behind it on a copy engine. Mostly, though, the slot being written was last
read steps ago (its adapter's sequences ended or were paused for a turn), and the copy can
start at once, during the step in flight.

`begin_step(slots)` (the LoRA runtime, before each step is launched) records an event on the
step stream, which completes when every step before this one has ended, and notes the slots
this step reads. `fence(slot)` gives the event after which no launched step reads `slot`, or
None when the latest step reads it (then the write waits for everything issued). CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# Step boundaries kept: a slot last read longer ago waits for the oldest kept (already passed).
KEEP_STEPS = 8


class SlotReadFences:
    """The steps that read each slot, and an event at the start of each recent step."""

    def __init__(
        self, device: torch.device, record: Callable[[], torch.cuda.Event] | None = None
    ) -> None:
        self.device = device
        # An event recorded on the current stream now (replaceable where there is no GPU).
        self._record = record if record is not None else self._record_on_current_stream
        self._step = 0
        self._last_read: dict[int, int] = {}  # slot -> the last step that read it
        self._boundaries: dict[int, torch.cuda.Event] = {}  # step -> event as it began

    def begin_step(self, slots: Iterable[int]) -> None:
        """A step reading `slots` is about to be launched on the current stream."""
        self._step += 1
        self._boundaries[self._step] = self._record()
        self._boundaries.pop(self._step - KEEP_STEPS, None)
        for slot in slots:
            self._last_read[slot] = self._step

    def fence(self, slot: int) -> torch.cuda.Event | None:
        """An event after which no step launched so far reads `slot`; None where the latest
        step reads it or no step has begun (wait for everything issued)."""
        if not self._boundaries:
            return None
        last = self._last_read.get(slot, 0)
        if last >= self._step:
            return None
        oldest = min(self._boundaries)
        return self._boundaries[max(last + 1, oldest)]

    def _record_on_current_stream(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event
