"""LoRA shrink: u[row, slice, :] = x[row] · A[slot(row), slice]ᵀ for the rows of every adapter.

The first half of multi-LoRA (SGMV-style). A step's adapter rows come cut into tiles (up to
16 rows of one slot, gathered by index: services/engine/lora/batch.py); a work item is
one tile and one K split, and each program walks the items from its id in steps of the grid
size. The grid is a few programs per SM, fixed by the padded row count, never by the adapter
mix: the item count is read on the device, so a captured CUDA graph serves any mix, and a step
of one adapter launches the same few hundred programs as one of sixty-four, not one per slot.
Each item multiplies its gathered rows by every slice of the slot's A at once (the slices'
rank-padded rows are contiguous, so x is read once per tile) with a tensor-core dot over its
K range and adds the float32 result into u [rows, slices * max_rank] atomically (splits keep
each item's K loop short: decode steps have few tiles). u must be zero in the tiles' rows; the
caller alternates two u buffers, and each launch zeroes the other one's rows of its tiles, for
the next projection to add into (services/engine/lora/runtime.py), so no launch is spent on
zeroing. Rows past a slot's real rank are masked (its padding is never read) and stay zero.
With programmatic dependent launch, each item's tile layout is read before the wait (launch.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import (
    CachedLaunch,
    pdl_launch_next,
    pdl_options,
    pdl_wait,
)

# Programs per SM of the persistent grids (shrink and expand).
PROGRAMS_PER_SM = 8
# K per split item: decode-sized steps (few tiles) split finer than prefill-sized ones.
SPLIT_K_MAX_ROWS = 256
DECODE_K_PER_SPLIT = 256
PREFILL_K_PER_SPLIT = 1024


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    u_ptr,
    zero_ptr,
    tiles_ptr,
    row_indices_ptr,
    slot_ranks_ptr,
    stride_xm,
    stride_as,
    stride_um,
    IN_FEATURES: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    TILE_CAPACITY: tl.constexpr,
    WIDTH: tl.constexpr,
    ZERO_WIDTH: tl.constexpr,
    MAX_RANK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_Z: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # the next kernel may launch; it waits for this one to end (launch.py)
    pdl_launch_next(USE_PDL)
    num_items = tl.load(tiles_ptr) * SPLIT_K
    offs_j = tl.arange(0, BLOCK_J)  # slice * MAX_RANK + rank index
    offs_m = tl.arange(0, BLOCK_M)
    item = tl.program_id(0)
    while item < num_items:
        tile = item // SPLIT_K
        split = item % SPLIT_K
        slot = tl.load(tiles_ptr + 1 + tile).to(tl.int64)
        rank = tl.load(slot_ranks_ptr + slot)
        start = tl.load(tiles_ptr + 1 + TILE_CAPACITY + tile)
        count = tl.load(tiles_ptr + 1 + 2 * TILE_CAPACITY + tile)
        mask_m = offs_m < count
        rows = tl.load(row_indices_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
        # the layout above is read before the wait; x, u and zero only after it
        pdl_wait(USE_PDL)
        u_offsets = rows[:, None] * stride_um + offs_j[None, :]
        u_mask = mask_m[:, None] & (offs_j < WIDTH)[None, :]
        if split == 0:  # the next projection's u starts from zero in these rows
            offs_z = tl.arange(0, BLOCK_Z)
            tl.store(
                zero_ptr + rows[:, None] * stride_um + offs_z[None, :],
                tl.zeros((BLOCK_M, BLOCK_Z), tl.float32),
                mask=mask_m[:, None] & (offs_z < ZERO_WIDTH)[None, :],
            )
        if rank > 0:  # 0: the adapter leaves this projection alone (expand skips it too)
            mask_j = ((offs_j % MAX_RANK) < rank) & (offs_j < WIDTH)
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
            if SPLIT_K == 1:
                tl.store(u_ptr + u_offsets, acc, mask=u_mask)
            else:
                tl.atomic_add(u_ptr + u_offsets, acc, mask=u_mask)
        item += tl.num_programs(0)
    # never end before the kernel before this one (programs without items too)
    pdl_wait(USE_PDL)


_launch_shrink = CachedLaunch(_lora_shrink_kernel)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The smallest power of two >= max(n, floor) (plain Python: a step launches these
    kernels hundreds of times outside CUDA graphs, so their host side stays lean)."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


@functools.lru_cache(maxsize=256)
def _shrink_launch(
    decode_sized: bool, in_features: int, width: int, zero_width: int, float32: bool
) -> tuple[int, dict[str, object]]:
    """(K splits, the kernel's constexprs) for one shape: computed once, not per launch.
    Decode-sized steps (few tiles) split K finer than prefill-sized ones."""
    per_split = DECODE_K_PER_SPLIT if decode_sized else PREFILL_K_PER_SPLIT
    split_k = max(1, in_features // per_split)
    block_k = 64 if width <= 128 else 32
    return split_k, {
        "IN_FEATURES": in_features,
        "K_PER_SPLIT": ceil_div(ceil_div(in_features, split_k), block_k) * block_k,
        "WIDTH": width,
        "ZERO_WIDTH": zero_width,
        "SPLIT_K": split_k,
        "IEEE": float32,
        "BLOCK_J": pow2_at_least(width),
        "BLOCK_K": block_k,
        "BLOCK_Z": pow2_at_least(zero_width),
    }


def persistent_grid(items: int, device: torch.device) -> tuple[int]:
    """min(items, a few programs per SM) programs, at least one (a few where the device has
    no SMs to count: the Triton interpreter on a CPU)."""
    return (max(1, min(items, PROGRAMS_PER_SM * _sm_count(device))),)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SMs, asked once (every eager launch sizes its grid from it)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device.index).multi_processor_count


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    u: torch.Tensor,
    zero: torch.Tensor,
    tiles: torch.Tensor,
    row_indices: torch.Tensor,
    slot_ranks: torch.Tensor,
    *,
    tile_rows: int,
    tile_bound: int,
) -> None:
    """u[r, i * max_rank + j] += x[r] · a[slot, i, j] for every row r of every tile, and
    zero[r, :] = 0 for the same rows (all its columns: the next projection may be wider).

    x [T, in]; a [slots, slices, max_rank, in], each slot contiguous; u and zero float32
    [>= T, >= slices * max_rank] with unit column stride, u zero in the tiles' rows; tiles int32
    (KernelTiles.packed: the count, then slots, starts and row counts of tile capacity each)
    and row_indices int32, on the device; slot_ranks int32 [slots] (0: rows of that slot
    skipped); tile_rows: the most rows of a tile (a power of two >= 16); tile_bound: at most
    this many tiles are in `tiles` now (the grid is sized from it; the capacity while
    capturing).
    """
    rows = x.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    _, num_slices, max_rank, in_features = a.shape
    width = num_slices * max_rank
    if a.stride()[1:] != (max_rank * in_features, in_features, 1):
        raise ValueError("lora_shrink needs each slot of a contiguous")
    u_stride = u.stride()
    if u.dtype != torch.float32 or u_stride != zero.stride() or u_stride[1] != 1:
        raise ValueError("lora_shrink needs float32 u and zero of one row-major layout")
    if u.shape[0] < rows or u.shape[1] < width:
        raise ValueError(f"u is {tuple(u.shape)}, {rows} rows of {width} due")
    split_k, constants = _shrink_launch(
        rows <= SPLIT_K_MAX_ROWS, in_features, width, zero.shape[1], x.dtype == torch.float32
    )
    _launch_shrink(
        persistent_grid(tile_bound * split_k, x.device),
        x,
        a,
        u,
        zero,
        tiles,
        row_indices,
        slot_ranks,
        x.stride(0),
        a.stride(0),
        u_stride[0],
        TILE_CAPACITY=(tiles.shape[0] - 1) // 3,
        MAX_RANK=max_rank,
        BLOCK_M=tile_rows,
        num_warps=4,
        **constants,
        **pdl_options(u.device),
    )
