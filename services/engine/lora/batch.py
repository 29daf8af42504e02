"""Which rows of a flat token batch use which adapter slot: segments and slot groups.

Plain Python (no tensors). A step's tokens are laid out sequence after sequence; each sequence
uses one slot (-1: the base model). `LoRABatch` keeps the maximal contiguous runs of rows with
the same non-base slot as segments: the CPU path computes each segment's shrink and expand on a
view of its rows, and base rows are in no segment, so they pay nothing. `kernel_layout` regroups
the same rows by slot for the GPU kernels (rows of one slot gathered by index, one group per
distinct slot), padded to fixed sizes so its arrays can live in CUDA-graph input buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.engine.forward_batch import ScheduledBatch

BASE_SLOT = -1


@dataclass(frozen=True)
class LoRABatch:
    """Segments (start row, row count, slot) of the rows that use an adapter, in row order."""

    num_rows: int
    starts: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        """No row uses an adapter: the model runs as the base model."""
        return not self.slots

    @property
    def distinct_slots(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.slots)))

    @classmethod
    def from_row_slots(cls, row_slots: Sequence[int]) -> LoRABatch:
        """From one slot per row (BASE_SLOT for base rows)."""
        return cls.from_runs((1, slot) for slot in row_slots)

    @classmethod
    def from_scheduled(cls, batch: ScheduledBatch) -> LoRABatch:
        """From a step's sequences: each computes len(token_ids) rows with its adapter_slot."""
        return cls.from_runs((len(seq.token_ids), seq.adapter_slot) for seq in batch.sequences)

    @classmethod
    def from_runs(cls, runs: Iterable[tuple[int, int]]) -> LoRABatch:
        """From (row count, slot) runs in row order; equal neighbours merge into one segment."""
        starts: list[int] = []
        lengths: list[int] = []
        slots: list[int] = []
        row = 0
        for count, slot in runs:
            if count < 0 or slot < BASE_SLOT:
                raise ValueError(f"bad run ({count} rows, slot {slot})")
            if count and slot != BASE_SLOT:
                if slots and slots[-1] == slot and starts[-1] + lengths[-1] == row:
                    lengths[-1] += count
                else:
                    starts.append(row)
                    lengths.append(count)
                    slots.append(slot)
            row += count
        return cls(row, tuple(starts), tuple(lengths), tuple(slots))

    def padded_groups(self) -> tuple[list[int], list[int], int]:
        """Rows by slot for a batched matmul over slots min(slots)..max(slots).

        Returns (rows, padded_index, group_size): row rows[i] goes to position padded_index[i]
        = (slot - min slot) * group_size + its rank among the slot's rows, group_size being the
        most rows any slot has.
        """
        rows: list[int] = []
        padded_index: list[int] = []
        counts: dict[int, int] = {}
        for length, slot in zip(self.lengths, self.slots, strict=True):
            counts[slot] = counts.get(slot, 0) + length
        group_size = max(counts.values(), default=0)
        low = min(counts, default=0)
        placed: dict[int, int] = {}
        for start, length, slot in zip(self.starts, self.lengths, self.slots, strict=True):
            first = (slot - low) * group_size + placed.get(slot, 0)
            rows.extend(range(start, start + length))
            padded_index.extend(range(first, first + length))
            placed[slot] = placed.get(slot, 0) + length
        return rows, padded_index, group_size

    def kernel_layout(self, num_rows: int, max_groups: int) -> KernelLayout:
        """Rows grouped by slot, padded to `num_rows` indices and `max_groups` groups."""
        if num_rows < self.num_rows:
            raise ValueError(f"layout of {num_rows} rows for a batch of {self.num_rows}")
        by_slot: dict[int, list[int]] = {}
        for start, length, slot in zip(self.starts, self.lengths, self.slots, strict=True):
            by_slot.setdefault(slot, []).extend(range(start, start + length))
        if len(by_slot) > max_groups:
            raise ValueError(f"{len(by_slot)} adapters in a batch, at most {max_groups} slots")
        row_indices: list[int] = []
        group_starts: list[int] = []
        group_lengths: list[int] = []
        group_slots: list[int] = []
        for slot in sorted(by_slot):
            group_starts.append(len(row_indices))
            group_lengths.append(len(by_slot[slot]))
            group_slots.append(slot)
            row_indices.extend(by_slot[slot])
        padding = max_groups - len(group_slots)
        group_starts.extend([len(row_indices)] * padding)
        group_lengths.extend([0] * padding)
        group_slots.extend([0] * padding)
        row_indices.extend([0] * (num_rows - len(row_indices)))
        return KernelLayout(
            row_indices=row_indices,
            group_starts=group_starts,
            group_lengths=group_lengths,
            group_slots=group_slots,
            num_lora_rows=sum(self.lengths),
        )


@dataclass(frozen=True)
class KernelLayout:
    """The GPU kernels' view: rows of group g are row_indices[start_g : start_g + length_g].

    Unused groups have length 0 (their programs return at once); unused indices are 0.
    """

    row_indices: list[int]
    group_starts: list[int]
    group_lengths: list[int]
    group_slots: list[int]
    num_lora_rows: int
