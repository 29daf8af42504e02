"""One adapter's weights in the engine's fused layout, ready to be copied into a device slot.

For every decoder layer and each of the four fused projections the adapter touches: A holds one
[rank, in] block per slice (q|k|v, or gate|up; a slice the adapter leaves out is zeros) and B
the [out, rank] rows of the whole fused output, with the module's scale (alpha/r or
alpha/sqrt(r)) already multiplied in, so the serving math is `y += (x Aᵀ) Bᵀ` per slice and
carries no per-module scale. Ranks are padded with zeros to the adapter's largest module rank;
zero rows and columns add exactly nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProjectionWeights:
    """A [num_slices, rank, in] and B [out, rank] of one fused projection of one layer."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class AdapterWeights:
    """Host copy of an adapter: per layer, the projections it touches."""

    name: str
    checksum: str
    rank: int  # the largest module rank; every A/B here is padded to it
    modules: frozenset[str]  # the PEFT modules it trained (q_proj, ..., down_proj)
    layers: tuple[dict[str, ProjectionWeights], ...]
    # The same factors stacked over layers per projection (A [layers, slices, rank, in], B
    # [layers, out, rank]; zeros in layers the adapter leaves out), `layers` then being views
    # of them: a device slot takes each in one copy (services/engine/lora/slots.py).
    stacked: dict[str, ProjectionWeights] | None = None

    @property
    def nbytes(self) -> int:
        return sum(
            weights.a.nbytes + weights.b.nbytes
            for layer in self.layers
            for weights in layer.values()
        )

    def projections(self) -> frozenset[str]:
        """The fused projections that this adapter changes in at least one layer."""
        return frozenset(name for layer in self.layers for name in layer)


def stack_layers(weights: AdapterWeights, *, pin: bool) -> AdapterWeights:
    """`weights` with its factors stacked over layers (in pinned host memory with `pin`; the
    `layers` become views of the stacks), for one copy per projection and factor."""
    stacks: dict[str, ProjectionWeights] = {}
    count = len(weights.layers)
    for name in sorted(weights.projections()):
        first = next(layer[name] for layer in weights.layers if name in layer)
        a = torch.zeros((count, *first.a.shape), dtype=first.a.dtype, pin_memory=pin)
        b = torch.zeros((count, *first.b.shape), dtype=first.b.dtype, pin_memory=pin)
        for index, layer in enumerate(weights.layers):
            if name in layer:
                a[index].copy_(layer[name].a)
                b[index].copy_(layer[name].b)
        stacks[name] = ProjectionWeights(a, b)
    layers = tuple(
        {name: ProjectionWeights(stacks[name].a[index], stacks[name].b[index]) for name in layer}
        for index, layer in enumerate(weights.layers)
    )
    return AdapterWeights(
        weights.name, weights.checksum, weights.rank, weights.modules, layers, stacks
    )
