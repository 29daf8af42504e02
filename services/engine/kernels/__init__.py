"""Triton kernels of the CUDA fast path, one kernel per module, each with a PyTorch reference.

Modules: rms_norm (fused residual add + RMSNorm), swiglu (silu(gate) * up), rotary_kv_store
(rotary embedding of q/k fused with the paged KV-cache write), decode_attention (split-K
flash-decoding over the paged cache), prefill_attention (varlen causal attention over a cached
prefix), reference (plain-PyTorch versions of all of them). Triton is imported only by the
kernel modules, so this package imports on machines without it.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """True when Triton can be imported (it is not a dependency of the CPU path)."""
    return importlib.util.find_spec("triton") is not None
