"""Attach a LoRARuntime to an `nn.Module` Llama model without touching the model's code.

Each decoder layer's four fused projections (qkv_proj, o_proj, gate_up_proj, down_proj) are
wrapped in a `LoRALinear` that runs the original module (plain or oneDNN-packed) and then adds
the step's adapter deltas in place. Wrap after packing (services/engine/layers/linear.py), so
the packed layers stay what runs the base matmul.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from services.engine.lora.runtime import LoRARuntime

# Decoder layer attribute path of each projection.
_PROJECTION_PATHS = {
    "qkv_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


class LoRALinear(nn.Module):
    """`y = base(x)` with each row's adapter delta added by the runtime (LoRARuntime.project)."""

    def __init__(self, base: nn.Module, runtime: LoRARuntime, layer: int, projection: str):
        super().__init__()
        self.base = base
        self.runtime = runtime
        self.layer = layer
        self.projection = projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runtime.project(self.layer, self.projection, x, self.base)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, projection={self.projection}"


def projection_modules(model: nn.Module) -> Iterator[tuple[int, str, nn.Module, str]]:
    """(layer index, projection, parent module, attribute) of every decoder layer's four
    projections in `model.model.layers`, in order."""
    for index, layer in enumerate(model.get_submodule("model.layers")):
        for projection, (parent_name, child) in _PROJECTION_PATHS.items():
            yield index, projection, layer.get_submodule(parent_name), child


def attach_lora(model: nn.Module, runtime: LoRARuntime) -> int:
    """Wrap the projections of every layer of `model.model.layers`; how many were wrapped."""
    layers = model.get_submodule("model.layers")
    if len(layers) != runtime.slots.num_layers:
        raise ValueError(
            f"model has {len(layers)} layers, the LoRA slots {runtime.slots.num_layers}"
        )
    wrapped = 0
    for index, projection, parent, child in projection_modules(model):
        module = getattr(parent, child)
        if isinstance(module, LoRALinear):
            module.runtime = runtime
            continue
        setattr(parent, child, LoRALinear(module, runtime, index, projection))
        wrapped += 1
    return wrapped
