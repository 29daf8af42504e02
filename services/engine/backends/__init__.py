"""Attention backends, chosen by name from a registry: "torch" (any device) here, "cuda" later.

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
