"""SwiGLU activation over a fused gate/up projection: silu(gate) * up (one native pass on CPU
when the model runner binds the native kernels, kernels/cpu_native.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.kernels.cpu.cpu_native import CpuKernels


class SiluAndMul(nn.Module):
    """Split the last dimension in halves [gate, up] and return silu(gate) * up."""

    cpu_kernels: CpuKernels | None = None  # bound by the model runner on CPU

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        kernels = self.cpu_kernels
        if kernels is not None and gate_up.dim() == 2 and kernels.supports(gate_up):
            return kernels.silu_mul(gate_up)
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :half]) * gate_up[..., half:]
