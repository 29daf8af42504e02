"""SwiGLU activation: out = silu(gate) * up, reading the fused [gate | up] projection output.

The MLP's gate and up projections run as one matmul over concatenated weights; this kernel
reads that [T, 2 * I] result once and writes [T, I], instead of three elementwise passes. The
input may be a row view of a wider tensor; with a `LoRAEpilogue` (kernels/triton/lora_epilogue.py)
gate and up first get each row's adapter delta (slices 0 and 1 of u).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import CachedLaunch, pdl_options, pdl_prologue
from services.engine.kernels.triton.lora_epilogue import (
    LoRAEpilogue,
    block_options,
    block_ranks,
    check,
    lora_block_delta,
)


@triton.jit
def _swiglu_kernel(
    gate_up_ptr, out_ptr, intermediate_size, row_stride, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < intermediate_size
    base = gate_up_ptr + row * row_stride
    gate = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + intermediate_size + offsets, mask=mask, other=0.0).to(tl.float32)
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


_launch_swiglu_lora = CachedLaunch(_swiglu_lora_kernel)
_launch_swiglu = CachedLaunch(_swiglu_kernel)


def swiglu(gate_up: torch.Tensor, lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2 * I]; returns [T, I]. With
    `lora`, gate_up + each row's LoRA delta stands for gate_up."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    intermediate_size = width // 2
    out = torch.empty((rows, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    pdl = pdl_options(out.device)
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
    _launch_swiglu(
        grid, gate_up, out, intermediate_size, gate_up.stride(0), BLOCK=block, num_warps=4, **pdl
    )
    return out
