"""EngineAdapters: the LoRA parts of one engine, built together from its config and model.

One object for the engine to hold: the slot buffers on the model's device, the runtime the
model's projections call, the manager (host cache, slots, background loads from disk) and the
gate the scheduler asks. The engine's calls, in order of a request's life:

- `inspect(name, path)` on the admin path, off the step thread (reads and validates the files),
  then `register(record)` on the step thread; `unregister(name)`.
- `gate.hold(seq)` at add_request (NOT_FOUND for an unknown name), `gate.poll()` once per
  step (sequences whose adapter failed to load come back with the error to finish them with);
  a loop with nothing to schedule but loads in flight sleeps until `on_load_done` wakes it.
  `Scheduler(..., adapter_slots=gate)` admits and releases, `gate.drop(seq)` when it ends.
- `wait_for_slot_writes()` when a step has nothing to run but sequences whose adapter's slot
  copy (on a side stream, see slots.py) has not landed yet.
- `begin_step(batch)` before each forward (which rows use which slot); the model was given the
  runtime once with `attach(model)` (nn.Module models) or calls `runtime.apply` itself.
- `resident()` and `loading()` for the load report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor

import torch
from torch import nn

from services.common.errors import NotFoundError
from services.common.protocol.adapter_record import AdapterRecord
from services.engine.forward_batch import ScheduledBatch
from services.engine.lora.batch import LoRABatch
from services.engine.lora.config import LoRAConfig
from services.engine.lora.gate import AdapterGate
from services.engine.lora.loader import inspect_adapter, load_registered_adapter
from services.engine.lora.manager import AdapterManager
from services.engine.lora.runtime import LoRARuntime
from services.engine.lora.slots import LoRASlots, SlotWrite
from services.engine.lora.weights import AdapterWeights, stack_layers
from services.engine.lora.wrap import attach_lora
from services.engine.metrics import ENGINE_ADAPTER_LOAD_TIME
from services.engine.models.config import ModelConfig

# In flight per place in a step's batch when slots are time-sliced (inflight_capacity).
TIME_SLICED_INFLIGHT_FACTOR = 4


class EngineAdapters:
    """Slots, runtime, manager and gate of one engine's LoRA adapters."""

    def __init__(
        self,
        config: LoRAConfig,
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        kernels: str = "torch",
        max_rows: int = 0,
        executor: Executor | None = None,
        on_load_done: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(device)
        # CPU: float32 slots whatever the model's dtype (services/engine/lora/torch_ops.py);
        # a GPU's kernels take the model's dtype.
        self.dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.slots = LoRASlots(
            model_config,
            max_loras=config.max_loras,
            max_rank=config.max_lora_rank,
            dtype=self.dtype,
            device=self.device,
        )
        self.runtime = LoRARuntime(
            self.slots, kernels=kernels, max_rows=max_rows, ordered_sums=config.deterministic
        )
        self.manager = AdapterManager(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            load=self._load,
            write_slot=self._write_slot,
            executor=executor
            or ThreadPoolExecutor(config.load_workers, thread_name_prefix="lora-load"),
            on_load_done=on_load_done,
        )
        self.gate = AdapterGate(
            self.manager,
            slot_quantum_s=config.slot_quantum_ms / 1000.0,
            first_token_joins=config.first_token_joins,
        )

    @property
    def adapter_capacity(self) -> int:
        """The most distinct adapters served in flight at once: the host cache when slots are
        time-sliced (requests of adapters without a slot pause and take turns), else the
        device slots (a request holds its adapter's slot until it ends)."""
        config = self.config
        return config.max_cpu_loras if config.slot_quantum_ms > 0 else config.max_loras

    def inflight_capacity(self, max_num_seqs: int) -> int:
        """Requests the engine takes in flight at once. With time-sliced slots, four times the
        batch: the sequences of adapters waiting for their turn (paused, KV kept, or not yet
        admitted) hold no place in a step's batch, and without room for them the batch runs
        short while routers hold requests back. KV room still bounds what is placed."""
        factor = TIME_SLICED_INFLIGHT_FACTOR if self.config.slot_quantum_ms > 0 else 1
        return max_num_seqs * factor

    def inspect(self, name: str, path: str) -> AdapterRecord:
        """Validate an adapter completely (thread-safe; keep it off the step thread)."""
        return inspect_adapter(
            name,
            path,
            adapter_root=self.config.adapter_root,
            model_config=self.model_config,
            max_rank=self.config.max_lora_rank,
        )

    def register(self, record: AdapterRecord) -> None:
        self.manager.register(record)

    def ensure_registered(self, record: AdapterRecord) -> None:
        """Register `record` unless this very record is registered already (a request that
        carries its adapter's spec must not clear a failed load's error on every submit)."""
        try:
            if self.manager.record(record.name) == record:
                return
        except NotFoundError:
            pass
        self.manager.register(record)

    def unregister(self, name: str) -> bool:
        return self.manager.unregister(name)

    def attach(self, model: nn.Module) -> int:
        """Make an nn.Module Llama's projections add the step's LoRA deltas."""
        return attach_lora(model, self.runtime)

    def begin_step(self, batch: ScheduledBatch) -> None:
        """Tell the runtime which rows of this step's flat batch use which slot."""
        self.runtime.set_batch(LoRABatch.from_scheduled(batch))

    def warm_up(self, row_counts: Iterable[int]) -> int:
        """Compile the GPU kernels' variants for these step sizes before serving, so the first
        adapter request pays no compilation: each projection's shrink and expand per row count,
        the expand both adding and writing (LoRARuntime.warm_kernels), on slot 0 into scratch
        outputs. The launches made (0 on the torch path)."""
        runtime = self.runtime
        if runtime.kernels != "triton":
            return 0
        limit = runtime.max_rows
        counts = sorted({min(max(int(rows), 1), limit) for rows in row_counts})
        launches = 0
        long_segment_rows, runtime.long_segment_rows = runtime.long_segment_rows, limit + 1
        try:  # every row count through the kernels (their variants are what compiles)
            for rows in counts:
                runtime.set_batch(LoRABatch.from_row_slots([0] * rows))
                for name, shape in self.slots.shapes.items():
                    x = torch.zeros(rows, shape.in_features, dtype=self.dtype, device=self.device)
                    y = torch.zeros(rows, shape.out_features, dtype=self.dtype, device=self.device)
                    launches += runtime.warm_kernels(name, x, y)
        finally:
            runtime.long_segment_rows = long_segment_rows
            runtime.set_batch(LoRABatch(0))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return launches

    def wait_for_slot_writes(self) -> int:
        """Block until the slot writes in flight land (when nothing else can run)."""
        return self.manager.wait_for_writes()

    def resident(self) -> tuple[str, ...]:
        return self.manager.resident()

    def loading(self) -> tuple[str, ...]:
        return self.manager.loading()

    def shutdown(self) -> None:
        self.manager.shutdown()

    def _write_slot(self, slot: int, weights: AdapterWeights) -> SlotWrite | None:
        """A swap off the step stream: the copies overlap the steps that go on meanwhile."""
        after = self.runtime.read_fence(slot)  # the last launched step that reads the slot
        return self.slots.write(slot, weights, asynchronous=True, after=after)

    def _load(self, record: AdapterRecord) -> AdapterWeights:
        """On a loader thread: read, verify and lay out; pinned host memory for a GPU."""
        started = time.perf_counter()
        weights = load_registered_adapter(
            record.name,
            record.path,
            record.sha256,
            adapter_root=self.config.adapter_root,
            model_config=self.model_config,
            max_rank=self.config.max_lora_rank,
            dtype=self.dtype,
        )
        if self.device.type == "cuda":
            weights = stack_layers(weights, pin=True)
        ENGINE_ADAPTER_LOAD_TIME.observe(time.perf_counter() - started)
        return weights
