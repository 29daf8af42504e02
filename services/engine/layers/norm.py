"""RMSNorm with an optional fused residual add, the norm of every Llama-family block.

`forward(x, residual)` adds the residual first and returns (normed, new_residual): the same
contract as vLLM's fused kernel, so a CUDA backend can swap in one kernel for both steps.
The arithmetic follows Hugging Face (variance in float32, cast back before the weight), except
on CPU, where PyTorch's fused `rms_norm` applies the weight before the cast (bf16 results may
differ by one rounding step; float32 ones are the same). With fused kernels bound (`kernels`:
the native CPU ones, kernels/cpu/cpu_native.py, or the CUDA fast path's Triton kernel) the add
and the norm are one pass with those semantics. Under tensor parallelism a norm may take a
row-parallel projection's unsummed output and finish the sum first (`input_sum`): in one kernel
with the add and the norm where the GPUs allow (parallel/sum_norm.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.layers.fused_ops import FusedOps


class InputSum(Protocol):
    """A norm's input that is still one tensor-parallel rank's part of a row-parallel sum
    (parallel/weights.py, `defer_row_sums`): the norm finishes the sum first."""

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks."""
        ...

    def sum_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sum, the residual add and the norm in one kernel, or None where it does not
        apply (then `sum` and the norm run)."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels: FusedOps | None = None  # bound by the model runner
        self.input_sum: InputSum | None = None  # bound by tensor parallelism

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # PyTorch's fused kernel (float32 inside): one pass instead of six, 1.3-1.8x faster
            # on CPU; in float32 the same values as the steps below.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight * hidden.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); with no residual, (norm(x), x)."""
        if self.input_sum is not None:
            fused = self.input_sum.sum_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = self.input_sum.sum(x)
        kernels = self.kernels
        if kernels is not None and x.dim() == 2 and kernels.supports(x):
            return kernels.rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self.normalize(x), x
