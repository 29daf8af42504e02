"""Mixed-adapter LoRA in plain PyTorch: `y += (x Aᵀ) Bᵀ` per adapter's rows, per slice.

The CPU path (and the reference for the GPU kernels). Two ways, same result:
- `add_lora`, per segment: each segment of a LoRABatch is a run of contiguous rows with one
  slot, a view of x and y (nothing gathered); one shrink over all the projection's slices at
  the adapter's real rank, then one expand per slice into that slice's output columns. Best
  for few, long segments (prefill, or one adapter for the whole batch).
- `add_lora_grouped`, all slots at once: the adapter rows are scattered into a zero-padded
  [slots, group, in] block and multiplied by the stacked slot buffers in one batched matmul per
  step of the math, then added back by row index. A decode batch of many adapters costs a
  fixed handful of ops instead of a few per segment (on CPU the op count, not the arithmetic,
  dominates a small LoRA).
- `write_lora`, per segment as `add_lora` but writing the deltas (y's rows overwritten, not
  read), so that a matmul adding the base projection onto them comes after (LoRARuntime on a
  GPU, for long runs); its shrink reads x's rows once for every slice.
Rows outside every segment (the base model's) are never written. The scale is already in B
(services/engine/lora/weights.py). The math runs in the slot buffers' dtype: on CPU they are
float32 even for a bfloat16 model (PyTorch's small bfloat16 matmuls on CPU are several times
slower than float32 ones), and each delta is rounded once when added to y.
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
    *,
    fused_add: bool = False,
) -> None:
    """In place: y[rows] += per slice (x[rows] A[slot, i, :r]ᵀ) B[slot, slice i, :r]ᵀ.

    x [T, in], y [T, out]; a [S, slices, R, in], b [S, out, R]; slice_offsets the start of each
    slice in y plus the total; ranks[slot] the rank to use (0: skip the slot). fused_add: each
    slice's expand adds into y in one matmul (no product tensor written and read back), where
    y and b share a dtype.
    """
    fused_add = fused_add and y.dtype == b.dtype
    num_slices = len(slice_offsets) - 1
    for start, length, slot in zip(batch.starts, batch.lengths, batch.slots, strict=True):
        rank = ranks[slot]
        if rank == 0:
            continue
        rows = slice(start, start + length)
        x_rows = x[rows].to(a.dtype)
        # [slices, rows, rank]: every slice's shrink in one batched matmul.
        shrunk = torch.matmul(x_rows, a[slot, :, :rank].transpose(1, 2))
        y_rows = y[rows]
        for index in range(num_slices):
            low, high = slice_offsets[index], slice_offsets[index + 1]
            expand = b[slot, low:high, :rank]
            if fused_add or (num_slices == 1 and y.dtype == b.dtype):
                y_rows[:, low:high].addmm_(shrunk[index], expand.t())
            else:
                y_rows[:, low:high] += shrunk[index] @ expand.t()


def write_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    batch: LoRABatch,
    a: torch.Tensor,
    b: torch.Tensor,
    slice_offsets: Sequence[int],
    ranks: Sequence[int],
) -> None:
    """In place: y[rows] = per slice (x[rows] A[slot, i, :r]ᵀ) B[slot, slice i, :r]ᵀ, every
    column of each segment's rows written and none read (a slot of rank 0 writes zeros).

    Shapes as add_lora's, a contiguous; y, a and b of one dtype. The shrink is one matmul of the
    rows against the slot's slices stacked at the buffers' padded rank (shrink_stacked: x read
    once, the padding columns unused).
    """
    num_slices = len(slice_offsets) - 1
    padded = a.shape[2]
    for start, length, slot in zip(batch.starts, batch.lengths, batch.slots, strict=True):
        y_rows = y[start : start + length]
        rank = ranks[slot]
        if rank == 0:
            y_rows.zero_()
            continue
        shrunk = shrink_stacked(x[start : start + length], a, slot)  # [rows, slices * padded]
        for index in range(num_slices):
            low, high = slice_offsets[index], slice_offsets[index + 1]
            part = shrunk[:, index * padded : index * padded + rank]
            y_rows[:, low:high].addmm_(part, b[slot, low:high, :rank].t(), beta=0)


def shrink_stacked(x_rows: torch.Tensor, a: torch.Tensor, slot: int) -> torch.Tensor:
    """x_rows times every slice's A of `slot` at the buffers' padded rank, in one matmul (x read
    once): [rows, slices * padded], slice i from column i * padded (a contiguous, [S, slices,
    padded, in]; the padding columns 0)."""
    _, num_slices, padded, in_features = a.shape
    return x_rows.to(a.dtype) @ a[slot].view(num_slices * padded, in_features).t()


def add_lora_grouped(
    y: torch.Tensor,
    x: torch.Tensor,
    rows: torch.Tensor,
    padded_index: torch.Tensor,
    group_size: int,
    a: torch.Tensor,
    b: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    """In place, as add_lora, with rows grouped by slot (LoRABatch.padded_groups as tensors).

    a must be contiguous ([S, slices, R, in] viewed as [S, slices * R, in]); the rank-padding
    zeros of each slot add nothing.
    """
    num_slots, num_slices, rank, in_features = a.shape
    padded = a.new_zeros(num_slots * group_size, in_features)
    padded.index_copy_(0, padded_index, x.index_select(0, rows).to(a.dtype))
    shrunk = torch.bmm(
        padded.view(num_slots, group_size, in_features),
        a.view(num_slots, num_slices * rank, in_features).transpose(1, 2),
    )
    for index in range(num_slices):
        low, high = slice_offsets[index], slice_offsets[index + 1]
        expanded = torch.bmm(
            shrunk[:, :, index * rank : (index + 1) * rank], b[:, low:high].transpose(1, 2)
        )
        delta = expanded.view(num_slots * group_size, high - low).index_select(0, padded_index)
        target = y if num_slices == 1 else y[:, low:high]
        target.index_add_(0, rows, delta.to(y.dtype))
