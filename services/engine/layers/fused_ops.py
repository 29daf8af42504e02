"""FusedOps: the fused element-wise kernels a model's norms and activations may be bound to.

The native CPU kernels (kernels/cpu/cpu_native.py) and the CUDA fast path's Triton kernels
(backends/cuda_fast_path.py) both provide them, so one model definition runs either: a layer
calls the bound kernels where `supports(x)` says they apply, else its PyTorch ops.
"""

from __future__ import annotations

from typing import Protocol

import torch


class FusedOps(Protocol):
    def supports(self, x: torch.Tensor) -> bool:
        """Whether these kernels take `x` (its device, dtype and layout)."""
        ...

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) * weight, x + residual); with no residual, (norm(x), x)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
        ...
