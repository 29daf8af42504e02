"""SwiGLU activation: out = silu(gate) * up, reading the fused [gate | up] projection output.

The MLP's gate and up projections run as one matmul over concatenated weights; this kernel
reads that [T, 2 * I] result once and writes [T, I], instead of three elementwise passes. The
input may be a row view of a wider tensor; with a `LoRAEpilogue` (kernels/triton/lora_epilogue.py)
gate and up first get each row's adapter delta (slices 0 and 1 of u). With `LoRATiles` (a step
of several adapters) the kernel walks the step's tiles of rows instead, each tile's gate and up
getting u times its slot's B (as lora_expand computes it): the deltas never go through memory.
With `LoRADeltas` gate and up first get the deltas the LoRA kernels wrote beside the matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import (
    CachedLaunch,
    pdl_launch_next,
    pdl_options,
    pdl_prologue,
    pdl_wait,
)
from services.engine.kernels.triton.lora_epilogue import (
    Epilogue,
    LoRATiles,
    block_options,
    block_ranks,
    check,
    delta_args,
    lora_block_delta,
    split_deltas,
)
from services.engine.kernels.triton.lora_shrink import (
    persistent_grid,
    pow2_at_least,
    tile_layout,
)

TILES_BLOCK_N = 128  # intermediate columns a work item of the tiles kernel covers


@triton.jit
def _swiglu_kernel(
    gate_up_ptr, out_ptr, intermediate_size, row_stride, delta_ptr, delta_stride,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < intermediate_size
    base = gate_up_ptr + row * row_stride
    gate = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + intermediate_size + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:  # each row's LoRA delta, written beside the matmul
        deltas = delta_ptr + row * delta_stride + offsets
        gate += tl.load(deltas, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(deltas + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    activated = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        out_ptr + row * intermediate_size + offsets,
        activated.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _swiglu_lora_kernel(
    gate_up_ptr,
    out_ptr,
    intermediate_size,
    row_stride,
    num_rows,
    u_ptr,
    u_stride,
    bt_ptr,
    rows_on_ptr,
    rank_ptr,
    SLICE_WIDTH: tl.constexpr,
    R_P: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """SwiGLU of a block of rows with each row's LoRA delta added to gate and up first."""
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    column_mask = columns < intermediate_size
    ranks, top = block_ranks(rows_on_ptr, rank_ptr, rows, row_mask)
    mask = row_mask[:, None] & column_mask[None, :]
    base = gate_up_ptr + rows[:, None].to(tl.int64) * row_stride + columns[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    width = 2 * intermediate_size
    gate += lora_block_delta(
        u_ptr, u_stride, rows, row_mask, ranks, top, bt_ptr, width, columns, column_mask,
        SLICE_WIDTH, R_P, IEEE,
    )  # fmt: skip
    up += lora_block_delta(
        u_ptr + SLICE_WIDTH, u_stride, rows, row_mask, ranks, top, bt_ptr, width,
        intermediate_size + columns, column_mask, SLICE_WIDTH, R_P, IEEE,
    )  # fmt: skip
    activated = gate / (1.0 + tl.exp(-gate)) * up
    out = out_ptr + rows[:, None].to(tl.int64) * intermediate_size + columns[None, :]
    tl.store(out, activated.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_tiles_kernel(
    gate_up_ptr,
    out_ptr,
    u_ptr,
    b_ptr,
    tiles_ptr,
    row_indices_ptr,
    slot_ranks_ptr,
    intermediate_size,
    num_blocks,
    row_limit,
    row_stride,
    stride_um,
    stride_bs,
    stride_bo,
    TILE_CAPACITY: tl.constexpr,
    MAX_RANK: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """SwiGLU of each tile's rows, gate and up first getting u · B[slot]ᵀ (a work item: one
    tile, one block of intermediate columns; a persistent grid, the item count read on the
    device, as lora_expand's)."""
    pdl_launch_next(USE_PDL)
    num_items = tl.load(tiles_ptr) * num_blocks
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    item = tl.program_id(0)
    while item < num_items:
        # The layout and the slots' B are written before the kernel before this one began:
        # read before the wait. u and gate_up after it.
        tile = item // num_blocks
        block = item % num_blocks
        slot, rank, rows, mask_m = tile_layout(
            tiles_ptr, row_indices_ptr, slot_ranks_ptr, tile, offs_m, TILE_CAPACITY
        )
        mask_m &= rows < row_limit  # fill rows past an eager step's own (KernelTiles)
        columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = columns < intermediate_size
        mask_r = offs_r < rank  # the slot's real rank: its padding is never read
        b_mask = mask_r[:, None] & mask_n[None, :]
        b_rows = b_ptr + slot * stride_bs + offs_r[:, None]
        b_gate = tl.load(b_rows + columns[None, :] * stride_bo, mask=b_mask, other=0.0)
        b_up = tl.load(
            b_rows + (intermediate_size + columns)[None, :] * stride_bo, mask=b_mask, other=0.0
        )
        pdl_wait(USE_PDL)
        mask = mask_m[:, None] & mask_n[None, :]
        base = gate_up_ptr + rows[:, None] * row_stride + columns[None, :]
        gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + intermediate_size, mask=mask, other=0.0).to(tl.float32)
        if rank > 0:
            u_rows = u_ptr + rows[:, None] * stride_um + offs_r[None, :]
            u_mask = mask_m[:, None] & mask_r[None, :]
            u_gate = tl.load(u_rows, mask=u_mask, other=0.0)
            u_up = tl.load(u_rows + MAX_RANK, mask=u_mask, other=0.0)
            if IEEE:
                gate += tl.dot(u_gate, b_gate, input_precision="ieee")
                up += tl.dot(u_up, b_up, input_precision="ieee")
            else:  # u rounded to B's dtype, as a LoRA layer in that dtype computes it
                gate += tl.dot(u_gate.to(b_gate.dtype), b_gate)
                up += tl.dot(u_up.to(b_up.dtype), b_up)
        activated = gate / (1.0 + tl.exp(-gate)) * up
        out = out_ptr + rows[:, None] * intermediate_size + columns[None, :]
        tl.store(out, activated.to(out_ptr.dtype.element_ty), mask=mask)
        item += tl.num_programs(0)
    pdl_wait(USE_PDL)  # never end before the kernel before this one


_launch_swiglu_lora = CachedLaunch(_swiglu_lora_kernel)
_launch_swiglu_tiles = CachedLaunch(_swiglu_tiles_kernel)
_launch_swiglu = CachedLaunch(_swiglu_kernel)


def swiglu(gate_up: torch.Tensor, lora: Epilogue | None = None) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2 * I]; returns [T, I]. With
    `lora`, gate_up + each row's LoRA delta stands for gate_up (LoRATiles: every row of the
    step must be in one of its tiles; the tiles kernel writes only those)."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    intermediate_size = width // 2
    out = torch.empty((rows, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    pdl = pdl_options(out.device)
    if isinstance(lora, LoRATiles):
        _swiglu_tiles(gate_up, out, lora, pdl)
        return out
    lora, deltas = split_deltas(lora)
    if lora is not None:
        check(lora, rows, width, 2)
        block_m, block = 16, 128
        grid = (triton.cdiv(rows, block_m), triton.cdiv(intermediate_size, block))
        _launch_swiglu_lora(grid,
            gate_up, out, intermediate_size, gate_up.stride(0), rows, *lora.kernel_args(),
            **block_options(lora), BLOCK_M=block_m, BLOCK=block, num_warps=4, **pdl,
        )  # fmt: skip
        return out
    block = 1024
    grid = (rows, triton.cdiv(intermediate_size, block))
    extra_args, extra_options = delta_args(gate_up, deltas, rows, width)
    _launch_swiglu(grid,
        gate_up, out, intermediate_size, gate_up.stride(0), *extra_args, **extra_options,
        BLOCK=block, num_warps=4, **pdl,
    )  # fmt: skip
    return out


def _swiglu_tiles(
    gate_up: torch.Tensor, out: torch.Tensor, lora: LoRATiles, pdl: dict[str, bool]
) -> None:
    """The tiles kernel over the step's tiles (see swiglu)."""
    rows, width = gate_up.shape
    intermediate_size = width // 2
    u, b = lora.u, lora.b
    _, out_features, max_rank = b.shape
    if out_features != width or b.stride(2) != 1 or u.stride(1) != 1:
        raise ValueError(f"B {tuple(b.shape)} and u do not fit a gate_up output of {width}")
    if u.shape[0] < rows or u.shape[1] < 2 * max_rank:
        raise ValueError(f"u {tuple(u.shape)} holds no two slices for {rows} rows")
    num_blocks = triton.cdiv(intermediate_size, TILES_BLOCK_N)
    _launch_swiglu_tiles(
        persistent_grid(lora.tile_bound * num_blocks, gate_up.device),
        gate_up,
        out,
        u,
        b,
        lora.tiles,
        lora.row_indices,
        lora.slot_ranks,
        intermediate_size,
        num_blocks,
        rows,
        gate_up.stride(0),
        u.stride(0),
        b.stride(0),
        b.stride(1),
        TILE_CAPACITY=(lora.tiles.shape[0] - 1) // 3,
        MAX_RANK=max_rank,
        IEEE=gate_up.dtype == torch.float32,
        BLOCK_M=lora.tile_rows,
        BLOCK_N=TILES_BLOCK_N,
        BLOCK_R=pow2_at_least(max_rank),
        num_warps=4,
        **pdl,
    )
