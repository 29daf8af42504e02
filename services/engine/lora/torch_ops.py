"""Mixed-adapter LoRA in plain PyTorch: `y += (x Aᵀ) Bᵀ` per segment of rows, per slice.

The CPU path (and the reference for the GPU kernels). Each segment of a LoRABatch is a run of
contiguous rows with one slot; its rows are a view of x and y, so nothing is gathered or
scattered. Per segment: one shrink over all the projection's slices at the adapter's real rank
(not the padded one), then one expand per slice into that slice's output columns. Rows outside
every segment (the base model's) and slots that leave the projection alone cost nothing. The
scale is already in B (services/engine/lora/weights.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.lora.batch import LoRABatch


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    batch: LoRABatch,
    a: torch.Tensor,
    b: torch.Tensor,
    slice_offsets: Sequence[int],
    ranks: Sequence[int],
) -> None:
    """In place: y[rows] += per slice (x[rows] A[slot, i, :r]ᵀ) B[slot, slice i, :r]ᵀ.

    x [T, in], y [T, out]; a [S, slices, R, in], b [S, out, R]; slice_offsets the start of each
    slice in y plus the total; ranks[slot] the rank to use (0: skip the slot).
    """
    num_slices = len(slice_offsets) - 1
    for start, length, slot in zip(batch.starts, batch.lengths, batch.slots, strict=True):
        rank = ranks[slot]
        if rank == 0:
            continue
        rows = slice(start, start + length)
        x_rows = x[rows]
        # [slices, rows, rank]: every slice's shrink in one batched matmul.
        shrunk = torch.matmul(x_rows, a[slot, :, :rank].transpose(1, 2))
        y_rows = y[rows]
        for index in range(num_slices):
            low, high = slice_offsets[index], slice_offsets[index + 1]
            expand = b[slot, low:high, :rank]
            if num_slices == 1:
                y_rows.addmm_(shrunk[0], expand.t())
            else:
                y_rows[:, low:high] += shrunk[index] @ expand.t()
