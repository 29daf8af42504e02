"""LoRABatch: segments of adapter rows (base rows in none), and the kernels' grouped layout."""

from __future__ import annotations

import pytest

from services.engine.forward_batch import ScheduledBatch, ScheduledSequence
from services.engine.lora.batch import BASE_SLOT, TILE_ROWS, LoRABatch, max_tiles


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


def test_kernel_tiles_group_rows_by_slot_and_pack() -> None:
    batch = LoRABatch.from_row_slots([3, -1, 1, 3, 3, -1, 1])
    tiles = batch.kernel_tiles()
    assert tiles.row_indices == [2, 6, 0, 3, 4]
    assert (tiles.tile_slots, tiles.tile_starts, tiles.tile_rows) == ([1, 3], [0, 2], [2, 3])
    assert tiles.packed(3) == [2, 1, 3, 0, 0, 2, 0, 2, 3, 0, 2, 6, 0, 3, 4]
    with pytest.raises(ValueError, match="2 tiles, more than the 1"):
        tiles.packed(1)


def test_a_slot_with_many_rows_spans_tiles() -> None:
    rows = 2 * TILE_ROWS + 3
    batch = LoRABatch.from_runs([(5, -1), (rows, 2), (1, 0)])
    tiles = batch.kernel_tiles()
    assert tiles.tile_slots == [0, 2, 2, 2]
    assert tiles.tile_rows == [1, TILE_ROWS, TILE_ROWS, 3]
    assert tiles.tile_starts == [0, 1, 1 + TILE_ROWS, 1 + 2 * TILE_ROWS]
    assert tiles.row_indices == [5 + rows, *range(5, 5 + rows)]
    # every slot's rows fill whole tiles but its last: the capacity bounds any mix
    assert tiles.num_tiles <= max_tiles(batch.num_rows, 3)
    worst = LoRABatch.from_row_slots([0, 1, 2] * TILE_ROWS + [0])
    assert worst.kernel_tiles().num_tiles <= max_tiles(worst.num_rows, 3)


def test_rows_outside_every_segment_fill_tiles_of_their_own_slot() -> None:
    batch = LoRABatch.from_row_slots([3, -1, 1, 3, 3, -1, 1])
    assert batch.rows_outside(7) == [1, 5]
    assert batch.rows_outside(10) == [1, 5, 7, 8, 9]  # a graph's padding past the batch
    assert batch.rows_outside(4) == [1]
    tiles = batch.kernel_tiles(batch.rows_outside(10), fill_slot=8)
    assert tiles.tile_slots == [1, 3, 8]
    assert tiles.row_indices == [2, 6, 0, 3, 4, 1, 5, 7, 8, 9]
    assert (tiles.tile_starts, tiles.tile_rows) == ([0, 2, 5], [2, 3, 5])
    # every row below the cover is in exactly one tile
    assert sorted(tiles.row_indices) == list(range(10))
    many = LoRABatch.from_row_slots([-1] * (TILE_ROWS + 2) + [0])
    fill = many.rows_outside(many.num_rows)
    assert many.kernel_tiles(fill, 4).tile_rows == [1, TILE_ROWS, 2]
    worst = LoRABatch.from_row_slots([0, 1, 2, -1] * TILE_ROWS)
    filled = worst.kernel_tiles(worst.rows_outside(worst.num_rows), 3)
    assert filled.num_tiles <= max_tiles(worst.num_rows, 3)


def test_an_empty_batch_has_no_tiles() -> None:
    assert LoRABatch.from_row_slots([-1, -1]).kernel_tiles().packed(2) == [0] * 7


def test_long_runs_split_from_the_rest_keep_the_row_count() -> None:
    batch = LoRABatch.from_runs([(3, 1), (40, 2), (2, BASE_SLOT), (39, 1), (50, 1)])
    # (39, 1) and (50, 1) are one run of 89 rows.
    short, long = batch.split_long(40)
    assert (short.num_rows, long.num_rows) == (134, 134)
    assert (short.starts, short.lengths, short.slots) == ((0,), (3,), (1,))
    assert (long.starts, long.lengths, long.slots) == ((3, 45), (40, 89), (2, 1))
    nothing_long, everything = batch.split_long(10_000)
    assert nothing_long == batch and everything.is_empty
