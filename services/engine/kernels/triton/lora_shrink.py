"""LoRA shrink: u[row, slice, :] = x[row] · A[slot(row), slice]ᵀ for the rows of every adapter.

The first half of multi-LoRA (SGMV-style). A step's adapter rows come cut into tiles (up to
16 rows of one slot, gathered by index: services/engine/lora/batch.py); a work item is
one tile and one K split, and each program walks the items from its id in steps of the grid
size. The grid is a few programs per SM, fixed by the padded row count, never by the adapter
mix: the item count is read on the device, so a captured CUDA graph serves any mix, and a step
of one adapter launches the same few hundred programs as one of sixty-four, not one per slot.
Each item multiplies its gathered rows by every slice of the slot's A at once (the slices'
rank-padded rows are contiguous, so x is read once per tile) with a tensor-core dot over its
K range (splits keep each item's K loop short: decode steps have few tiles). The sum over the
splits is deterministic: each split stores its float32 partial in a workspace and counts itself
in on its tile's counter; the split that arrives last adds the tile's partials in split order
and stores the result in u [rows, slices * max_rank], then resets the counter. The same input
thus gives the same bits on every run (float atomics would add in whatever order the splits
finish). Each launch also zeroes the rows of its tiles in a second buffer (the caller's other u,
services/engine/lora/runtime.py). Columns past a slot's real rank are masked (its padding is
never read) and come out zero.
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
def tile_layout(
    tiles_ptr, row_indices_ptr, slot_ranks_ptr, tile, offs_m, TILE_CAPACITY: tl.constexpr
):  # fmt: skip
    """(its slot (int64), the slot's rank in this projection, its rows (int64, 0 past its
    count), the mask of its rows) of `tile` in a step's packed layout (lora/batch.py)."""
    slot = tl.load(tiles_ptr + 1 + tile).to(tl.int64)
    rank = tl.load(slot_ranks_ptr + slot)
    start = tl.load(tiles_ptr + 1 + TILE_CAPACITY + tile)
    count = tl.load(tiles_ptr + 1 + 2 * TILE_CAPACITY + tile)
    mask_m = offs_m < count
    rows = tl.load(row_indices_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    return slot, rank, rows, mask_m


@triton.jit
def _add_splits(
    acc, u_ptrs, u_mask, partials_ptr, counters_ptr, tile, split, offs_m, offs_j,
    SPLIT_K: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Store this split's partial; the tile's last split to arrive sums all of them in split
    order into u and resets the tile's counter. Only the tile's rows (u_mask) are stored and
    read back: a tile of one row (a decode step of many adapters) moves 1/BLOCK_M of a full
    tile's partials."""
    tile_base = partials_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * WIDTH)
    offsets = offs_m[:, None] * WIDTH + offs_j[None, :]
    tl.store(tile_base + split * (BLOCK_M * WIDTH) + offsets, acc, mask=u_mask)
    tl.debug_barrier()  # every thread's stores issued before the release below
    arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.zeros(acc.shape, tl.float32)
        for index in range(SPLIT_K):
            total += tl.load(
                tile_base + index * (BLOCK_M * WIDTH) + offsets,
                mask=u_mask,
                other=0.0,
                cache_modifier=".cg",  # from L2: another SM wrote it
            )
        tl.store(u_ptrs, total, mask=u_mask)
        tl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    u_ptr,
    zero_ptr,
    partials_ptr,
    counters_ptr,
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
    IN_ORDER: tl.constexpr,
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
        slot, rank, rows, mask_m = tile_layout(
            tiles_ptr, row_indices_ptr, slot_ranks_ptr, tile, offs_m, TILE_CAPACITY
        )
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
            elif not IN_ORDER:  # no workspace: added into u (zero in these rows) as they finish
                tl.atomic_add(u_ptr + u_offsets, acc, mask=u_mask)
            else:
                _add_splits(acc, u_ptr + u_offsets, u_mask, partials_ptr, counters_ptr, tile,
                            split, offs_m, offs_j, SPLIT_K, WIDTH, BLOCK_M)  # fmt: skip
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
    split_k = _split_count(decode_sized, in_features)
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


def workspace_floats(
    rows: int, in_features: int, width: int, tile_rows: int, tile_bound: int
) -> int:
    """The float32 partials a launch over `rows` rows of `tile_bound` tiles at most needs: one
    [tile_rows, width] block per tile and K split (none without splits)."""
    split_k = _split_count(rows <= SPLIT_K_MAX_ROWS, in_features)
    return 0 if split_k == 1 else split_k * tile_bound * tile_rows * width


def _split_count(decode_sized: bool, in_features: int) -> int:
    per_split = DECODE_K_PER_SPLIT if decode_sized else PREFILL_K_PER_SPLIT
    return max(1, in_features // per_split)


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
    partials: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """u[r, i * max_rank + j] = x[r] · a[slot, i, j] for every row r of every tile whose slot
    has a rank, and zero[r, :] = 0 for the rows of every tile (all its columns: the next
    projection may be wider).

    x [T, in]; a [slots, slices, max_rank, in], each slot contiguous; u and zero float32
    [>= T, >= slices * max_rank] with unit column stride; partials float32 with at least
    `workspace_floats(T, in, slices * max_rank, tile_rows, tile_bound)` elements and counters
    int32 [>= tile_bound], zero before the first launch (each launch leaves them zero): the
    splits' sum in split order. Without them (or where they are too small for this launch) the
    splits add into u atomically as they finish, u zero in the tiles' rows; tiles int32
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
    capacity = (tiles.shape[0] - 1) // 3
    bound = min(tile_bound, capacity)
    in_order = (
        partials is not None
        and counters is not None
        and partials.numel() >= split_k * bound * tile_rows * width
        and counters.numel() >= bound
    )
    if not in_order:  # pointers the kernel never follows
        partials, counters = u, tiles
    _launch_shrink(
        persistent_grid(tile_bound * split_k, x.device),
        x,
        a,
        u,
        zero,
        partials,
        counters,
        tiles,
        row_indices,
        slot_ranks,
        x.stride(0),
        a.stride(0),
        u_stride[0],
        TILE_CAPACITY=capacity,
        IN_ORDER=in_order,
        MAX_RANK=max_rank,
        BLOCK_M=tile_rows,
        num_warps=4,
        **constants,
        **pdl_options(u.device),
    )
