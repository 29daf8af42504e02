"""Decode steps of one adapter with no LoRA kernel of their own: the math inside the base kernels.

A decode step's LoRA work is tiny (a rank-16 adapter's factors are ~0.5 % of an 8B model's
weights), yet as two kernels per projection (shrink, expand) it costs a GPU ~4 µs a launch,
128 projections a step: ~1 ms over an 8 ms step. When every adapter row of a step uses the
same adapter (the common case of one fine-tune serving a batch), both kernels fold into
kernels the step runs anyway:

- the shrink into the base matmul: each projection's weight is stored with room for one
  adapter's A below it (`[W; A]`, [out + slices·R, in], R the slots' largest rank), so one
  matmul gives y = x Wᵀ and, in the columns after it, u = x Aᵀ. The model's own weight is a
  view of the first `out` rows, so every other step computes exactly what it did. The runner
  gives the weights this room at load (`widen_for_fold`), before the KV cache is sized and any
  graph captured, so the model's weights are never held twice;
- the expand into the kernel that reads y next (kernels/triton/lora_epilogue.py): the fused
  residual add + RMSNorm after o_proj and down_proj, SwiGLU after gate_up_proj, the rotary +
  KV-cache store after qkv_proj add each element's `u Bᵀ` as they load it. Bᵀ of the adapter
  is kept contiguous per projection, [layers, R, out].

`activate(slot)` copies that slot's A, Bᵀ and ranks in (one batched copy of every layer's
factors, only when the step's adapter or the slot's contents changed) and `prepare` marks the
step's rows of the adapter (rows of the base model and a graph's padding add nothing). While the
"lora-one" decode graphs are captured (`capturing`), LoRARuntime.project hands each projection
here; the consumer kernels `take` the delta that awaits them. A projection whose delta no kernel
took fails the capture (the runner then keeps the other graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch
from torch import nn

from services.engine.kernels.triton.lora_epilogue import LoRAEpilogue
from services.engine.lora.batch import LoRABatch
from services.engine.lora.projections import projection_shapes
from services.engine.lora.slots import LoRASlots
from services.engine.lora.wrap import projection_modules
from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)


class WideningProjection(Protocol):
    """A base projection that runs `x Wᵀ` with a weight it is handed (the CUDA fast path's
    TunedLinear): its own `weight` [out, in], no bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def forward_with(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


def fusable(base: nn.Module, out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether `base` can carry an adapter's A below its weight (see WideningProjection)."""
    return (
        callable(getattr(base, "forward_with", None))
        and _plain(base, out_features, in_features)
        and base.weight.dtype == dtype
    )


def _plain(module: nn.Module, out_features: int, in_features: int) -> bool:
    """Whether `module` is x Wᵀ with a contiguous weight [out_features, in_features]."""
    weight = getattr(module, "weight", None)
    return (
        getattr(module, "bias", None) is None
        and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (out_features, in_features)
        and weight.is_contiguous()
    )


def widen_for_fold(
    model: nn.Module, config: ModelConfig, rank: int
) -> dict[tuple[int, str], torch.Tensor]:
    """Store each projection weight of `model` with room for one adapter's A of `rank` rows a
    slice below it, right after load: the weight becomes a view of the first rows of a
    zero-tailed [out + slices·rank, in] buffer. Done before the KV cache is sized and any graph
    captured, the old weight is freed at once and nothing holds the model's weights twice.
    Returns the buffers by (layer, projection), for FusedDecode.bind; none when a projection
    is not a plain x Wᵀ (a bias: the fold, which needs them all, is not used then)."""
    shapes = projection_shapes(config)
    modules = [
        (layer, name, getattr(parent, child))
        for layer, name, parent, child in projection_modules(model)
    ]
    if not all(
        _plain(module, shapes[name].out_features, shapes[name].in_features)
        for _, name, module in modules
    ):
        return {}
    wide: dict[tuple[int, str], torch.Tensor] = {}
    for layer, name, module in modules:
        shape = shapes[name]
        wide[layer, name] = _widened(module, shape.out_features + shape.num_slices * rank)
        if module.weight.is_cuda:
            # Give the old weight's blocks back before the next buffer is allocated: carved
            # out of them, they would stay reserved, fragments no KV tensor fits in.
            torch.cuda.empty_cache()
    return wide


@torch.no_grad()  # a copy recorded by autograd would keep the old weight alive
def _widened(module: nn.Module, rows: int) -> torch.Tensor:
    """A zero [rows, in] buffer whose first rows take `module.weight`'s values; the module's
    weight becomes a view of them."""
    old = module.weight
    buffer = torch.zeros((rows, old.shape[1]), dtype=old.dtype, device=old.device)
    buffer[: old.shape[0]].copy_(old)
    module.weight = nn.Parameter(buffer[: old.shape[0]], requires_grad=False)
    return buffer


def _holds(buffer: torch.Tensor | None, weight: torch.Tensor, rows: int) -> bool:
    """Whether `weight` is the first rows of `buffer`, which has `rows` rows."""
    return (
        buffer is not None
        and buffer.shape == (rows, weight.shape[1])
        and buffer.dtype == weight.dtype
        and buffer.data_ptr() == weight.data_ptr()
    )


class FusedDecode:
    """One adapter's LoRA folded into the base matmuls and the kernels after them."""

    def __init__(self, slots: LoRASlots, max_rows: int) -> None:
        self.slots = slots
        self.width = slots.max_rank  # u columns per slice
        device = slots.device
        self._weights: dict[tuple[int, str], torch.Tensor] = {}  # [W; A] per layer, projection
        self._a_tails: dict[str, list[torch.Tensor]] = {}  # per projection, every layer's A rows
        self._held: list[torch.Tensor] = []  # originals of weights copied wider by bind
        self._bt = {
            name: torch.zeros(
                (slots.num_layers, self.width, shape.out_features), dtype=slots.dtype, device=device
            )
            for name, shape in slots.shapes.items()
        }
        self._ranks = {
            name: torch.zeros(1, dtype=torch.int32, device=device) for name in slots.shapes
        }  # the active adapter's rank per projection
        self.rows_on = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._staging = [torch.empty(max_rows, dtype=torch.int32) for _ in range(2)]
        if device.type == "cuda":  # copied without waiting for the step in flight
            self._staging = [buffer.pin_memory() for buffer in self._staging]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.active: tuple[int, int] | None = None  # (slot, its generation) whose factors are in
        self.capturing = False
        self.pending: tuple[torch.Tensor, LoRAEpilogue] | None = None
        self.activations = 0  # factor copies made (a new adapter or slot contents)

    @property
    def nbytes(self) -> int:
        """Device memory this adds: the A rows below the weights and the Bᵀ copies."""
        tails = sum(t.nbytes for tails in self._a_tails.values() for t in tails)
        return tails + sum(t.nbytes for t in self._bt.values())

    def bind(
        self,
        bases: Iterable[tuple[int, str, nn.Module]],
        wide: Mapping[tuple[int, str], torch.Tensor] | None = None,
    ) -> None:
        """Give each (layer, projection, base) a weight with room for A below it; the base's
        weight becomes a view of its first rows (same values, same storage order). `wide`: the
        buffers `widen_for_fold` gave the weights at load, taken as they are; a weight without
        one is copied into a new buffer here, and the original is kept: graphs captured
        before read it (the engine's weights are then held twice; see widen_for_fold)."""
        slots = self.slots
        wide = wide or {}
        for layer, name, base in bases:
            shape = slots.shapes[name]
            rows = shape.out_features + shape.num_slices * self.width
            buffer = wide.get((layer, name))
            if not _holds(buffer, base.weight, rows):
                self._held.append(base.weight)  # graphs captured before still read it
                buffer = _widened(base, rows)
            self._weights[layer, name] = buffer
            self._a_tails.setdefault(name, []).append(buffer[shape.out_features :])
        for name, tails in self._a_tails.items():
            if len(tails) != slots.num_layers:
                raise ValueError(f"{name}: {len(tails)} layers bound, model {slots.num_layers}")
        if self._held and slots.device.type == "cuda":
            logger.warning(
                "LoRA fold: %d projection weights copied wider after load; the originals stay "
                "allocated for the graphs captured over them (widen_for_fold at load avoids it)",
                len(self._held),
            )

    # ---- per step ---------------------------------------------------------------------------
    def supports(self, batch: LoRABatch) -> bool:
        """Whether this step's adapter rows all use one adapter."""
        return len(batch.distinct_slots) == 1

    def prepare(self, batch: LoRABatch, rows: int) -> None:
        """Make this step's adapter the active one and mark its rows among the first `rows`
        (`rows`: the graph's bucket; the rest, and padding, add nothing)."""
        (slot,) = batch.distinct_slots
        self.activate(slot)
        staging, copied = self._staging[self._turn], self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # the copy from this buffer two steps ago is long done
        staging[:rows].zero_()
        for start, length in zip(batch.starts, batch.lengths, strict=True):
            staging[start : start + length].fill_(1)
        self.rows_on[:rows].copy_(staging[:rows], non_blocking=True)
        if staging.is_pinned():
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
        self._turn ^= 1

    def activate(self, slot: int) -> None:
        """Copy `slot`'s A and Bᵀ in (on the current stream), unless they are there already."""
        key = (slot, self.slots.generations[slot])
        if self.active == key:
            return
        slots = self.slots
        for name, tails in self._a_tails.items():
            stack = slots.a_stacks[name][:, slot]  # [layers, slices, R, in]
            torch._foreach_copy_(tails, [a.reshape(-1, a.shape[-1]) for a in stack.unbind(0)])
            self._bt[name].copy_(slots.b_stacks[name][:, slot].transpose(1, 2))
            self._ranks[name].copy_(slots.kernel_rank_tensors[name][slot : slot + 1])
        self.active = key
        self.activations += 1

    # ---- while the "lora-one" graphs are captured -------------------------------------------
    def project(
        self,
        layer: int,
        name: str,
        x: torch.Tensor,
        base: WideningProjection,
    ) -> torch.Tensor:
        """base(x) through the wider weight: y (a column view); its delta awaits `take`."""
        if self.pending is not None:
            raise RuntimeError("a fused LoRA delta was left unapplied before the next projection")
        wide = self._weights[layer, name]
        out = self.slots.shapes[name].out_features
        both = base.forward_with(x, wide)
        y = both[:, :out]
        epilogue = LoRAEpilogue(
            u=both[:, out:],
            bt=self._bt[name][layer],
            rows_on=self.rows_on,
            rank=self._ranks[name],
            slice_width=self.width,
        )
        self.pending = (y, epilogue)
        return y

    def take(self, x: torch.Tensor) -> LoRAEpilogue | None:
        """The delta awaiting the projection output `x` starts at (None: none awaits it)."""
        pending = self.pending
        if pending is None:
            return None
        y, epilogue = pending
        if x.data_ptr() != y.data_ptr() or x.shape[0] != y.shape[0]:
            return None
        self.pending = None
        return epilogue


def captured(fused: FusedDecode, capture: Callable[[], None]) -> None:
    """Run `capture` (the graphs' capture) with projections handed to `fused`; raises when a
    delta was left unapplied."""
    fused.capturing = True
    fused.pending = None
    try:
        capture()
        if fused.pending is not None:
            raise RuntimeError("a fused LoRA delta was left unapplied at the end of a step")
    finally:
        fused.capturing = False
        fused.pending = None
