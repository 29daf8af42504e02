"""Fused residual add + RMSNorm: one read of x and residual, one write of each output.

Llama runs `residual = x + residual; x = rms_norm(residual) * weight` twice per layer; fusing
the add into the norm saves two passes over the hidden states, which matters in decode where
every step is a chain of small memory-bound kernels. x may be a row view of a wider tensor
(unit column stride); with a `LoRAEpilogue` (kernels/triton/lora_epilogue.py) each row of x
first gets its adapter's delta, read from the columns the projection's matmul wrote beside it;
with `LoRADeltas`, the delta the LoRA kernels wrote beside the matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import CachedLaunch, pdl_options, pdl_prologue
from services.engine.kernels.triton.lora_epilogue import (
    LoRADeltas,
    LoRAEpilogue,
    check,
    delta_args,
    epilogue_args,
    lora_delta,
    row_rank,
    split_deltas,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden_size,
    x_stride,
    eps,
    u_ptr,
    u_stride,
    bt_ptr,
    rows_on_ptr,
    rank_ptr,
    delta_ptr,
    delta_stride,
    HAS_RESIDUAL: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    SLICE_WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < hidden_size
    x = tl.load(x_ptr + row * x_stride + offsets, mask=mask, other=0.0)
    if HAS_LORA:
        rank = row_rank(rows_on_ptr, rank_ptr, row)
        u_row = u_ptr + row * u_stride
        x = x.to(tl.float32)
        x += lora_delta(u_row, bt_ptr, hidden_size, offsets, mask, rank, SLICE_WIDTH)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * delta_stride + offsets, mask=mask, other=0.0)
        x = x.to(tl.float32) + delta.to(tl.float32)
    if (HAS_LORA or HAS_DELTA) and not HAS_RESIDUAL:
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden_size + offsets, x, mask=mask)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * hidden_size + offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden_size + offsets, x, mask=mask)
    out_row = out_ptr + row * hidden_size
    store_normed(out_row, weight_ptr, x.to(tl.float32), offsets, mask, hidden_size, eps)


@triton.jit
def store_normed(out_ptr, weight_ptr, values, offsets, mask, hidden_size, eps):
    """Store one row's rms_norm(values) * weight (values float32, masked lanes 0; out_ptr at
    the row); the arithmetic every fused norm kernel shares, so their results are the same."""
    variance = tl.sum(values * values, axis=0) / hidden_size
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    normed = values * tl.rsqrt(variance + eps) * weight
    tl.store(out_ptr + offsets, normed.to(out_ptr.dtype.element_ty), mask=mask)


# Launched without Triton's JIT dispatch after the first time (launch.py): eager steps
# launch these once or twice a layer.
_launch_rms_norm = CachedLaunch(_rms_norm_kernel)


def norm_warps(block: int) -> int:
    """Warps of a one-row-a-program norm kernel over `block` lanes: 256 lanes a warp, 1 to 16."""
    return min(16, max(1, block // 256))


def rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    lora: LoRAEpilogue | LoRADeltas | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) for x [T, H]; new_residual = x + residual, or x when None.

    With `lora`, x + each row's LoRA delta stands for x (and is the new residual when there is
    none)."""
    lora, deltas = split_deltas(lora)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, hidden_size = x.shape
    out = torch.empty((rows, hidden_size), dtype=x.dtype, device=x.device)
    if residual is None and lora is None and deltas is None:
        residual_out = x
    else:
        residual_out = torch.empty_like(out)
    if residual is not None:
        residual = residual.contiguous()
    if rows == 0:
        return out, residual_out
    if lora is not None:
        check(lora, rows, hidden_size, 1)
    lora_args, lora_options = epilogue_args(x, lora)
    extra_args, extra_options = delta_args(x, deltas, rows, hidden_size)
    block = triton.next_power_of_2(hidden_size)
    _launch_rms_norm(
        (rows,),
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out,
        hidden_size,
        x.stride(0),
        eps,
        *lora_args,
        *extra_args,
        HAS_RESIDUAL=residual is not None,
        **lora_options,
        **extra_options,
        BLOCK=block,
        num_warps=norm_warps(block),
        **pdl_options(x.device),
    )
    return out, residual_out
