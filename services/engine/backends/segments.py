"""The batchful segments of a Llama-family model, as modules an exporter can trace.

A decoder layer splits into a *batchful* part (every op is independent per token and holds the
parameters: norms, projections, MLP) and a *batchless* part (rotary embedding and attention over
the paged KV cache: no parameters, owned by the engine). The batchful part of each layer is two
segments, and the model ends in a third:

- `attn_in`: input RMSNorm and the fused QKV projection (with the q/k/v bias of Qwen2 and the
  per-head q/k norm of Qwen3), residual stream [T, hidden] -> qkv [T, q + 2 kv];
- `attn_out_mlp`: output projection, residual add, post-attention RMSNorm, SwiGLU MLP and the
  second residual add, (attention [T, q], residual [T, hidden]) -> residual [T, hidden];
- `head`: final RMSNorm and the LM head, residual rows [R, hidden] -> float32 logits [R, vocab].

Between segments the engine carries one residual stream (the sum the model's fused norms keep),
so the values are the same sums, in the same order, as models/llama.py computes. Every segment
sees one flat token dimension, so continuous batching and chunked prefill never change them.
The modules call the model's own submodules (no forked copy of the arithmetic) with their
fused kernels unbound, so they trace into plain ONNX operators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import InvalidArgumentError
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# Hugging Face architectures whose layers these segments reproduce exactly.
EXPORTABLE_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)


@dataclass(frozen=True)
class SegmentSpec:
    """One segment kind: its graph's input and output names and whether it repeats per layer."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    per_layer: bool


ATTN_IN = SegmentSpec("attn_in", ("residual",), ("qkv",), per_layer=True)
ATTN_OUT_MLP = SegmentSpec(
    "attn_out_mlp", ("attention", "residual"), ("residual_out",), per_layer=True
)
HEAD = SegmentSpec("head", ("residual",), ("logits",), per_layer=False)
SEGMENTS = (ATTN_IN, ATTN_OUT_MLP, HEAD)


def check_exportable(config: ModelConfig, model: nn.Module) -> None:
    """Raise InvalidArgumentError for a model family the segments do not reproduce."""
    if config.architecture not in EXPORTABLE_ARCHITECTURES or not isinstance(
        model, LlamaForCausalLM
    ):
        covered = ", ".join(sorted(EXPORTABLE_ARCHITECTURES))
        raise InvalidArgumentError(
            f"the ONNX exporter does not cover architecture {config.architecture!r} "
            f"(it covers {covered}); serve this model with backend 'torch'"
        )


class AttentionInput(nn.Module):
    """Input norm + fused QKV projection (+ per-head q/k norm) of one decoder layer."""

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        super().__init__()
        attention = layer.self_attn
        self.norm = layer.input_layernorm
        self.qkv_proj = attention.qkv_proj
        self.q_norm = attention.q_norm
        self.k_norm = attention.k_norm
        self.q_size = attention.q_size
        self.kv_size = attention.kv_size
        self.head_dim = attention.head_dim

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(self.norm.normalize(residual))
        if self.q_norm is None or self.k_norm is None:
            return qkv
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        tokens = residual.shape[0]
        query = self.q_norm.normalize(query.reshape(tokens, -1, self.head_dim))
        key = self.k_norm.normalize(key.reshape(tokens, -1, self.head_dim))
        return torch.cat(
            (query.reshape(tokens, self.q_size), key.reshape(tokens, self.kv_size), value), dim=-1
        )


class AttentionOutputMLP(nn.Module):
    """Output projection, residual add, post-attention norm, MLP and residual add."""

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        super().__init__()
        self.o_proj = layer.self_attn.o_proj
        self.norm = layer.post_attention_layernorm
        self.gate_up_proj = layer.mlp.gate_up_proj
        self.down_proj = layer.mlp.down_proj
        self.intermediate_size = layer.mlp.intermediate_size

    def forward(self, attention: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        residual = self.o_proj(attention) + residual
        gate_up = self.gate_up_proj(self.norm.normalize(residual))
        size = self.intermediate_size
        hidden = F.silu(gate_up[:, :size]) * gate_up[:, size:]
        return self.down_proj(hidden) + residual


class Head(nn.Module):
    """Final norm and LM head; float32 logits whatever the model's dtype."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.norm = model.model.norm
        self.weight = model.head_weight

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm.normalize(residual), self.weight).float()


def segment_module(model: LlamaForCausalLM, kind: str, layer: int = 0) -> nn.Module:
    """The traceable module of segment `kind` (of decoder layer `layer` where it repeats)."""
    if kind == ATTN_IN.kind:
        return AttentionInput(model.model.layers[layer])
    if kind == ATTN_OUT_MLP.kind:
        return AttentionOutputMLP(model.model.layers[layer])
    if kind == HEAD.kind:
        return Head(model)
    raise InvalidArgumentError(f"unknown segment kind {kind!r}")


def segment_inputs(config: ModelConfig, kind: str, tokens: int, **like) -> tuple[torch.Tensor, ...]:
    """Random example inputs of segment `kind` for `tokens` rows (dtype/device from `like`)."""
    q_size = config.num_heads * config.head_dim
    widths = {
        ATTN_IN.kind: (config.hidden_size,),
        ATTN_OUT_MLP.kind: (q_size, config.hidden_size),
        HEAD.kind: (config.hidden_size,),
    }
    if kind not in widths:
        raise InvalidArgumentError(f"unknown segment kind {kind!r}")
    return tuple(torch.randn(tokens, width, **like) for width in widths[kind])


def output_width(config: ModelConfig, kind: str) -> int:
    """Columns of segment `kind`'s one output."""
    if kind == ATTN_IN.kind:
        return (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    if kind == ATTN_OUT_MLP.kind:
        return config.hidden_size
    if kind == HEAD.kind:
        return config.vocab_size
    raise InvalidArgumentError(f"unknown segment kind {kind!r}")


def spec(kind: str) -> SegmentSpec:
    for segment in SEGMENTS:
        if segment.kind == kind:
            return segment
    raise InvalidArgumentError(f"unknown segment kind {kind!r}")
