"""LoRABatch: segments of adapter rows (base rows in none), and the kernels' grouped layout."""

from __future__ import annotations

import pytest

from services.engine.forward_batch import ScheduledBatch, ScheduledSequence
from services.engine.lora.batch import LoRABatch


def test_runs_merge_and_base_rows_are_in_no_segment() -> None:
    batch = LoRABatch.from_row_slots([-1, 2, 2, 0, -1, -1, 0, 0, 2])
    assert batch.num_rows == 9
    assert list(zip(batch.starts, batch.lengths, batch.slots, strict=True)) == [
        (1, 2, 2),
        (3, 1, 0),
        (6, 2, 0),
        (8, 1, 2),
    ]
    assert batch.distinct_slots == (0, 2) and not batch.is_empty
    assert LoRABatch.from_row_slots([-1, -1]).is_empty


def test_from_scheduled_sequences() -> None:
    def seq(seq_id: int, tokens: int, slot: int) -> ScheduledSequence:
        return ScheduledSequence(seq_id, [1] * tokens, 0, [0], True, adapter_slot=slot)

    scheduled = ScheduledBatch([seq(0, 1, 1), seq(1, 1, 1), seq(2, 1, -1), seq(3, 5, 0)])
    batch = LoRABatch.from_scheduled(scheduled)
    assert (batch.num_rows, batch.starts, batch.lengths, batch.slots) == (8, (0, 3), (2, 5), (1, 0))


def test_bad_runs_are_refused() -> None:
    with pytest.raises(ValueError):
        LoRABatch.from_runs([(1, -2)])
    with pytest.raises(ValueError):
        LoRABatch.from_runs([(-1, 0)])


def test_kernel_layout_groups_rows_by_slot_and_pads() -> None:
    batch = LoRABatch.from_row_slots([3, -1, 1, 3, 3, -1, 1])
    layout = batch.kernel_layout(num_rows=10, max_groups=4)
    assert layout.group_slots == [1, 3, 0, 0]
    assert layout.group_lengths == [2, 3, 0, 0]
    assert layout.group_starts == [0, 2, 5, 5]
    assert layout.row_indices == [2, 6, 0, 3, 4, 0, 0, 0, 0, 0]
    assert layout.num_lora_rows == 5
    with pytest.raises(ValueError, match="at most 1 slots"):
        batch.kernel_layout(num_rows=10, max_groups=1)
    with pytest.raises(ValueError, match="layout of 3 rows"):
        batch.kernel_layout(num_rows=3, max_groups=4)
