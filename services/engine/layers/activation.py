"""SwiGLU activation over a fused gate/up projection: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """Split the last dimension in halves [gate, up] and return silu(gate) * up."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :half]) * gate_up[..., half:]
