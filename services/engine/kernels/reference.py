"""Plain-PyTorch references of the Triton kernels in kernels/triton/ (float32 math, any device).

The GPU tests compare each Triton kernel with these; they are also the readable statement of
what each kernel computes. KV cache layout: [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): new_residual = x + residual (rounded to x's dtype), then RMSNorm."""
    summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hidden = summed.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype), summed


def swiglu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def rotary_cos_sin(head_dim: int, max_position: int, theta: float, device: torch.device | str):
    """cos and sin tables [max_position, head_dim // 2], float32 (rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rotary_ref(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its positions (Llama's rotate-half convention)."""
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def kv_store_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, kv_heads, head_dim] into the caches at slot_mapping; slot < 0 skips."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of query [T, heads, head_dim] over the paged cache (already written).

    Sequence b's queries are rows query_start_loc[b]:query_start_loc[b+1], at the last positions
    of its seq_lens[b] cached tokens. Returns [T, heads, head_dim] in query's dtype.
    """
    block_size = key_cache.shape[1]
    num_heads, kv_heads = query.shape[1], key_cache.shape[2]
    out = torch.zeros_like(query)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len = int(seq_lens[b])
        if end == start or seq_len == 0:
            continue
        positions = torch.arange(seq_len, device=query.device)
        slots = (
            block_tables[b, positions // block_size].long() * block_size + positions % block_size
        )
        keys = key_cache.flatten(0, 1)[slots].float()  # [S, kv_heads, D]
        values = value_cache.flatten(0, 1)[slots].float()
        keys = keys.repeat_interleave(num_heads // kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // kv_heads, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        q_positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        mask = positions[None, :] > q_positions[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(query.dtype)
    return out
