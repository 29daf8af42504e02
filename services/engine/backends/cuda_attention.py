"""The "cuda" attention backend: paged attention through the Triton kernels in kernels/triton/.

Pure-decode steps use the split-K decode kernel (split count fixed by batch size, so CUDA
graphs stay valid as contexts grow); any step with a prefill chunk uses the varlen causal
prefill kernel, which also serves the decode rows of a mixed batch. Keys and values must be
in the cache before `forward` (`store_kv`, or the fused rotary + store kernel).
"""

from __future__ import annotations

import torch

from services.engine.kernels.triton.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
)
from services.engine.kernels.triton.prefill_attention import paged_prefill_attention
from services.engine.kernels.triton.rotary_kv_store import rotary_kv_store
from services.engine.layers.attention_metadata import AttentionMetadata


class CudaPagedAttention:
    """Stateless attention over the paged KV cache ([num_blocks, block_size, kv_heads, dim])."""

    name = "cuda"

    def __init__(self, num_sms: int | None = None) -> None:
        if num_sms is None and torch.cuda.is_available():
            num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.num_sms = num_sms or 132

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write key/value [T, kv_heads, head_dim] at slot_mapping (already rotated)."""
        positions = torch.zeros_like(slot_mapping)
        half = key_cache.shape[-1] // 2
        unit = torch.ones((1, half), dtype=torch.float32, device=key.device)
        rotary_kv_store(
            key, key, value, positions, unit, unit * 0, slot_mapping, key_cache, value_cache,
            rotate=False,
        )  # fmt: skip

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention output [T, heads, head_dim] for query [T, heads, head_dim]."""
        if metadata.is_pure_decode:
            batch = query.shape[0]
            splits = choose_num_splits(batch, key_cache.shape[2], self.num_sms)
            return paged_decode_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                num_splits=splits,
            )
        return paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.max_query_len,
            scale,
        )
