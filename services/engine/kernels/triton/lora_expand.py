"""LoRA expand: y[row, slice cols] += u[row, slice] · B[slot(row), slice cols]ᵀ, in place.

The second half of multi-LoRA (after lora_shrink): for each group of rows that share a slot,
each program takes a block of gathered rows and a block of one slice's output columns (q, k, v
of a fused qkv output, or gate, up), multiplies the float32 shrink result (rounded to B's dtype,
as a LoRA layer in that dtype computes it) by the slot's rank-padded B, and adds it to y.
Rows of no group (the base model's) are never read or written. Fixed grid, as in lora_shrink.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_expand_kernel(
    shrunk_ptr,
    b_ptr,
    y_ptr,
    slice_offsets_ptr,
    row_indices_ptr,
    group_starts_ptr,
    group_lengths_ptr,
    group_slots_ptr,
    slot_ranks_ptr,
    stride_sm,
    stride_si,
    stride_bs,
    stride_bo,
    stride_ym,
    NUM_SLICES: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    group = tl.program_id(2) // NUM_SLICES
    slice_id = tl.program_id(2) % NUM_SLICES
    length = tl.load(group_lengths_ptr + group)
    m_start = pid_m * BLOCK_M
    if m_start >= length:
        return
    low = tl.load(slice_offsets_ptr + slice_id)
    high = tl.load(slice_offsets_ptr + slice_id + 1)
    n_start = low + pid_n * BLOCK_N
    if n_start >= high:
        return
    slot = tl.load(group_slots_ptr + group).to(tl.int64)
    rank = tl.load(slot_ranks_ptr + slot)
    if rank == 0:  # the adapter leaves this projection alone
        return
    start = tl.load(group_starts_ptr + group)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(row_indices_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < high
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank  # the slot's real rank: its padding is never read
    shrunk = tl.load(
        shrunk_ptr + rows[:, None] * stride_sm + slice_id * stride_si + offs_r[None, :],
        mask=mask_m[:, None] & mask_r[None, :],
        other=0.0,
    )
    b_tile = tl.load(
        b_ptr + slot * stride_bs + offs_n[None, :] * stride_bo + offs_r[:, None],
        mask=mask_n[None, :] & mask_r[:, None],
        other=0.0,
    )
    if IEEE:
        delta = tl.dot(shrunk, b_tile, input_precision="ieee")
    else:
        delta = tl.dot(shrunk.to(b_tile.dtype), b_tile)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    y_mask = mask_m[:, None] & mask_n[None, :]
    y_tile = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_tile + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


def lora_expand(
    shrunk: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    slice_offsets: torch.Tensor,
    row_indices: torch.Tensor,
    group_starts: torch.Tensor,
    group_lengths: torch.Tensor,
    group_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    *,
    widest_slice: int,
) -> None:
    """y[r, cols of slice i] += shrunk[r, i] · b[slot, cols of slice i]ᵀ for grouped rows r.

    shrunk float32 [T, >=slices, rank] from lora_shrink; b [slots, out, rank] (last dim
    contiguous); y [T, out] with unit column stride; slice_offsets int32 [slices + 1] on the
    device (the slice starts in y plus the total) and widest_slice the largest slice width;
    the group tensors and slot_ranks as for lora_shrink.
    """
    rows = y.shape[0]
    if rows == 0:
        return
    _, out_features, rank = b.shape
    num_slices = slice_offsets.shape[0] - 1
    if y.stride(1) != 1 or b.stride(2) != 1 or shrunk.stride(2) != 1:
        raise ValueError("lora_expand needs unit last-dim strides of y, b and shrunk")
    if y.shape[1] != out_features:
        raise ValueError(f"y has {y.shape[1]} columns, B {out_features} rows")
    block_m = 16 if rows <= 16 else (32 if rows <= 256 else 64)
    block_n = 128
    grid = (
        triton.cdiv(rows, block_m),
        triton.cdiv(widest_slice, block_n),
        group_slots.shape[0] * num_slices,
    )
    _lora_expand_kernel[grid](
        shrunk,
        b,
        y,
        slice_offsets,
        row_indices,
        group_starts,
        group_lengths,
        group_slots,
        slot_ranks,
        shrunk.stride(0),
        shrunk.stride(1),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        NUM_SLICES=num_slices,
        IEEE=y.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=4,
    )
