"""LoRA expand: y[row, slice cols] += u[row, slice] · B[slot(row), slice cols]ᵀ, in place.

The second half of multi-LoRA (after lora_shrink). A work item is one tile of rows (one slot)
and one block of output columns (decode-sized steps) or a few blocks side by side
(`WIDE_SUB_BLOCKS`, prefill-sized steps, their loads pipelined); the blocks of all slices
(q, k, v of a fused qkv output, or gate, up) are laid end to end in a per-projection table
(`column_blocks`: the slice of each block, its first column, its slice's end), so no item
falls in a gap of a narrow slice. Each item takes its rows' u from the shrink (float32,
rounded to B's dtype, as a LoRA layer in that dtype computes it), multiplies it by the slot's
rank-padded B and adds the result to y, or, in write mode, stores it in y without reading y
(a matmul then adds the base projection onto it: LoRARuntime.project). Rows of no tile (the
base model's) are never read or written. Persistent grid, item count read on the device, as
in lora_shrink.

With programmatic dependent launch, the step's layout and the adapters' B (never written by the
kernel just before: launch.py) are read before the wait, so their latency hides behind the
shrink's tail; u and y only after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import (
    CachedLaunch,
    pdl_launch_next,
    pdl_options,
    pdl_wait,
)
from services.engine.kernels.triton.lora_shrink import (
    persistent_grid,
    pow2_at_least,
    tile_layout,
)

BLOCK_N = 256
# Blocks of BLOCK_N columns per work item in prefill-sized steps: tiles are many there, and
# walking several blocks with the tile's u read once lets their loads overlap.
WIDE_SUB_BLOCKS = 4


def column_blocks(slice_offsets: tuple[int, ...], block_n: int = BLOCK_N) -> list[int]:
    """[slice, first column, slice end] per column block of a projection, flattened."""
    table: list[int] = []
    for index, (low, high) in enumerate(zip(slice_offsets, slice_offsets[1:], strict=False)):
        for first in range(low, high, block_n):
            table.extend((index, first, high))
    return table


@triton.jit
def _add_block(u, b_tile, y_ptrs, y_mask, IEEE: tl.constexpr, WRITE: tl.constexpr):
    """y[rows, block] += u · B[block]ᵀ for one block of output columns (WRITE: y = ...)."""
    if IEEE:
        delta = tl.dot(u, b_tile, input_precision="ieee")
    else:
        delta = tl.dot(u.to(b_tile.dtype), b_tile)
    if not WRITE:
        delta += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, delta.to(y_ptrs.dtype.element_ty), mask=y_mask)


@triton.jit
def _lora_expand_kernel(
    u_ptr,
    b_ptr,
    y_ptr,
    tiles_ptr,
    row_indices_ptr,
    slot_ranks_ptr,
    blocks_ptr,
    num_blocks,
    row_limit,
    stride_um,
    stride_bs,
    stride_bo,
    stride_ym,
    TILE_CAPACITY: tl.constexpr,
    MAX_RANK: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SUB_BLOCKS: tl.constexpr,
    WRITE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # the next kernel may launch; it waits for this one to end (launch.py)
    pdl_launch_next(USE_PDL)
    num_items = tl.load(tiles_ptr) * num_blocks
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    item = tl.program_id(0)
    while item < num_items:
        # The step's layout and the adapters' B: written before the kernel before this one
        # began, so read before the wait (their latency overlaps that kernel's tail).
        tile = item // num_blocks
        block = item % num_blocks
        slot, rank, rows, mask_m = tile_layout(
            tiles_ptr, row_indices_ptr, slot_ranks_ptr, tile, offs_m, TILE_CAPACITY
        )
        slice_id = tl.load(blocks_ptr + 3 * block)
        first = tl.load(blocks_ptr + 3 * block + 1)
        end = tl.load(blocks_ptr + 3 * block + 2)
        mask_m &= rows < row_limit  # fill rows past an eager step's own (KernelTiles)
        mask_r = offs_r < rank  # the slot's real rank (0: nothing to add): padding never read
        u_ptrs = u_ptr + rows[:, None] * stride_um + slice_id * MAX_RANK + offs_r[None, :]
        b_base = b_ptr + slot * stride_bs + offs_r[:, None]
        y_base = y_ptr + rows[:, None] * stride_ym
        u_mask = mask_m[:, None] & mask_r[None, :]
        if SUB_BLOCKS == 1:  # decode-sized: one block, its B fetched before the wait
            offs_n = first + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            b_mask = mask_n[None, :] & mask_r[:, None]
            b_tile = tl.load(b_base + offs_n[None, :] * stride_bo, mask=b_mask, other=0.0)
            # u is the shrink's (the kernel before), y the base matmul's
            pdl_wait(USE_PDL)
            if WRITE or rank > 0:  # writing: a slot of rank 0 writes its zeros
                u = tl.load(u_ptrs, mask=u_mask, other=0.0)
                y_mask = mask_m[:, None] & mask_n[None, :]
                _add_block(u, b_tile, y_base + offs_n[None, :], y_mask, IEEE, WRITE)
        else:  # prefill-sized: SUB_BLOCKS blocks a work item, u read once, loads pipelined
            pdl_wait(USE_PDL)
            if WRITE or rank > 0:
                u = tl.load(u_ptrs, mask=u_mask, other=0.0)
                for sub in range(SUB_BLOCKS):
                    offs_n = first + sub * BLOCK_N + tl.arange(0, BLOCK_N)
                    mask_n = offs_n < end
                    b_mask = mask_n[None, :] & mask_r[:, None]
                    b_tile = tl.load(b_base + offs_n[None, :] * stride_bo, mask=b_mask, other=0.0)
                    y_mask = mask_m[:, None] & mask_n[None, :]
                    _add_block(u, b_tile, y_base + offs_n[None, :], y_mask, IEEE, WRITE)
        item += tl.num_programs(0)
    # never end before the kernel before this one (programs without items too)
    pdl_wait(USE_PDL)


_launch_expand = CachedLaunch(_lora_expand_kernel)


def lora_expand(
    u: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    tiles: torch.Tensor,
    row_indices: torch.Tensor,
    slot_ranks: torch.Tensor,
    blocks: torch.Tensor,
    *,
    tile_rows: int,
    tile_bound: int,
    sub_blocks: int = 1,
    write: bool = False,
) -> None:
    """y[r, cols of slice i] += u[r, i * max_rank:][:rank] · b[slot, cols of slice i]ᵀ for
    every row r of every tile below y's row count (write: `=` instead of `+=`, y's rows not
    read: every column of every tile row is written, zeros for a slot of rank 0).

    u float32 from lora_shrink (row-major, unit column stride); b [slots, out, max_rank] (last
    dim contiguous); y [T, out] with unit column stride; blocks int32 on the device,
    column_blocks(offsets, BLOCK_N * sub_blocks) of this projection (sub_blocks: the column
    blocks of BLOCK_N one work item covers, WIDE_SUB_BLOCKS for prefill-sized steps); tiles,
    row_indices, slot_ranks, tile_rows and tile_bound as for lora_shrink.
    """
    _, out_features, max_rank = b.shape
    u_stride, b_stride, y_stride = u.stride(), b.stride(), y.stride()
    if y_stride[1] != 1 or b_stride[2] != 1 or u_stride[1] != 1:
        raise ValueError("lora_expand needs unit last-dim strides of y, b and u")
    if y.shape[1] != out_features:
        raise ValueError(f"y has {y.shape[1]} columns, B {out_features} rows")
    num_blocks = blocks.shape[0] // 3
    _launch_expand(
        persistent_grid(tile_bound * num_blocks, y.device),
        u,
        b,
        y,
        tiles,
        row_indices,
        slot_ranks,
        blocks,
        num_blocks,
        y.shape[0],
        u_stride[0],
        b_stride[0],
        b_stride[1],
        y_stride[0],
        TILE_CAPACITY=(tiles.shape[0] - 1) // 3,
        MAX_RANK=max_rank,
        IEEE=y.dtype == torch.float32,
        BLOCK_M=tile_rows,
        BLOCK_N=BLOCK_N,
        BLOCK_R=pow2_at_least(max_rank),
        SUB_BLOCKS=sub_blocks,
        WRITE=write,
        num_warps=4,
        **pdl_options(y.device),
    )
