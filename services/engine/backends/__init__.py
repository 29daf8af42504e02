"""Attention backends, chosen by name from a registry: "torch" (any device, the CPU path) and
"cuda" (Triton paged attention), plus the CUDA fast path that binds Triton kernels to the model.

A backend writes each step's new K/V into the paged cache and computes attention for a flat,
unpadded batch described by AttentionMetadata. The model code never knows which one runs.
"""

from __future__ import annotations

from services.engine.backends.base import (
    AttentionBackend,
    available_backends,
    get_backend,
    register_backend,
)

__all__ = ["AttentionBackend", "available_backends", "get_backend", "register_backend"]
