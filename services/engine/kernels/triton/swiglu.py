"""SwiGLU activation: out = silu(gate) * up, reading the fused [gate | up] projection output.

The MLP's gate and up projections run as one matmul over concatenated weights; this kernel
reads that [T, 2 * I] result once and writes [T, I], instead of three elementwise passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import pdl_options, pdl_prologue


@triton.jit
def _swiglu_kernel(
    gate_up_ptr, out_ptr, intermediate_size, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < intermediate_size
    base = gate_up_ptr + row * 2 * intermediate_size
    gate = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + intermediate_size + offsets, mask=mask, other=0.0).to(tl.float32)
    activated = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(
        out_ptr + row * intermediate_size + offsets,
        activated.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [T, 2 * I]; returns [T, I]."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    intermediate_size = width // 2
    out = torch.empty((rows, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = 1024
    grid = (rows, triton.cdiv(intermediate_size, block))
    _swiglu_kernel[grid](
        gate_up, out, intermediate_size, BLOCK=block, num_warps=4, **pdl_options(out.device)
    )
    return out
