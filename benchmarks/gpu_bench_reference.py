"""A float32 dense Llama forward, the yardstick of benchmarks.gpu_bench's correctness check.

Plain PyTorch over one sequence with a causal mask (no paged cache, no fused kernels), reading
the engine model's own (fused) parameters and the fast path's rotary tables; each layer's
weights are upcast to float32 on the fly, so an 8B model needs no float32 copy of itself. The
check compares both the fast path and transformers' bf16 model against it.
"""

from __future__ import annotations

import torch

from services.engine.kernels.reference import apply_rotary_ref


def llama_reference_logits(
    model: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor, tokens: list[int]
) -> torch.Tensor:
    """float32 logits [len(tokens), vocab] of one sequence through models/llama's `model`."""
    config = model.config
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    eps = config.rms_norm_eps
    embed = model.model.embed_tokens.weight
    ids = torch.tensor(tokens, device=embed.device)
    positions = torch.arange(len(tokens), device=ids.device)
    hidden = embed[ids].float()

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()

    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        qkv = norm(hidden, layer.input_layernorm.weight) @ attention.qkv_proj.weight.float().T
        query, key, value = qkv.split([heads * head_dim] + [kv_heads * head_dim] * 2, -1)
        query = apply_rotary_ref(query.view(-1, heads, head_dim), positions, cos, sin)
        key = apply_rotary_ref(key.view(-1, kv_heads, head_dim), positions, cos, sin)
        value = value.view(-1, kv_heads, head_dim)
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        attended = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        hidden = hidden + attended.reshape(len(tokens), -1) @ attention.o_proj.weight.float().T
        normed = norm(hidden, layer.post_attention_layernorm.weight)
        gate, up = (normed @ mlp.gate_up_proj.weight.float().T).chunk(2, dim=-1)
        hidden = hidden + (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.float().T
    return norm(hidden, model.model.norm.weight) @ model.head_weight.float().T
