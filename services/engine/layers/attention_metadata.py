"""Tensors that describe one step's sequences to the attention implementation.

Built once per step by the model runner from a ScheduledBatch and shared by all layers.
KV cache layout (every backend, CPU and CUDA): per layer two tensors, key and value, each
[num_blocks, block_size, num_kv_heads, head_dim]; token slot = block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Flat-batch description; B = sequences in the step, T = tokens computed in the step."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written in the cache
    query_start_loc: torch.Tensor  # [B + 1] int32: token offsets of each sequence in the batch
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step (prefix + new)
    context_lens: torch.Tensor  # [B] int32: tokens already cached before this step (start_position)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each sequence's blocks
    max_query_len: int
    max_seq_len: int
    is_pure_decode: bool  # every sequence computes exactly one token
    logits_indices: torch.Tensor  # [num_logits] int64: rows of the flat hidden states to project
    block_size: int = 16  # tokens per KV block (slot = block_id * block_size + offset)
    # The same lengths as Python lists, so host-side planning never waits on the device.
    query_start_loc_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    context_lens_host: list[int] = field(default_factory=list)
    # Per-step scratch of the attention backend: its prepare() fills it once per step (gather
    # indices, masks, host-side lengths) and every layer reads it.
    backend_state: dict[str, Any] = field(default_factory=dict)
