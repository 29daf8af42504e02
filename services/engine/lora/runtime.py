"""The per-step LoRA state the model reads: the slot buffers and this step's row layout.

The runner calls `set_batch` before each forward with the step's LoRABatch; every LoRA-capable
projection then runs through `project(layer, projection, x, base)`
(services/engine/lora/wrap.py): its base matmul, and the adapters' deltas added to the output in
place (`apply(layer, projection, x, y)` adds them to a y already computed). In small decode
graphs on a GPU the triton shrink runs on a side stream beside the base matmul. `torch` computes
the deltas per segment (the CPU path; eager on a GPU too). `triton` runs the shrink/expand
kernels over tiles of rows grouped by slot; the tiles live in one fixed device buffer that
`set_batch` overwrites (one pinned copy a step), so a captured CUDA graph reads each step's
adapter mix without recapture. A step with no adapter rows does no LoRA work at all (the runner
replays graphs captured without the kernels). On a CPU with the native kernels (`cpu_kernels`,
set by the CPU runner), the torch path's per-segment matmuls become one native call per
projection for all of the step's adapter rows: their dispatch, not their arithmetic, was most of
the cost.

Long runs of one adapter's rows (a prompt's chunk: `long_segment_rows` and more) take the
per-segment torch path on the triton runtime too: its shrink and expand are two cuBLAS
matmuls over contiguous rows, which moves the projection's output at about 1.5x the speed of
the tile kernels there (2,048 and 8,192 rows). Only in steps wider than any captured CUDA graph
(`graph_rows`): a graph replays the kernels alone. In eager steps whose base projection is a
plain `x Wᵀ` at that size (`plain_weight`), `project` writes every adapter row's delta first
(long runs through cuBLAS, the rest by the expand kernel in write mode, which writes zeros for
the base model's rows and a graph's padding: tiles of the zero slot), and the base matmul adds
itself onto them (`addmm_`): the output is read once inside a compute-bound matmul instead of
in a memory-bound pass of its own after it. CUDA graphs wider than SIDE_SHRINK_MAX_ROWS, and
those the runner captures for steps of many adapters, do the same. Where the kernel that reads a
projection's output next can add the deltas itself (`tile_consumer`: the CUDA fast path's
SwiGLU, for gate_up_proj), the runtime runs only the shrink and the plain base matmul and
leaves the step's tiles for that kernel (`take`): the deltas never go through memory.

With `side_deltas` (set by the runner while it captures the decode graphs of several adapters
on the CUDA fast path, whose norm, SwiGLU and rotary kernels add a written delta as they load
their input: `delta_projections`), each projection's shrink and expand run on a side stream
beside the base matmul (the tuned one: any base), the expand writing every row's delta into a
buffer of that projection; the kernel that reads the output next adds it (`take`). The LoRA
kernels' chain of small latency-bound launches then leaves the step's critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from services.engine.cuda_graph import bucket_for
from services.engine.lora.batch import TILE_ROWS, LoRABatch, max_tiles
from services.engine.lora.read_fences import SlotReadFences
from services.engine.lora.slots import LoRASlots
from services.engine.lora.torch_ops import add_lora, add_lora_grouped, shrink_stacked, write_lora

if TYPE_CHECKING:  # the native CPU kernels are loaded by the CPU runner, when it has them
    from services.engine.kernels.cpu.cpu_native import CpuKernels
    from services.engine.kernels.triton.lora_epilogue import LoRADeltas, LoRAEpilogue, LoRATiles
    from services.engine.lora.fused import FusedDecode

KERNELS = ("torch", "triton")
# torch: one batched matmul over all slots (add_lora_grouped) instead of a loop over segments
# when there are at least this many segments and padding every slot to the largest group
# multiplies the adapter rows by at most GROUPED_MAX_PADDING (decode batches of many adapters).
GROUPED_MIN_SEGMENTS = 4
GROUPED_MAX_PADDING = 4
# triton: a run of at least this many rows of one adapter goes through cuBLAS (write_lora, or
# for gate_up its shrink only, SwiGLU adding the deltas). With SwiGLU taking gate_up's deltas,
# runs of 1,024 rows ran faster through the kernels (8B shapes on an H100, prefill of 8 x 1,024
# tokens under 8 adapters: 1.111x the base step against 1.125-1.142x through cuBLAS, two
# cards; runs of 2,048 about even; benchmarks/lora_bench.py).
LONG_SEGMENT_ROWS = 2048
# triton on a GPU: CUDA graphs of at most this many rows run the shrink on a side stream beside
# the base matmul (project): at 64 rows of one adapter, 8B shapes on an H100, 0.77 ms of LoRA a step
# instead of 0.98 (benchmarks/lora_kernel_ab.py); wider graphs write the deltas first and let the
# base matmul add onto them (at 128 and 256 rows of 16 adapters 11 and 16 % less LoRA time than
# adding them after it), as do graphs of this size for steps of many adapters (the runner
# captures both; at 64 rows of 64 adapters 3.65 ms against 4.68, of one adapter 1.00 against
# 0.79).
SIDE_SHRINK_MAX_ROWS = 64


class TileConsumer(Protocol):
    """Kernels that read projection outputs next and can add a step's tile deltas as they load
    them (the CUDA fast path's TritonOps)."""

    consumes: frozenset[str]  # the projections whose outputs they read
    bound: bool  # whether the model runs through them now
    epilogues: object  # the source they ask for deltas

    def warm(self, projection: str, y: torch.Tensor) -> None:
        """Run the kernel that reads `projection`'s output y (taking its deltas), to compile it."""
        ...


class LoRARuntime:
    """Adds each row's adapter delta to the projections of the model it is bound to."""

    def __init__(
        self,
        slots: LoRASlots,
        *,
        kernels: str = "torch",
        max_rows: int = 0,
        ordered_sums: bool = True,
    ) -> None:
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        if kernels == "triton" and max_rows < 1:
            raise ValueError("the triton kernels need max_rows (the largest step) up front")
        self.slots = slots
        self.kernels = kernels
        self.batch = LoRABatch(0)
        self.max_rows = 0  # the widest step the kernels' buffers take (0 on the torch path)
        self._offsets = {name: shape.slice_offsets for name, shape in slots.shapes.items()}
        # Launch the kernels even for a step without adapter rows (set while capturing a CUDA
        # graph, whose replays must contain them); their programs then return at once.
        self.launch_always = False
        self._grouped: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None
        # triton: this step's long segments (add_lora), the rest go to the kernels.
        self.long_segment_rows = LONG_SEGMENT_ROWS
        self.graph_rows = 0  # the widest step a CUDA graph replays (set by the runner)
        self.graph_buckets: tuple[int, ...] = ()  # the graphs' batch sizes (set by the runner)
        self._long = LoRABatch(0)
        # torch on a CPU: the native kernels (set by the CPU runner), each projection's slice
        # offsets for them, and this step's adapter rows and their slots (int32).
        self.cpu_kernels: CpuKernels | None = None
        self._offset_tensors = {
            name: torch.tensor(offsets, dtype=torch.int64)
            for name, offsets in self._offsets.items()
        }
        self._native_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        # This step's rows in no long run, for project's deltas-first path: (rows, index).
        self._uncovered: tuple[int, torch.Tensor | None] | None = None
        # Eager steps: the kernels' deltas too are written before the base matmul adds onto
        # them (False: added after it, y read and written again; benchmarks compare both).
        self.write_tile_deltas = True
        self._side_stream: torch.cuda.Stream | None = None  # the kernels' on a GPU (project)
        # On a GPU: which step last read each slot, for slot writes (read_fence).
        self.read_fences: SlotReadFences | None = None
        if slots.device.type == "cuda":
            self.read_fences = SlotReadFences(slots.device)
        self.side_shrink_max_rows = SIDE_SHRINK_MAX_ROWS
        # Set while the runner captures graphs of at most side_shrink_max_rows rows for steps
        # of many adapters: their deltas go first too (see SIDE_SHRINK_MAX_ROWS).
        self.graph_deltas_first = False
        # triton: the shrink sums its K splits in split order (the same bits every run), not
        # with float atomics in the order they finish.
        self.ordered_sums = ordered_sums
        # On the CUDA fast path: one adapter's LoRA folded into the base kernels, for the decode
        # graphs the runner captures for steps of one adapter (services/engine/lora/fused.py).
        self.fused: FusedDecode | None = None
        # On the CUDA fast path: the kernels that add deltas of the projections they read
        # (SwiGLU, gate_up_proj), and the output whose deltas await them (y, tiles).
        self.tile_consumer: TileConsumer | None = None
        # (y, its deltas, whether a column view of y may take them)
        self._pending: tuple[torch.Tensor, LoRATiles | LoRADeltas, bool] | None = None
        # In a step with long runs (cuBLAS), that kernel adds their deltas too, their u from
        # cuBLAS (False: theirs are written first and the base matmul adds onto them).
        self.consumer_takes_long_runs = True
        # On the CUDA fast path: the projections whose output's next kernel adds a written
        # delta (set by the runner), and whether the graphs captured now compute the deltas
        # beside the base matmul (project); each projection's delta buffer, made at first use.
        self.delta_projections: frozenset[str] = frozenset()
        self.side_deltas = False
        self._delta_buffers: dict[str, torch.Tensor] = {}
        if kernels == "triton":
            self._init_kernel_buffers(max_rows)

    def _init_kernel_buffers(self, max_rows: int) -> None:
        """The fixed device buffers the kernels (and graphs capturing them) read every step."""
        from services.engine.kernels.triton.lora_expand import (
            BLOCK_N,
            WIDE_SUB_BLOCKS,
            column_blocks,
            lora_expand,
        )
        from services.engine.kernels.triton.lora_shrink import (
            SPLIT_K_MAX_ROWS,
            lora_shrink,
            workspace_floats,
        )

        self._shrink, self._expand = lora_shrink, lora_expand  # Triton imported only when used

        slots, device = self.slots, self.slots.device
        self.max_rows = max_rows
        self.tile_capacity = max_tiles(max_rows, slots.max_loras)
        header = 1 + 3 * self.tile_capacity
        layout = self._layout_size = header + max_rows
        # [tile count, tile slots, tile starts, tile row counts | row indices] of the kernels'
        # tiles, then the same of every row's tiles, long runs' too (for the kernel reading
        # gate_up's output in a step with long runs: _leave_tiles); one copy a step
        self._packed = torch.zeros(2 * layout, dtype=torch.int32, device=device)
        self._tiles, self._row_indices = self._packed[:header], self._packed[header:layout]
        self._all_tiles = self._packed[layout : layout + header]
        self._all_row_indices = self._packed[layout + header :]
        self._num_all_tiles = 0  # this step's tiles of every row, where it has long runs
        self._staging = [torch.zeros_like(self._packed, device="cpu") for _ in range(2)]
        if torch.device(device).type == "cuda":
            self._staging = [buffer.pin_memory() for buffer in self._staging]
        self._copied = [None, None]
        self._turn = 0
        self._num_tiles = 0  # this step's tiles, as the device buffer says
        # Each projection's column blocks for the expand: one block a work item in decode-sized
        # steps (at most SPLIT_K_MAX_ROWS rows, as the shrink splits them), a few in wider ones.
        self._decode_rows = SPLIT_K_MAX_ROWS
        self._blocks = {
            (name, sub_blocks): torch.tensor(
                column_blocks(offsets, BLOCK_N * sub_blocks), dtype=torch.int32, device=device
            )
            for name, offsets in self._offsets.items()
            for sub_blocks in (1, WIDE_SUB_BLOCKS)
        }
        self._wide_sub_blocks = WIDE_SUB_BLOCKS
        # The stream the shrink runs on beside the base matmul (project), on a GPU.
        if torch.device(device).type == "cuda":
            self._side_stream = torch.cuda.Stream(device)
        widest = max(shape.num_slices for shape in slots.shapes.values()) * slots.max_rank
        # Shrink results, two buffers used in turn: each shrink writes one and zeroes the
        # other's rows of its tiles for the next projection (lora_shrink's docstring).
        self._u = torch.zeros(2, max_rows, widest, dtype=torch.float32, device=device)
        self._u_pairs = ((self._u[0], self._u[1]), (self._u[1], self._u[0]))  # (add, zero)
        self._u_turn = 0
        # The shrink's K splits summed in split order (the same bits every run): room for the
        # partials of the widest decode-sized step (tiles up to a graph bucket past
        # SPLIT_K_MAX_ROWS rows: eager steps' tiles cover their bucket) and of the widest step.
        row_counts = {min(max_rows, 2 * SPLIT_K_MAX_ROWS), max_rows}
        floats = max(
            workspace_floats(
                rows,
                shape.in_features,
                shape.num_slices * slots.max_rank,
                TILE_ROWS,
                max_tiles(rows, slots.max_loras),
            )
            for shape in slots.shapes.values()
            for rows in row_counts
        )
        self._partials = torch.empty(max(floats, 1), dtype=torch.float32, device=device)
        self._counters = torch.zeros(self.tile_capacity, dtype=torch.int32, device=device)

    def set_batch(self, batch: LoRABatch) -> None:
        """This step's rows and slots (for triton: written into the fixed layout buffers)."""
        self.batch = batch
        self._uncovered = None
        self._pending = None  # a step that failed midway may have left one
        if self.read_fences is not None:
            self.read_fences.begin_step(self._slots_read(batch))
        if self.kernels != "triton":
            self._native_rows = self._native_layout(batch)
            self._grouped = None if self._native_rows is not None else self._grouped_layout(batch)
            return
        if batch.num_rows > self.max_rows:
            raise ValueError(f"{batch.num_rows} rows, more than max_rows {self.max_rows}")
        full = batch
        self._long = LoRABatch(0)
        if batch.num_rows > self.graph_rows:  # eager for sure: long runs may go to cuBLAS
            batch, self._long = batch.split_long(self.long_segment_rows)
        # The rows no adapter writes a delta for (base rows; past the batch, a graph's padding)
        # go to the kernels as rows of the zero slot: written as zeros where the deltas go
        # first (project), skipped where they are added.
        fill = [] if full.is_empty else full.rows_outside(self._cover(full.num_rows))
        # With long runs, the kernel reading gate_up's output next may add their deltas too
        # (_consumer_takes): it walks a layout of every row's tiles.
        every_row = None
        if (
            not self._long.is_empty
            and self.tile_consumer is not None
            and self.consumer_takes_long_runs
            and self.write_tile_deltas
        ):
            every_row = full.kernel_tiles(fill, self.slots.zero_slot)
        self._num_all_tiles = 0 if every_row is None else every_row.num_tiles
        if batch.is_empty and not fill and every_row is None:
            if self._num_tiles:
                self._packed[:1].zero_()  # replays of graphs with the kernels do nothing
                self._num_tiles = 0
            return
        tiles = batch.kernel_tiles(fill, self.slots.zero_slot)
        packed = tiles.packed(self.tile_capacity)
        self._u.zero_()  # rows of the last step's tiles may hold its last projection's u
        staging, copied = self._staging[self._turn], self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # the copy from this buffer two steps ago is long done
        staging[: len(packed)] = torch.tensor(packed, dtype=torch.int32)
        end = len(packed)
        if every_row is not None:
            second = every_row.packed(self.tile_capacity)
            end = self._layout_size + len(second)
            staging[self._layout_size : end] = torch.tensor(second, dtype=torch.int32)
        self._packed[:end].copy_(staging[:end], non_blocking=True)
        if staging.is_pinned():
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
        self._turn ^= 1
        self._num_tiles = tiles.num_tiles

    def _slots_read(self, batch: LoRABatch) -> Iterable[int]:
        """The slots a step of `batch` reads: its adapters' (the torch path's batched matmul
        reads every slot from the lowest to the highest of them)."""
        if not batch.slots:
            return ()
        if self.kernels == "torch":
            return range(min(batch.slots), max(batch.slots) + 1)
        return batch.distinct_slots

    def read_fence(self, slot: int) -> torch.cuda.Event | None:
        """For a slot write: the event after which no launched step reads `slot` (None: wait
        for everything issued; always on a CPU)."""
        return None if self.read_fences is None else self.read_fences.fence(slot)

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += this step's adapter deltas of `projection` in `layer` (x its input rows)."""
        if self.batch.is_empty and not self.launch_always:
            return
        slots = self.slots
        a, b = slots.a[layer][projection], slots.b[layer][projection]
        if self.kernels == "torch":
            native = self._native_rows
            if native is not None and self._native_fits(x, y, a):
                rows, row_slots = native
                bt = slots.bt[layer][projection]
                ranks, offsets = slots.rank_tensors[projection], self._offset_tensors[projection]
                self.cpu_kernels.lora_delta(x, y, rows, row_slots, a, bt, ranks, offsets)
                return
            offsets = self._offsets[projection]
            if self._grouped is not None:
                rows, padded_index, group_size, low, high = self._grouped
                a, b = a[low:high], b[low:high]  # the slots in use (contiguous views)
                add_lora_grouped(y, x, rows, padded_index, group_size, a, b, offsets)
            else:
                add_lora(y, x, self.batch, a, b, offsets, slots.ranks[projection])
            return
        rows = x.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows, more than max_rows {self.max_rows}")
        if not self._long.is_empty:
            offsets, ranks = self._offsets[projection], slots.ranks[projection]
            add_lora(y, x, self._long, a, b, offsets, ranks, fused_add=True)
        bound = self._kernel_bound()
        if bound:
            u = self._shrink_into(layer, projection, x, bound)
            self._expand_into(layer, projection, u, y, bound)

    def warm_kernels(self, projection: str, x: torch.Tensor, y: torch.Tensor) -> int:
        """Launch this step's shrink and expand of `projection` (layer 0) every way a step may
        run them: the expand adding into y (graphs, `apply`) and writing y (the deltas-first
        path of eager steps, `project`), so each variant is compiled before serving. The
        launches made (0 off the kernels' path or with no tile)."""
        bound = self._kernel_bound() if self.kernels == "triton" else 0
        if not bound:
            return 0
        launches = 0
        for write in (False, True):
            u = self._shrink_into(0, projection, x, bound)
            self._expand_into(0, projection, u, y, bound, write=write)
            launches += 2
        if self._consumer_takes(projection):  # and the kernel that adds them as it reads y
            self._leave_tiles(0, projection, x, y)
            self.tile_consumer.warm(projection, y)
            if self._pending is not None:
                self._pending = None
                raise RuntimeError(f"the kernel reading {projection} took none of its deltas")
            launches += 2
        return launches

    def project(
        self,
        layer: int,
        projection: str,
        x: torch.Tensor,
        base: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """base(x) plus this step's adapter deltas of `projection` in `layer`.

        While a CUDA graph of at most SIDE_SHRINK_MAX_ROWS rows is captured on the kernels'
        path (small decode batches), the shrink needs only x, so it runs on a side stream beside
        the base matmul (on SMs the matmul of a few rows leaves idle) and the expand adds into
        the matmul's output once both are done: the shrink's latency leaves the step's critical
        path, at no host cost when the graph replays. In wider graphs and in eager steps
        (prefill and mixed) whose base is a plain x Wᵀ, the deltas are written first and the
        base matmul adds onto them (`_base_onto_deltas`). While the graphs of one adapter are
        captured, `fused` takes the projection (no LoRA kernel at all). Otherwise as apply."""
        if self._pending is not None:
            raise RuntimeError("a LoRA delta was left for a kernel that never took it")
        fused = self.fused
        if fused is not None and fused.capturing:
            return fused.project(layer, projection, x, base)
        if self._beside_takes(projection, x):
            return self._base_beside_deltas(layer, projection, x, base)
        weight = self._deltas_first_weight(layer, projection, x, base)
        if weight is not None:
            if self._consumer_takes(projection):
                return self._base_for_consumer(layer, projection, x, weight)
            return self._base_onto_deltas(layer, projection, x, weight)
        bound = self._kernel_bound() if self._side_stream is not None else 0
        if (
            not bound
            or not torch.cuda.is_current_stream_capturing()
            or x.shape[0] > min(self.side_shrink_max_rows, self.max_rows)
            or not self._long.is_empty
        ):
            y = base(x)
            self.apply(layer, projection, x, y)
            return y
        main, side = torch.cuda.current_stream(x.device), self._side_stream
        side.wait_stream(main)  # x is written
        with torch.cuda.stream(side):
            u = self._shrink_into(layer, projection, x, bound)
        y = base(x)
        main.wait_stream(side)
        self._expand_into(layer, projection, u, y, bound)
        return y

    def _deltas_first_weight(
        self,
        layer: int,
        projection: str,
        x: torch.Tensor,
        base: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor | None:
        """W where this projection's deltas go first and the base matmul adds onto them: a step
        on the kernels' path with adapter rows, eager or a CUDA graph wider than
        `side_shrink_max_rows` (narrower ones run the shrink beside the matmul, unless
        `graph_deltas_first`), whose base is a plain x Wᵀ in B's dtype; None otherwise."""
        if self.kernels != "triton":
            return None
        tiles = self.write_tile_deltas and self._kernel_bound()
        if self._long.is_empty and not tiles:
            return None
        side_sized = not self.graph_deltas_first and x.shape[0] <= min(
            self.side_shrink_max_rows, self.max_rows
        )
        if (not tiles or side_sized) and x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        weight = plain_weight(base, x)
        if weight is None or weight.dtype != self.slots.b[layer][projection].dtype:
            return None
        return weight

    def _base_onto_deltas(
        self, layer: int, projection: str, x: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """x Wᵀ plus this step's deltas: every row's delta written first (long runs by cuBLAS,
        the rest by the kernels in write mode, zeros for the base model's rows and a graph's
        padding; y never read), then the base matmul added onto them: y is read once, inside
        a matmul."""
        rows = x.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows, more than max_rows {self.max_rows}")
        slots = self.slots
        y = x.new_empty((rows, weight.shape[0]), dtype=weight.dtype)
        if not self._long.is_empty:
            write_lora(
                y,
                x,
                self._long,
                slots.a[layer][projection],
                slots.b[layer][projection],
                self._offsets[projection],
                slots.ranks[projection],
            )
        bound = self._kernel_bound()
        write = self.write_tile_deltas
        if bound and write:  # every row outside the long runs is in a tile (set_batch)
            u = self._shrink_into(layer, projection, x, bound)
            self._expand_into(layer, projection, u, y, bound, write=True)
        else:
            outside = self._outside_long_runs(rows)
            if outside is not None:
                y.index_fill_(0, outside, 0)
        y.addmm_(x, weight.t())
        if bound and not write:
            u = self._shrink_into(layer, projection, x, bound)
            self._expand_into(layer, projection, u, y, bound)
        return y

    def _beside_takes(self, projection: str, x: torch.Tensor) -> bool:
        """Whether `projection`'s deltas are computed beside its base matmul (side_deltas):
        on a GPU, the kernels' path with tiles, no long run, the kernel reading the output
        next adding a written delta, at most the rows of the widest graph."""
        return (
            self.side_deltas
            and projection in self.delta_projections
            and self._side_stream is not None
            and x.is_cuda
            and self._long.is_empty
            and x.shape[0] <= self._delta_rows()
            and self._kernel_bound() > 0
        )

    def _base_beside_deltas(
        self,
        layer: int,
        projection: str,
        x: torch.Tensor,
        base: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """base(x), with this step's deltas of it written into the projection's delta buffer
        on the side stream meanwhile (zeros for the base model's rows and a graph's padding:
        the expand's write mode) and left for the kernel that reads the output next."""
        from services.engine.kernels.triton.lora_epilogue import LoRADeltas

        rows = x.shape[0]
        delta = self._delta_buffer(layer, projection)[:rows]
        bound = self._kernel_bound()
        main, side = torch.cuda.current_stream(x.device), self._side_stream
        side.wait_stream(main)  # x is written; the last layer's delta read
        with torch.cuda.stream(side):
            u = self._shrink_into(layer, projection, x, bound)
            self._expand_into(layer, projection, u, delta, bound, write=True)
        y = base(x)
        main.wait_stream(side)
        self._pending = (y, LoRADeltas(delta), True)
        return y

    def _delta_rows(self) -> int:
        """The rows of a delta buffer: the widest decode graph's (at most max_rows)."""
        return min(max(self.graph_rows, 1), self.max_rows)

    def _delta_buffer(self, layer: int, projection: str) -> torch.Tensor:
        """The buffer a graph step writes `projection`'s deltas into ([graph rows, out], B's
        dtype; one for every layer: each layer's is read before the next layer's is written)."""
        buffer = self._delta_buffers.get(projection)
        if buffer is None:
            b = self.slots.b[layer][projection]
            buffer = torch.empty(self._delta_rows(), b.shape[1], dtype=b.dtype, device=b.device)
            self._delta_buffers[projection] = buffer
        return buffer

    def _consumer_takes(self, projection: str) -> bool:
        """Whether the kernel reading `projection`'s output next adds this step's deltas
        itself: a bound tile consumer of it asking this runtime, the deltas written rather
        than added after, and a tile to walk (the kernels' tiles; in a step with long runs,
        every row's: set_batch)."""
        consumer = self.tile_consumer
        return (
            consumer is not None
            and consumer.bound
            and consumer.epilogues is self
            and projection in consumer.consumes
            and self.write_tile_deltas
            and (self._kernel_bound() if self._long.is_empty else self._num_all_tiles) > 0
        )

    def _base_for_consumer(
        self, layer: int, projection: str, x: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """x Wᵀ, with this step's tiles and their u left for the kernel that reads it next."""
        if x.shape[0] > self.max_rows:
            raise ValueError(f"{x.shape[0]} rows, more than max_rows {self.max_rows}")
        y = torch.mm(x, weight.t())
        self._leave_tiles(layer, projection, x, y)
        return y

    def _leave_tiles(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Run the shrink of x and leave its u and the step's tiles for the kernel reading y.
        In a step with long runs, their rows' u comes from cuBLAS and the kernel walks every
        row's tiles: their deltas, too, never go through memory."""
        from services.engine.kernels.triton.lora_epilogue import LoRATiles

        bound = self._graph_tile_bound(x, self._kernel_bound())
        tiles, row_indices = self._tiles, self._row_indices
        if self._long.is_empty:
            u = self._shrink_into(layer, projection, x, bound)
        else:
            # no kernel tile in this step: no row of either u buffer for a shrink to zero
            u = self._shrink_into(layer, projection, x, bound) if bound else self._u[0]
            self._shrink_long_runs(layer, projection, x, u)
            tiles, row_indices, bound = self._all_tiles, self._all_row_indices, self._num_all_tiles
        pending = LoRATiles(
            u=u,
            b=self.slots.b[layer][projection],
            tiles=tiles,
            row_indices=row_indices,
            slot_ranks=self.slots.kernel_rank_tensors[projection],
            tile_rows=TILE_ROWS,
            tile_bound=bound,
        )
        self._pending = (y, pending, False)

    def _shrink_long_runs(
        self, layer: int, projection: str, x: torch.Tensor, u: torch.Tensor
    ) -> None:
        """u's rows of this step's long runs: each run's x times its slot's A, every slice at
        the padded rank in one matmul (x read once), as the kernels lay u out (slice i from
        column i * max_rank). Runs of a slot of rank 0 are left: the consumer reads no u there."""
        a = self.slots.a[layer][projection]
        ranks = self.slots.ranks[projection]
        long = self._long
        for start, length, slot in zip(long.starts, long.lengths, long.slots, strict=True):
            if ranks[slot] == 0:
                continue
            shrunk = shrink_stacked(x[start : start + length], a, slot)
            u[start : start + length, : shrunk.shape[1]].copy_(shrunk)

    def take(self, x: torch.Tensor) -> LoRAEpilogue | LoRATiles | LoRADeltas | None:
        """The deltas awaiting the projection output `x` (EpilogueSource): the one-adapter
        fold's while its graphs are captured, else the tiles or written deltas `project` left
        (written deltas: for a column view of the output too, the rotary kernel's q); None if
        none."""
        fused = self.fused
        if fused is not None and fused.pending is not None:
            return fused.take(x)
        pending = self._pending
        if pending is None:
            return None
        y, tiles, any_columns = pending
        same_rows = x.data_ptr() == y.data_ptr() and x.shape[0] == y.shape[0]
        if not same_rows or (x.shape != y.shape and not any_columns):
            return None
        self._pending = None
        return tiles

    def _cover(self, rows: int) -> int:
        """The rows a step of `rows` rows computes: the CUDA graph bucket it may replay, or
        `rows` itself in a step no graph takes."""
        bucket = bucket_for(self.graph_buckets, rows) if rows <= self.graph_rows else None
        return rows if bucket is None else bucket

    def _outside_long_runs(self, rows: int) -> torch.Tensor | None:
        """The rows among the first `rows` in no long run (an index tensor on the slots'
        device, made once a step), None when there are none."""
        if self._uncovered is not None and self._uncovered[0] == rows:
            return self._uncovered[1]
        values = self._long.rows_outside(rows)
        index = self._index_tensor(values) if values else None
        self._uncovered = (rows, index)
        return index

    def _kernel_bound(self) -> int:
        """The kernels' grid: this step's tiles, or every tile there could be while a graph is
        captured (0: nothing for the kernels)."""
        return self.tile_capacity if self.launch_always else self._num_tiles

    def _shrink_into(
        self, layer: int, projection: str, x: torch.Tensor, bound: int
    ) -> torch.Tensor:
        """Launch the shrink of x into the next u buffer (zeroing the other); that buffer."""
        u, zero = self._u_pairs[self._u_turn]
        self._u_turn ^= 1
        bound = self._graph_tile_bound(x, bound)
        self._shrink(
            x,
            self.slots.a[layer][projection],
            u,
            zero,
            self._tiles,
            self._row_indices,
            self.slots.kernel_rank_tensors[projection],
            tile_rows=TILE_ROWS,
            tile_bound=bound,
            partials=self._partials if self.ordered_sums else None,
            counters=self._counters,
        )
        return u

    def _graph_tile_bound(self, x: torch.Tensor, bound: int) -> int:
        """`bound`, or while a graph of x's rows is captured with every tile launched, the
        tiles a step of that many rows is cut into at most."""
        if self.launch_always and x.is_cuda and torch.cuda.is_current_stream_capturing():
            return min(bound, max_tiles(x.shape[0], self.slots.max_loras))
        return bound

    def _expand_into(
        self,
        layer: int,
        projection: str,
        u: torch.Tensor,
        y: torch.Tensor,
        bound: int,
        *,
        write: bool = False,
    ) -> None:
        """Launch the expand of u (the shrink's) adding into y (write: storing into y)."""
        sub_blocks = 1 if y.shape[0] <= self._decode_rows else self._wide_sub_blocks
        self._expand(
            u,
            self.slots.b[layer][projection],
            y,
            self._tiles,
            self._row_indices,
            self.slots.kernel_rank_tensors[projection],
            self._blocks[projection, sub_blocks],
            tile_rows=TILE_ROWS,
            tile_bound=bound,
            sub_blocks=sub_blocks,
            write=write,
        )

    def _native_layout(self, batch: LoRABatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's adapter rows and their slots for the native kernel (None: not used)."""
        if self.cpu_kernels is None or batch.is_empty or not self.slots.bt_stacks:
            return None
        # Grouped by slot: one adapter's factors stay in cache across its rows.
        pairs = sorted(
            (slot, row)
            for start, length, slot in zip(batch.starts, batch.lengths, batch.slots, strict=True)
            for row in range(start, start + length)
        )
        row_slots = torch.tensor([slot for slot, _ in pairs], dtype=torch.int32)
        return torch.tensor([row for _, row in pairs], dtype=torch.int32), row_slots

    def _native_fits(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> bool:
        """Whether this projection's tensors are what the native kernel takes (the slots'
        transposed B is float32 and contiguous with A)."""
        return (
            self.cpu_kernels.supports(x)
            and x.dtype == y.dtype
            and x.stride(1) == 1
            and y.stride(1) == 1
            and a.dtype == torch.float32
            and a.is_contiguous()
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
        return (
            self._index_tensor(rows),
            self._index_tensor(padded_index),
            group_size,
            low,
            high,
        )

    def _index_tensor(self, values: list[int]) -> torch.Tensor:
        """int64 `values` on the slots' device; on a GPU through pinned memory without waiting
        (a pageable copy would wait for the step in flight)."""
        tensor = torch.tensor(values, dtype=torch.long)
        if self.slots.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.slots.device, non_blocking=True)


def plain_weight(
    base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor | None:
    """The weight W of a base projection that computes a plain `x Wᵀ` for these rows (no bias,
    x's dtype), which a matmul can add onto what y already holds; None for any other base.
    A module says so with `plain_weight(rows)` (the CUDA fast path's TunedLinear); an
    nn.Linear without bias is one."""
    declared = getattr(base, "plain_weight", None)
    if callable(declared):
        weight = declared(x.shape[0])
    elif type(base) is nn.Linear and base.bias is None:
        weight = base.weight
    else:
        return None
    if weight is None or weight.dtype != x.dtype or weight.dim() != 2:
        return None
    return weight if weight.shape[1] == x.shape[1] else None
