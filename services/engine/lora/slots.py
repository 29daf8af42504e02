"""Device slots: every adapter's factors stacked per layer and projection, rank-padded.

For each decoder layer and fused projection, one A buffer [max_loras, num_slices, max_rank, in]
and one B buffer [max_loras, out, max_rank], views of one stack over layers per projection
(`a_stacks`, `b_stacks`). Writing an adapter into slot s fills row s (zeros past its rank and in
projections it leaves out): one copy per projection and factor when its host copy is stacked
(AdapterWeights.stacked), so a swap costs its host-to-device copy and a few launches. A batch
then refers to adapters only by slot index, so those indices (not the weights) are what
changes from step to step — which lets them be CUDA-graph inputs, and lets one kernel launch
serve every adapter of a batch.
`ranks[projection][slot]` (0: the adapter leaves that projection alone; a host list, and the
same in `rank_tensors` on the device) lets both paths skip work and read only each adapter's
real rank. On a CPU every B is also kept transposed ([max_loras, max_rank, out] per layer,
`bt`, written and zeroed with it): the native CPU kernel's expand then runs along contiguous
output columns, with no sum across lanes per output.

A write is either in order with the model's work (`write(slot, weights)`: on the current stream,
what tests and benchmarks that use the slot at once want), or, on a GPU, off it
(`write(..., asynchronous=True)`): the copies run on a side stream while steps go on, after
the last launched step that reads the slot's old adapter (or everything already issued), and
the returned `SlotWrite` says when the slot may be used. The engine uses the second, so a swap
costs the step stream nothing.
"""

from __future__ import annotations

import torch

from services.engine.lora.projections import PROJECTIONS, ProjectionShape, projection_shapes
from services.engine.lora.weights import AdapterWeights
from services.engine.models.config import ModelConfig


class SlotWrite:
    """A slot write running on the side stream: `done()` polls it, `wait()` blocks for it."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event
        self._done = False

    def done(self) -> bool:
        if not self._done:
            self._done = self._event.query()
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._event.synchronize()
            self._done = True


class LoRASlots:
    """Stacked, rank-padded slot buffers for one model on one device."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = model_config.num_layers
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.shapes: dict[str, ProjectionShape] = projection_shapes(model_config)
        self.a_stacks: dict[str, torch.Tensor] = {}
        self.b_stacks: dict[str, torch.Tensor] = {}
        for name in PROJECTIONS:
            shape = self.shapes[name]
            self.a_stacks[name] = torch.zeros(
                (self.num_layers, max_loras, shape.num_slices, max_rank, shape.in_features),
                dtype=dtype,
                device=self.device,
            )
            self.b_stacks[name] = torch.zeros(
                (self.num_layers, max_loras, shape.out_features, max_rank),
                dtype=dtype,
                device=self.device,
            )
        # CPU: each B transposed as well, for the native kernel (module docstring).
        self.bt_stacks: dict[str, torch.Tensor] = {}
        if self.device.type == "cpu":
            self.bt_stacks = {
                name: torch.zeros_like(stack.transpose(-1, -2)).contiguous()
                for name, stack in self.b_stacks.items()
            }
        self.a: list[dict[str, torch.Tensor]] = [
            {name: stack[layer] for name, stack in self.a_stacks.items()}
            for layer in range(self.num_layers)
        ]
        self.b: list[dict[str, torch.Tensor]] = [
            {name: stack[layer] for name, stack in self.b_stacks.items()}
            for layer in range(self.num_layers)
        ]
        self.bt: list[dict[str, torch.Tensor]] = [
            {name: stack[layer] for name, stack in self.bt_stacks.items()}
            for layer in range(self.num_layers)
        ]
        self.ranks: dict[str, list[int]] = {name: [0] * max_loras for name in PROJECTIONS}
        # The same ranks on the device, for the GPU kernels (which read no padding past them),
        # one more at index `zero_slot` that stays 0: rows the kernels must write zeros for
        # (KernelTiles' fill rows) name it, and no factor of it is ever read.
        self.zero_slot = max_loras
        self.kernel_rank_tensors: dict[str, torch.Tensor] = {
            name: torch.zeros(max_loras + 1, dtype=torch.int32, device=self.device)
            for name in PROJECTIONS
        }
        self.rank_tensors: dict[str, torch.Tensor] = {
            name: ranks[:max_loras] for name, ranks in self.kernel_rank_tensors.items()
        }
        self.names: list[str | None] = [None] * max_loras
        # Bumped by every write or clear of a slot: a copy of its factors made before is stale.
        self.generations: list[int] = [0] * max_loras
        self._copy_stream: torch.cuda.Stream | None = None  # made on the first async write

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a_stacks.values(), *self.b_stacks.values()))

    def write(
        self,
        slot: int,
        weights: AdapterWeights,
        *,
        asynchronous: bool = False,
        after: torch.cuda.Event | None = None,
    ) -> SlotWrite | None:
        """Put `weights` in `slot`, replacing whatever was there. `asynchronous` on a GPU: the
        copies go on a side stream and the slot may be used once the returned write is done;
        they start after `after` (the last step that reads the slot's old adapter: see
        services/engine/lora/read_fences.py) or, without it, after everything issued on the
        current stream. Otherwise (and always on a CPU) in order with the current stream, and
        None."""
        self._check(slot, weights)
        if not asynchronous or self.device.type != "cuda":
            self._write(slot, weights)
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            self._write(slot, weights)
            event = torch.cuda.Event()
            event.record(stream)
        return SlotWrite(event)

    def _check(self, slot: int, weights: AdapterWeights) -> None:
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} outside 0..{self.max_loras - 1}")
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter rank {weights.rank} over the slot rank {self.max_rank}")
        if len(weights.layers) != self.num_layers:
            raise ValueError(f"adapter has {len(weights.layers)} layers, model {self.num_layers}")

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        rank = weights.rank
        self.generations[slot] += 1
        if weights.stacked is None:
            self.clear(slot)
            for layer, projections in enumerate(weights.layers):
                for name, factors in projections.items():
                    self.a[layer][name][slot, :, :rank].copy_(factors.a, non_blocking=True)
                    self.b[layer][name][slot, :, :rank].copy_(factors.b, non_blocking=True)
                    if self.bt_stacks:
                        self.bt[layer][name][slot, :rank].copy_(factors.b.t())
        else:
            for name in PROJECTIONS:
                stacked = weights.stacked.get(name)
                old_rank = self.ranks[name][slot]
                if stacked is None:  # left out: zero what the slot's last adapter wrote
                    if old_rank:
                        self._zero(name, slot, 0, old_rank)
                        self.ranks[name][slot] = 0
                        self._set_rank_tensor(name, slot, 0)
                    continue
                self.a_stacks[name][:, slot, :, :rank].copy_(stacked.a, non_blocking=True)
                self.b_stacks[name][:, slot, :, :rank].copy_(stacked.b, non_blocking=True)
                if self.bt_stacks:
                    self.bt_stacks[name][:, slot, :rank].copy_(stacked.b.transpose(-1, -2))
                if old_rank > rank:
                    self._zero(name, slot, rank, old_rank)
        for name in weights.projections():
            self.ranks[name][slot] = rank
            self._set_rank_tensor(name, slot, rank)
        self.names[slot] = weights.name

    def _set_rank_tensor(self, name: str, slot: int, rank: int) -> None:
        """The device copy of a slot's rank, as a fill on the current stream: an item assignment
        (`tensor[slot] = rank`) would copy the number from the host and wait for the stream,
        i.e. block the engine's thread until the write's fence (the step in flight) passes."""
        self.rank_tensors[name][slot : slot + 1].fill_(rank)

    def _zero(self, name: str, slot: int, low: int, high: int) -> None:
        """Zero ranks low..high of `slot` in every layer of projection `name`."""
        self.a_stacks[name][:, slot, :, low:high].zero_()
        self.b_stacks[name][:, slot, :, low:high].zero_()
        if self.bt_stacks:
            self.bt_stacks[name][:, slot, low:high].zero_()

    def clear(self, slot: int) -> None:
        """Zero `slot` where its last adapter wrote (the rest is zero already)."""
        self.generations[slot] += 1
        for name in PROJECTIONS:
            if self.ranks[name][slot]:
                self._zero(name, slot, 0, self.ranks[name][slot])
                self.ranks[name][slot] = 0
                self._set_rank_tensor(name, slot, 0)
        self.names[slot] = None
