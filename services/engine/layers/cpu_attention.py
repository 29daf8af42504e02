"""Attention as batched matmuls around a float32 softmax: the CPU path of the torch backend.

PyTorch's CPU flash-attention kernel is poor for one query token and mediocre for short
prompts (measured on SmolLM2 in bf16, 2 threads: ~500 us a layer at batch 32 decode, where
these functions take ~150-250 us including the K/V gather; prefill chunks of 100-192 tokens
~2x faster). The softmax runs in float32 whatever the model dtype; masks are additive
float32 (0 / -inf) and every query row has at least one allowed key.

GQA layouts (H query heads, KVH key/value heads, G = H / KVH, heads ordered kv-major):
- `decode_all_heads`: keys of whole KV blocks, [B, L * KVH, D] as they lie in the cache (no
  per-head copy), scored against all H query heads in one matmul; a mask keeps each query head
  on its own KV head. KVH x the scoring work, so only for models with few KV heads.
- `decode_per_head`: keys gathered per (sequence, KV head) into [B, KVH, L, D].
- `prefill_matmul`: one chunk as [KVH, G * Q, D] x [KVH, D, K].
"""

from __future__ import annotations

import torch


def scaled_softmax(
    scores: torch.Tensor, scale: float, additive_mask: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """softmax(scores * scale + mask) over the last dim, computed in float32, returned in dtype.

    `scores` must be a fresh tensor (it is scaled in place when already float32). The mask
    broadcasts against `scores`.
    """
    scores = scores.float()
    scores.mul_(scale)
    if additive_mask is not None:
        scores.add_(additive_mask)
    return torch.softmax(scores, dim=-1).to(dtype)


def decode_all_heads(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    blocks: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over whole cache blocks.

    query [B, H, D]; key/value_blocks [num_blocks, block_size * KVH * D] (the cache viewed per
    block); blocks [B, N] block ids; mask [B, KVH, 1, N * block_size, KVH] additive float32
    (0 where query group h may see KV head h at that position). Returns [B, H, D].
    """
    batch, heads, dim = query.shape
    kv_heads = mask.shape[1]
    keys = key_blocks.index_select(0, blocks.view(-1)).view(batch, -1, dim).to(query.dtype)
    values = value_blocks.index_select(0, blocks.view(-1)).view(batch, -1, dim).to(query.dtype)
    scores = torch.matmul(query, keys.transpose(1, 2))  # [B, H, L * KVH]
    scores = scores.float()
    scores.mul_(scale)
    scores.view(batch, kv_heads, heads // kv_heads, -1, kv_heads).add_(mask)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.matmul(probs, values)


def decode_per_head(
    query: torch.Tensor,
    flat_keys: torch.Tensor,
    flat_values: torch.Tensor,
    rows: torch.Tensor,
    length: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence; K/V gathered per (sequence, KV head, position).

    query [B, H, D]; flat_keys/values [slots * KVH, D]; rows [B * KVH * length] indices into
    them; mask [B, 1, 1, length] additive float32 or None. Returns [B, H, D].
    """
    batch, heads, dim = query.shape
    kv_heads = rows.numel() // (batch * length)
    shape = (batch, kv_heads, length, dim)
    keys = flat_keys.index_select(0, rows).view(shape).to(query.dtype)
    values = flat_values.index_select(0, rows).view(shape).to(query.dtype)
    grouped = query.view(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2))  # [B, KVH, G, L]
    probs = scaled_softmax(scores, scale, mask, query.dtype)
    return torch.matmul(probs, values).view(batch, heads, dim)


def prefill_matmul(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One prefill chunk: queries [Q, H, D], keys/values [K, KVH, D], mask [Q, K] additive.

    Returns [Q, H, D].
    """
    num_queries, heads, dim = queries.shape
    num_keys, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    grouped = queries.view(num_queries, kv_heads, group, dim).permute(1, 2, 0, 3)
    grouped = grouped.reshape(kv_heads, group * num_queries, dim)
    scores = torch.matmul(grouped, keys.permute(1, 2, 0))  # [KVH, G * Q, K]
    scores = scores.view(kv_heads, group, num_queries, num_keys)
    probs = scaled_softmax(scores, scale, mask, queries.dtype)
    out = torch.matmul(probs.view(kv_heads, group * num_queries, num_keys), values.transpose(0, 1))
    out = out.view(kv_heads, group, num_queries, dim).permute(2, 0, 1, 3)
    return out.reshape(num_queries, heads, dim)
