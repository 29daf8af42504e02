"""The "cuda" attention backend of the registry: Triton paged-attention kernels on the GPU.

Registered as "cuda" (base.py imports this module lazily, so CPU machines never import
Triton). Each layer's forward stores the step's K/V with the store kernel, then runs the
split-K decode kernel for pure-decode steps or the varlen causal prefill kernel (cached prefix,
mixed batches) otherwise; dispatch lives in cuda_attention.CudaPagedAttention. With rotary
tables bound (the CUDA fast path), `forward_rotary` rotates q/k in the store kernel itself,
and adds a LoRA delta awaiting the QKV output there (`epilogues`: services/engine/lora/fused.py).
"""

from __future__ import annotations

import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.engine.backends.base import AttentionBackend, register_backend
from services.engine.backends.cuda_attention import CudaPagedAttention
from services.engine.kernels.triton.lora_epilogue import EpilogueSource
from services.engine.kernels.triton.rotary_kv_store import rotary_kv_store
from services.engine.layers.attention_metadata import AttentionMetadata


@register_backend("cuda")
class CudaAttentionBackend(AttentionBackend):
    """Paged attention through Triton; caches must live on a CUDA device."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise InvalidArgumentError(
                f"the cuda backend needs a power-of-two head_dim >= 16, got {head_dim}"
            )
        self._attention = CudaPagedAttention()
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self.epilogues: EpilogueSource | None = None  # set by the fast path with LoRA bound

    def bind_rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate q/k in the KV-store kernel from now on: cos/sin float32 [positions, D // 2]."""
        self._cos, self._sin = cos, sin
        self.fuses_rotary = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if not key_cache.is_cuda:
            raise InvalidArgumentError("the cuda attention backend needs the KV cache on CUDA")
        self._attention.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        return self._attention.forward(query, key_cache, value_cache, metadata, self.scale)

    def forward_rotary(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self._cos is None or self._sin is None:
            raise FailedPreconditionError("the cuda backend has no rotary tables bound")
        lora = None if self.epilogues is None else self.epilogues.take(query)
        query = rotary_kv_store(
            query, key, value, positions, self._cos, self._sin, metadata.slot_mapping,
            key_cache, value_cache, lora=lora,
        )  # fmt: skip
        return self._attention.forward(query, key_cache, value_cache, metadata, self.scale)
