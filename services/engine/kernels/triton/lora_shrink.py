"""LoRA shrink: u[row, slice] = x[row] · A[slot(row), slice]ᵀ for the rows of every adapter.

The first half of multi-LoRA (SGMV-style): rows are grouped by adapter slot (a row-index list
per group, services/engine/lora/batch.py), so each program multiplies a block of one group's
gathered rows by that slot's rank-padded A [rank, in] with a tensor-core dot. The grid is fixed
by the number of rows and slots, never by the adapter mix: programs of empty or short groups
return at once, so a captured CUDA graph serves any mix by reading new group buffers. Wide
inputs with few rows split K across programs (float32 atomic adds into a zeroed output). Only
each slot's real rank of A is read (slots are padded to the largest rank the engine serves).
Output u is float32 [rows, slices, rank] (row-indexed like x) for lora_expand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    row_indices_ptr,
    group_starts_ptr,
    group_lengths_ptr,
    group_slots_ptr,
    slot_ranks_ptr,
    in_features,
    stride_xm,
    stride_as,
    stride_ai,
    stride_ar,
    stride_om,
    stride_oi,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    slice_id = tl.program_id(1) // SPLIT_K
    split = tl.program_id(1) % SPLIT_K
    group = tl.program_id(2)
    length = tl.load(group_lengths_ptr + group)
    m_start = pid_m * BLOCK_M
    if m_start >= length:
        return
    slot = tl.load(group_slots_ptr + group).to(tl.int64)
    rank = tl.load(slot_ranks_ptr + slot)
    if rank == 0:  # the adapter leaves this projection alone (lora_expand skips it too)
        return
    start = tl.load(group_starts_ptr + group)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(row_indices_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank  # the slot's real rank: its padding is never read
    a_base = a_ptr + slot * stride_as + slice_id * stride_ai
    k_per_split = tl.cdiv(in_features, BLOCK_K * SPLIT_K) * BLOCK_K
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_features)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x_tile = tl.load(
            x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        a_tile = tl.load(
            a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
            mask=mask_r[None, :] & mask_k[:, None],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x_tile, a_tile, input_precision="ieee")
        else:
            acc += tl.dot(x_tile, a_tile)
    out_ptrs = out_ptr + rows[:, None] * stride_om + slice_id * stride_oi + offs_r[None, :]
    out_mask = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


def shrink_split_k(rows: int, in_features: int) -> int:
    """K splits: more programs for decode-sized batches over wide inputs, none for prefill."""
    if rows > 128:
        return 1
    return max(1, min(8, in_features // 1024))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    out: torch.Tensor,
    row_indices: torch.Tensor,
    group_starts: torch.Tensor,
    group_lengths: torch.Tensor,
    group_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
) -> None:
    """out[r, i, :] = x[r] · a[slot, i]ᵀ for every row r of every group (others untouched).

    x [T, in]; a [slots, slices, rank, in] (last dim contiguous); out float32 [T, >=slices,
    rank]; the group tensors int32 (services/engine/lora/batch.KernelLayout); slot_ranks
    int32 [slots], each slot's real rank for this projection (0: rows of that slot skipped).
    """
    rows = x.shape[0]
    if rows == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    _, num_slices, rank, in_features = a.shape
    if a.stride(3) != 1 or out.stride(2) != 1 or out.dtype != torch.float32:
        raise ValueError("lora_shrink needs a contiguous last dim of a and a float32 out")
    block_m = 16 if rows <= 16 else (32 if rows <= 256 else 64)
    split_k = shrink_split_k(rows, in_features)
    if split_k > 1:
        out[:rows].zero_()
    grid = (triton.cdiv(rows, block_m), num_slices * split_k, group_slots.shape[0])
    _lora_shrink_kernel[grid](
        x,
        a,
        out,
        row_indices,
        group_starts,
        group_lengths,
        group_slots,
        slot_ranks,
        in_features,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        out.stride(0),
        out.stride(1),
        SPLIT_K=split_k,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_K=64,
        num_warps=4,
    )
