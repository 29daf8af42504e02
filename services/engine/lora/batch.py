"""Which rows of a flat token batch use which adapter slot: segments and slot groups.

Plain Python (no tensors). A step's tokens are laid out sequence after sequence; each sequence
uses one slot (-1: the base model). `LoRABatch` keeps the maximal contiguous runs of rows with
the same non-base slot as segments: the CPU path computes each segment's shrink and expand on a
view of its rows, and base rows are in no segment, so they pay nothing. `kernel_tiles` regroups
the same rows by slot for the GPU kernels (rows of one slot gathered by index) and cuts each
slot's rows into tiles of TILE_ROWS, packed into one fixed-size buffer that a CUDA graph reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.engine.forward_batch import ScheduledBatch

BASE_SLOT = -1
# Rows per GPU kernel tile: one tile is up to this many rows of one slot (the smallest
# tensor-core dot); a step's tiles are its work items (services/engine/lora/runtime.py).
TILE_ROWS = 16


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

    def split_long(self, min_rows: int) -> tuple[LoRABatch, LoRABatch]:
        """(the segments shorter than min_rows, those of at least min_rows), same row count."""
        short, long = [], []
        for segment in zip(self.starts, self.lengths, self.slots, strict=True):
            (long if segment[1] >= min_rows else short).append(segment)
        return self._of(short), self._of(long)

    def _of(self, segments: list[tuple[int, int, int]]) -> LoRABatch:
        if not segments:
            return LoRABatch(self.num_rows)
        starts, lengths, slots = zip(*segments, strict=True)
        return LoRABatch(self.num_rows, starts, lengths, slots)

    def rows_outside(self, cover: int) -> list[int]:
        """The rows below `cover` in no segment (the base model's, and past num_rows a CUDA
        graph's padding), in order."""
        rows: list[int] = []
        row = 0
        for start, length in sorted(zip(self.starts, self.lengths, strict=True)):
            rows.extend(range(row, min(start, cover)))
            row = start + length
        rows.extend(range(row, cover))
        return rows

    def kernel_tiles(self, fill: Sequence[int] = (), fill_slot: int = BASE_SLOT) -> KernelTiles:
        """Rows grouped by slot, cut into tiles of at most TILE_ROWS rows of one slot each;
        the rows `fill` (in no segment) as tiles of `fill_slot` too, after the others."""
        by_slot: dict[int, list[int]] = {}
        for start, length, slot in zip(self.starts, self.lengths, self.slots, strict=True):
            by_slot.setdefault(slot, []).extend(range(start, start + length))
        row_indices: list[int] = []
        tile_slots: list[int] = []
        tile_starts: list[int] = []
        tile_rows: list[int] = []
        groups = [(slot, by_slot[slot]) for slot in sorted(by_slot)]
        for slot, rows in groups + ([(fill_slot, list(fill))] if fill else []):
            first = len(row_indices)
            row_indices.extend(rows)
            for offset in range(0, len(rows), TILE_ROWS):
                tile_slots.append(slot)
                tile_starts.append(first + offset)
                tile_rows.append(min(TILE_ROWS, len(rows) - offset))
        return KernelTiles(row_indices, tile_slots, tile_starts, tile_rows)


def max_tiles(max_rows: int, max_loras: int) -> int:
    """The most tiles a step of max_rows rows over max_loras slots (and the fill slot of
    `kernel_tiles`) cuts into: each slot's rows fill whole tiles but its last."""
    return -(-max_rows // TILE_ROWS) + max_loras + 1


@dataclass(frozen=True)
class KernelTiles:
    """The GPU kernels' view: tile t is rows row_indices[tile_starts[t]:][:tile_rows[t]], all
    of slot tile_slots[t]. Base rows are in no tile, but where `kernel_tiles` covers them."""

    row_indices: list[int]
    tile_slots: list[int]
    tile_starts: list[int]
    tile_rows: list[int]

    @property
    def num_tiles(self) -> int:
        return len(self.tile_slots)

    def packed(self, tile_capacity: int) -> list[int]:
        """[num_tiles, slots, starts, row counts (each padded to tile_capacity), row indices]:
        one int32 buffer, one host-to-device copy per step."""
        if self.num_tiles > tile_capacity:
            raise ValueError(f"{self.num_tiles} tiles, more than the {tile_capacity} laid out")
        padding = [0] * (tile_capacity - self.num_tiles)
        return [
            self.num_tiles,
            *self.tile_slots, *padding,
            *self.tile_starts, *padding,
            *self.tile_rows, *padding,
            *self.row_indices,
        ]  # fmt: skip
