"""Where a LoRA adapter can act in a Llama-family layer, in the engine's fused layout.

PEFT trains the seven separate projections (q/k/v/o, gate/up/down); the engine runs q|k|v as
one fused `qkv_proj` and gate|up as one `gate_up_proj` (services/engine/models/llama.py). An
adapter's module is therefore a *slice* of a fused projection: q_proj is slice 0 of qkv_proj,
up_proj slice 1 of gate_up_proj. Each slice owns a contiguous block of the projection's output
rows and its own low-rank factors, so adapters on any subset of the seven modules map onto the
four projections exactly (a module the adapter leaves out is a zero slice). Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.models.config import ModelConfig

# PEFT module name → (engine projection, slice index within it).
MODULE_TO_SLICE: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# The parent module of each PEFT module inside a decoder layer.
MODULE_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
SUPPORTED_MODULES = frozenset(MODULE_TO_SLICE)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ProjectionShape:
    """One fused projection: its input width and the output widths of its slices, in order."""

    name: str
    in_features: int
    slice_sizes: tuple[int, ...]

    @property
    def num_slices(self) -> int:
        return len(self.slice_sizes)

    @property
    def out_features(self) -> int:
        return sum(self.slice_sizes)

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        """Start row of each slice in the fused output, plus the total at the end."""
        offsets = [0]
        for size in self.slice_sizes:
            offsets.append(offsets[-1] + size)
        return tuple(offsets)


def projection_shapes(config: ModelConfig) -> dict[str, ProjectionShape]:
    """The four projections of every decoder layer of `config`, keyed by engine name."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": ProjectionShape("qkv_proj", hidden, (q_size, kv_size, kv_size)),
        "o_proj": ProjectionShape("o_proj", q_size, (hidden,)),
        "gate_up_proj": ProjectionShape("gate_up_proj", hidden, (intermediate, intermediate)),
        "down_proj": ProjectionShape("down_proj", intermediate, (hidden,)),
    }


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one PEFT module of `config`."""
    projection, index = MODULE_TO_SLICE[module]
    shape = projection_shapes(config)[projection]
    return shape.in_features, shape.slice_sizes[index]
