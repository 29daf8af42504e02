"""SwiGLU activation over a fused gate/up projection: silu(gate) * up (one pass when the model
runner binds fused kernels: the native CPU ones, kernels/cpu/cpu_native.py, or Triton's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.layers.fused_ops import FusedOps


class SiluAndMul(nn.Module):
    """Split the last dimension in halves [gate, up] and return silu(gate) * up."""

    kernels: FusedOps | None = None  # bound by the model runner

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        kernels = self.kernels
        if kernels is not None and gate_up.dim() == 2 and kernels.supports(gate_up):
            return kernels.silu_mul(gate_up)
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :half]) * gate_up[..., half:]
