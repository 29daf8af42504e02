"""SlotReadFences: a slot write waits for the last launched step that reads the slot, no later.

The step-boundary events are stand-ins here (plain objects in order); on a GPU they are CUDA
events on the step stream (tests/gpu/test_lora_kernels.py runs a write beside a long step).
"""

from __future__ import annotations

import itertools

import torch

from services.engine.lora.read_fences import KEEP_STEPS, SlotReadFences


def fences() -> SlotReadFences:
    counter = itertools.count(1)
    return SlotReadFences(torch.device("cpu"), record=lambda: f"event {next(counter)}")


def test_no_step_yet_means_wait_for_everything() -> None:
    assert fences().fence(0) is None


def test_a_slot_read_by_the_latest_step_waits_for_everything() -> None:
    tracked = fences()
    tracked.begin_step([3])
    assert tracked.fence(3) is None
    tracked.begin_step([1, 2])
    assert tracked.fence(2) is None and tracked.fence(1) is None


def test_a_slot_read_earlier_waits_for_the_boundary_after_its_last_read() -> None:
    tracked = fences()
    tracked.begin_step([3])  # step 1 (event 1: steps before it ended)
    tracked.begin_step([1])  # step 2 (event 2: step 1 ended)
    tracked.begin_step([1])  # step 3
    assert tracked.fence(3) == "event 2"  # step 1, its last reader, has ended at event 2
    assert tracked.fence(5) == "event 1"  # never read: the oldest boundary


def test_a_slot_read_long_ago_waits_for_the_oldest_boundary_kept() -> None:
    tracked = fences()
    tracked.begin_step([7])
    for _ in range(3 * KEEP_STEPS):
        tracked.begin_step([0])
    last = 1 + 3 * KEEP_STEPS
    assert tracked.fence(7) == f"event {last - KEEP_STEPS + 1}"
    assert tracked.fence(0) is None
