"""LoRA shrink: u[row, slice, :] = x[row] · A[slot(row), slice]ᵀ for the rows of every adapter.

The first half of multi-LoRA (SGMV-style). A step's adapter rows come cut into tiles (up to
16 rows of one slot, gathered by index: services/engine/lora/batch.py); a work item is
one tile and one K split, and each program walks the items from its id in steps of the grid
size. The grid is a few programs per SM, fixed by the padded row count, never by the adapter
mix: the item count is read on the device, so a captured CUDA graph serves any mix, and a step
of one adapter launches the same few hundred programs as one of sixty-four, not one per slot.
Each item multiplies its gathered rows by every slice of the slot's A at once (the slices'
rank-padded rows are contiguous, so x is read once per tile) with a tensor-core dot, and writes
float32 partial sums to its split's plane of `partials` [splits, rows, slices * max_rank]; the
expand kernel sums the planes (no atomics, no zeroing). Rows past a slot's real rank are masked
(its padding is never read) and come out zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs per SM of the persistent grids (shrink and expand).
PROGRAMS_PER_SM = 8
# Split K only for decode-sized steps, at most this many ways.
MAX_SPLIT_K = 8
SPLIT_K_MAX_ROWS = 256


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    partials_ptr,
    tiles_ptr,
    row_indices_ptr,
    slot_ranks_ptr,
    stride_xm,
    stride_as,
    stride_pk,
    stride_pm,
    IN_FEATURES: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    TILE_CAPACITY: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    MAX_RANK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    num_items = tl.load(tiles_ptr) * SPLIT_K
    offs_j = tl.arange(0, BLOCK_J)  # slice * MAX_RANK + rank index
    offs_m = tl.arange(0, BLOCK_M)
    item = tl.program_id(0)
    while item < num_items:
        tile = item // SPLIT_K
        split = item % SPLIT_K
        slot = tl.load(tiles_ptr + 1 + tile).to(tl.int64)
        rank = tl.load(slot_ranks_ptr + slot)
        if rank > 0:  # 0: the adapter leaves this projection alone (expand skips it too)
            start = tl.load(tiles_ptr + 1 + TILE_CAPACITY + tile)
            count = tl.load(tiles_ptr + 1 + 2 * TILE_CAPACITY + tile)
            mask_m = offs_m < count
            rows = tl.load(row_indices_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
            mask_j = ((offs_j % MAX_RANK) < rank) & (offs_j < NUM_SLICES * MAX_RANK)
            a_base = a_ptr + slot * stride_as
            k_begin = split * K_PER_SPLIT
            k_end = tl.minimum(k_begin + K_PER_SPLIT, IN_FEATURES)
            acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
            for k0 in range(0, K_PER_SPLIT, BLOCK_K):
                offs_k = k_begin + k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < k_end
                x_tile = tl.load(
                    x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0,
                )
                a_tile = tl.load(
                    a_base + offs_j[None, :].to(tl.int64) * IN_FEATURES + offs_k[:, None],
                    mask=mask_j[None, :] & mask_k[:, None],
                    other=0.0,
                )
                if IEEE:
                    acc += tl.dot(x_tile, a_tile, input_precision="ieee")
                else:
                    acc += tl.dot(x_tile, a_tile)
            out = partials_ptr + split * stride_pk + rows[:, None] * stride_pm + offs_j[None, :]
            tl.store(out, acc, mask=mask_m[:, None] & (offs_j < NUM_SLICES * MAX_RANK)[None, :])
        item += tl.num_programs(0)


def shrink_split_k(rows: int, in_features: int) -> int:
    """K splits: more items for decode-sized steps over wide inputs, none for prefill."""
    if rows > SPLIT_K_MAX_ROWS:
        return 1
    return max(1, min(MAX_SPLIT_K, in_features // 1024))


def persistent_grid(items: int, device: torch.device) -> tuple[int]:
    """min(items, a few programs per SM) programs, at least one (a few where the device has
    no SMs to count: the Triton interpreter on a CPU)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 1
    return (max(1, min(items, PROGRAMS_PER_SM * sms)),)


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    partials: torch.Tensor,
    tiles: torch.Tensor,
    row_indices: torch.Tensor,
    slot_ranks: torch.Tensor,
    *,
    tile_rows: int,
    tile_bound: int,
) -> int:
    """partials[s, r, i * max_rank + j] = Σ over split s's K of x[r] · a[slot, i, j] for every
    row r of every tile; returns the split count (lora_expand sums that many planes).

    x [T, in]; a [slots, slices, max_rank, in] contiguous; partials float32 with room for
    splits × T × slices × max_rank; tiles int32 (KernelTiles.packed: the count, then slots,
    starts and row counts of tile capacity each) and row_indices int32, on the device;
    slot_ranks int32 [slots] (0: rows of that slot skipped); tile_rows: the most rows of a tile
    (a power of two >= 16); tile_bound: at most this many tiles are in `tiles` now (the grid is
    sized from it; the capacity while capturing).
    """
    rows = x.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    _, num_slices, max_rank, in_features = a.shape
    if not a.is_contiguous() or partials.dtype != torch.float32:
        raise ValueError("lora_shrink needs a contiguous a and float32 partials")
    split_k = shrink_split_k(rows, in_features)
    width = num_slices * max_rank
    if partials.numel() < split_k * rows * width:
        raise ValueError(f"partials hold {partials.numel()} values, {split_k * rows * width} due")
    tile_capacity = (tiles.shape[0] - 1) // 3
    block_k = 64 if width <= 128 else 32
    _lora_shrink_kernel[persistent_grid(tile_bound * split_k, x.device)](
        x,
        a,
        partials,
        tiles,
        row_indices,
        slot_ranks,
        x.stride(0),
        a.stride(0),
        rows * width,
        width,
        IN_FEATURES=in_features,
        K_PER_SPLIT=triton.cdiv(in_features, block_k * split_k) * block_k,
        TILE_CAPACITY=tile_capacity,
        NUM_SLICES=num_slices,
        MAX_RANK=max_rank,
        SPLIT_K=split_k,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=tile_rows,
        BLOCK_J=max(16, triton.next_power_of_2(width)),
        BLOCK_K=block_k,
        num_warps=4,
    )
    return split_k
