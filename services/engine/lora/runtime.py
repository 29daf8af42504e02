"""The per-step LoRA state the model reads: the slot buffers and this step's row layout.

The runner calls `set_batch` before each forward with the step's LoRABatch; every LoRA-capable
projection then calls `apply(layer, projection, x, y)` right after its base matmul, which adds
the adapters' deltas to y in place. `torch` computes them per segment (the CPU path; eager on
a GPU too). `triton` runs the shrink/expand kernels over rows grouped by slot; their layout
lives in fixed device buffers that `set_batch` overwrites, so a captured CUDA graph reads each
step's adapter mix without recapture. A step with no adapter rows does no LoRA work at all.
"""

from __future__ import annotations

import torch

from services.engine.lora.batch import LoRABatch
from services.engine.lora.slots import LoRASlots
from services.engine.lora.torch_ops import add_lora, add_lora_grouped

KERNELS = ("torch", "triton")
# torch: one batched matmul over all slots (add_lora_grouped) instead of a loop over segments
# when there are at least this many segments and padding every slot to the largest group
# multiplies the adapter rows by at most GROUPED_MAX_PADDING (decode batches of many adapters).
GROUPED_MIN_SEGMENTS = 4
GROUPED_MAX_PADDING = 4
# The kernels' row layout buffers: one entry per row of the largest step, or per slot.
LAYOUT_SIZES = {
    "row_indices": "rows",
    "group_starts": "slots",
    "group_lengths": "slots",
    "group_slots": "slots",
}


class LoRARuntime:
    """Adds each row's adapter delta to the projections of the model it is bound to."""

    def __init__(self, slots: LoRASlots, *, kernels: str = "torch", max_rows: int = 0) -> None:
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        if kernels == "triton" and max_rows < 1:
            raise ValueError("the triton kernels need max_rows (the largest step) up front")
        self.slots = slots
        self.kernels = kernels
        self.batch = LoRABatch(0)
        self._offsets = {name: shape.slice_offsets for name, shape in slots.shapes.items()}
        # Launch the kernels even for a step without adapter rows (set while capturing a CUDA
        # graph, whose replays must contain them); their programs then return at once.
        self.launch_always = False
        self._grouped: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None
        self._layout: dict[str, torch.Tensor] = {}
        self._slice_offsets: dict[str, torch.Tensor] = {}
        self._shrunk = torch.empty(0)
        if kernels == "triton":
            device = slots.device
            for name, size in LAYOUT_SIZES.items():
                count = max_rows if size == "rows" else slots.max_loras
                self._layout[name] = torch.zeros(count, dtype=torch.int32, device=device)
            self._slice_offsets = {
                name: torch.tensor(offsets, dtype=torch.int32, device=device)
                for name, offsets in self._offsets.items()
            }
            max_slices = max(shape.num_slices for shape in slots.shapes.values())
            self._shrunk = torch.zeros(
                max_rows, max_slices, slots.max_rank, dtype=torch.float32, device=device
            )

    @property
    def max_rows(self) -> int:
        """The widest step the kernels' row buffers take (0 on the torch path: no limit)."""
        return int(self._shrunk.shape[0]) if self.kernels == "triton" else 0

    def set_batch(self, batch: LoRABatch) -> None:
        """This step's rows and slots (for triton: written into the fixed layout buffers)."""
        self.batch = batch
        if self.kernels != "triton":
            self._grouped = self._grouped_layout(batch)
            return
        rows = self._layout["row_indices"].shape[0]
        layout = batch.kernel_layout(rows, self.slots.max_loras)
        for name in LAYOUT_SIZES:
            values = torch.tensor(getattr(layout, name), dtype=torch.int32)
            self._layout[name].copy_(values, non_blocking=True)

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += this step's adapter deltas of `projection` in `layer` (x its input rows)."""
        if self.batch.is_empty and not self.launch_always:
            return
        slots = self.slots
        a, b = slots.a[layer][projection], slots.b[layer][projection]
        if self.kernels == "torch":
            offsets = self._offsets[projection]
            if self._grouped is not None:
                rows, padded_index, group_size, low, high = self._grouped
                a, b = a[low:high], b[low:high]  # the slots in use (contiguous views)
                add_lora_grouped(y, x, rows, padded_index, group_size, a, b, offsets)
            else:
                add_lora(y, x, self.batch, a, b, offsets, slots.ranks[projection])
            return
        from services.engine.kernels.triton.lora_expand import lora_expand
        from services.engine.kernels.triton.lora_shrink import lora_shrink

        if x.shape[0] > self._shrunk.shape[0]:
            raise ValueError(f"{x.shape[0]} rows, more than max_rows {self._shrunk.shape[0]}")
        layout = self._layout
        shrunk = self._shrunk[: x.shape[0]]
        lora_shrink(
            x,
            a,
            shrunk,
            layout["row_indices"],
            layout["group_starts"],
            layout["group_lengths"],
            layout["group_slots"],
            slots.rank_tensors[projection],
        )
        lora_expand(
            shrunk,
            b,
            y,
            self._slice_offsets[projection],
            layout["row_indices"],
            layout["group_starts"],
            layout["group_lengths"],
            layout["group_slots"],
            slots.rank_tensors[projection],
            widest_slice=max(slots.shapes[projection].slice_sizes),
        )

    def _grouped_layout(
        self, batch: LoRABatch
    ) -> tuple[torch.Tensor, torch.Tensor, int, int, int] | None:
        """Index tensors and slot range for add_lora_grouped; None where the loop is better."""
        if len(batch.slots) < GROUPED_MIN_SEGMENTS:
            return None
        rows, padded_index, group_size = batch.padded_groups()
        low, high = min(batch.slots), max(batch.slots) + 1
        if (high - low) * group_size > GROUPED_MAX_PADDING * len(rows):
            return None
        device = self.slots.device
        return (
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(padded_index, dtype=torch.long, device=device),
            group_size,
            low,
            high,
        )
