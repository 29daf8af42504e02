"""CudaModelRunner: the engine's model runner on a CUDA device, with the fast path where it can.

BaseModelRunner builds the model, its weights (already fused: one QKV and one gate/up matrix
per layer) and the paged KV cache on the GPU. Where the fast path covers the model (no
projection biases or q/k norm, power-of-two head size, Triton importable), this runner binds
backends/cuda_fast_path.CudaFastPath to the same model and cache: Triton kernels for fused
add + RMSNorm, rotary + KV store, paged attention and SwiGLU, the skinny matmul where it
measures faster than cuBLAS, and pure decode steps as one CUDA graph replay per batch-size
bucket. A decode step copies its token ids, positions and block tables from pinned host
buffers without a sync, so the only wait of a step is the engine reading the sampled tokens.
`launch_greedy` enqueues an all-greedy step and returns a handle at once, so LLMEngine can
launch step N+1 (its decode tokens fed on the GPU from step N's argmax) before it reads step
N's ids (services/engine/overlap.py); the runner declares that in its capabilities. Prefill
and mixed steps run the same kernels eagerly. `reference_execute` runs a step through the
plain torch ops on the same weights and cache, for checks. Models the fast path does not
cover run those plain ops (with the configured attention backend) for every step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.common.errors import InvalidArgumentError
from services.common.model_files import ModelFiles
from services.engine.config import EngineConfig
from services.engine.cuda_graph import BASE, DEFAULT_BUCKETS
from services.engine.forward_batch import ScheduledBatch
from services.engine.kernels import triton_available
from services.engine.lora.config import LoRAConfig
from services.engine.model_runner import (
    BaseModelRunner,
    PendingTokens,
    RunnerCapabilities,
    runner_arguments,
    to_device,
)
from services.engine.models.config import ModelConfig
from services.engine.parallel.guard import after_send
from services.engine.sequence import PENDING_TOKEN

if TYPE_CHECKING:
    from services.engine.lora.engine_adapters import EngineAdapters
    from services.engine.lora.fused import FusedDecode
    from services.engine.lora.runtime import LoRARuntime

logger = logging.getLogger(__name__)

# Attention backends the fast path replaces (it brings its own fused "cuda" attention).
FAST_PATH_BACKENDS = ("torch", "cuda")
# Decode row counts whose projections may take the Triton skinny matmul (tuned per role).
SKINNY_ROW_COUNTS = (1, 2, 4, 8)
# The decode graphs captured with the LoRA kernels (services/engine/cuda_graph.py variants), and
# those of small buckets for steps of at least MANY_ADAPTERS distinct adapters, whose deltas go
# before the base matmul (services/engine/lora/runtime.py, SIDE_SHRINK_MAX_ROWS).
LORA_GRAPHS = "lora"
LORA_MANY_GRAPHS = "lora-many"
MANY_ADAPTERS = 4
# Decode graphs for steps whose adapter rows all use one adapter, its LoRA folded into the base
# kernels (services/engine/lora/fused.py): no LoRA kernel launches at all.
LORA_ONE_GRAPHS = "lora-one"


def fast_path_unsupported(config: ModelConfig) -> str | None:
    """Why the CUDA fast path cannot run this model, or None when it can."""
    if config.qkv_bias or config.output_bias or config.mlp_bias:
        return "projection biases"
    if config.qk_norm:
        return "per-head q/k norm"
    if config.head_dim < 16 or config.head_dim & (config.head_dim - 1):
        return f"head_dim {config.head_dim} (needs a power of two >= 16)"
    if config.num_heads % config.num_kv_heads:
        return "heads not a multiple of KV heads"
    return None


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The default buckets up to the first one holding max_num_seqs rows."""
    buckets = [size for size in DEFAULT_BUCKETS if size < max_num_seqs]
    larger = [size for size in DEFAULT_BUCKETS if size >= max_num_seqs]
    buckets.append(larger[0] if larger else DEFAULT_BUCKETS[-1])
    return tuple(buckets)


@dataclass(frozen=True)
class CudaRunnerCapabilities(RunnerCapabilities):
    """RunnerCapabilities plus the decode batch sizes captured as CUDA graphs (each of which a
    warm-up replays once: services/engine/warmup.py)."""

    graph_batch_sizes: tuple[int, ...] = ()


class CudaModelRunner(BaseModelRunner):
    """The model on a GPU; its steps run the Triton kernels and, for decode, captured CUDA
    graphs, wherever the fast path covers the model (`self.fast` is None where it does not)."""

    def __init__(
        self,
        model_files: ModelFiles,
        *,
        max_num_seqs: int = 256,
        use_cuda_graphs: bool = True,
        fast_path: bool = True,
        lora_fold_rank: int = 0,
        **kwargs,
    ) -> None:
        kwargs.setdefault("device", "cuda")
        if torch.device(kwargs["device"]).type != "cuda":
            raise InvalidArgumentError(
                f"CudaModelRunner needs a CUDA device, not {kwargs['device']}"
            )
        if not torch.cuda.is_available():
            raise InvalidArgumentError("device 'cuda' requested but CUDA is not available")
        self._max_num_seqs = max_num_seqs
        self.use_cuda_graphs = use_cuda_graphs
        self._want_fast_path = fast_path
        self.fast = None
        self.fast_path_off_reason: str | None = None
        self.execution_path = ""  # how steps run, in words (EngineInfo, `sluice up`'s log)
        self.graph_steps = 0
        self.eager_steps = 0
        # Room below each projection weight for one adapter's A of this rank, given at load
        # (lora/fused.py: the fold of one-adapter decode steps); 0: none.
        self.lora_fold_rank = lora_fold_rank
        self._fold_weights: dict[tuple[int, str], torch.Tensor] = {}
        super().__init__(model_files, **kwargs)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, model_files: ModelFiles) -> CudaModelRunner:
        lora = LoRAConfig.from_engine_config(config)
        return cls(
            model_files,
            max_num_seqs=config.max_num_seqs,
            lora_fold_rank=lora.max_lora_rank if lora.enabled and lora.fused_decode else 0,
            **runner_arguments(config),
        )

    def _prepare_model(self) -> None:
        if self.lora_fold_rank and self.tensor_parallel is None and self._why_not_fast() is None:
            from services.engine.lora.fused import widen_for_fold

            self._fold_weights = widen_for_fold(self.model, self.model_config, self.lora_fold_rank)

    def _why_not_fast(self) -> str | None:
        if not self._want_fast_path:
            return "turned off"
        if self.backend_name not in FAST_PATH_BACKENDS:
            return f"backend {self.backend_name!r}"
        if not triton_available():
            return "Triton is not installed"
        return fast_path_unsupported(self.model_config)

    def _reads_narrow_kv(self) -> bool:
        # The fast path's attention and backend cuda's are the Triton kernels (paged_kv).
        return self.fast is not None or self.backend_name == "cuda"

    def _bind_kernels(self) -> str:
        reason = self._why_not_fast()
        if reason is not None:
            self.fast_path_off_reason = reason
            self.capabilities = RunnerCapabilities(greedy_ids=True)
            self.execution_path = f"CUDA fast path off ({reason}): {self.backend_name} ops"
            return self.execution_path
        from services.engine.backends.cuda_fast_path import CudaFastPath

        config = self.model_config
        max_num_seqs = self._max_num_seqs
        self.fast = CudaFastPath(
            self.model,
            list(self.kv_cache.layers),
            block_size=self.block_size,
            max_blocks_per_seq=-(-config.max_model_len // self.block_size),
            graph_buckets=graph_buckets(max_num_seqs),
        )
        tuned = self._tune_skinny_matmuls()
        if self.use_cuda_graphs:
            self.fast.capture_graphs()
            if self.tensor_parallel is not None:  # graphs hold work of the group's communicators
                self.tensor_parallel.before_leaving.append(self.fast.graphs.clear)
        largest = self.fast.graphs.max_batch_size
        width = self.fast._static.block_tables.shape[1]
        # Two sets of pinned inputs and of sampled-id outputs, used in turn, so preparing step
        # N+1 never waits for step N (only for the copies of step N-1, long done).
        self._host_inputs = [_HostInputs(largest, width) for _ in range(2)]
        rows = max(largest, max_num_seqs)
        self._id_outputs = [torch.zeros(rows, dtype=torch.long).pin_memory() for _ in range(2)]
        self._id_events = [torch.cuda.Event(), torch.cuda.Event()]
        for event in self._id_events:
            event.record()
        self._turn = 0
        self._last_launch_end: torch.cuda.Event | None = None  # timing event (PendingIds)
        # The last launch's sampled ids on the device and each sequence's row in them: the
        # source of a pending token (sequence.PENDING_TOKEN) in the next step.
        self._previous_rows: dict[int, int] = {}
        self._previous_ids: torch.Tensor | None = None
        # LLMEngine schedules a step ahead only for batches one graph replay takes.
        self.capabilities = CudaRunnerCapabilities(
            greedy_ids=True,
            overlap_max_batch=largest if self.use_cuda_graphs else 0,
            overlap_mixed=self.use_cuda_graphs,
            graph_batch_sizes=self.fast.graphs.buckets if self.use_cuda_graphs else (),
        )
        self.execution_path = (
            f"CUDA fast path: graphs {'on' if self.use_cuda_graphs else 'off'} for buckets "
            f"{self.fast.graphs.buckets}, skinny matmuls {len(self.fast.skinny_choices)} "
            f"({tuned})"
        )
        return self.execution_path

    @property
    def lora_kernels(self) -> str:
        """The Triton shrink/expand kernels with the fast path; plain torch ops otherwise."""
        return "triton" if self.fast is not None else "torch"

    def lora_max_rows(self, config: EngineConfig) -> int:
        """A step's tokens, or a padded graph bucket's rows, whichever is more."""
        largest = self.fast.graphs.max_batch_size if self.fast is not None else 0
        return max(config.max_num_batched_tokens, largest)

    def bind_lora(self, adapters: EngineAdapters) -> None:
        """Wrap the projections (the fast path's tuned ones too) and capture the decode graphs
        again as a "lora" variant with the LoRA kernels in every replay (slot indices are graph
        inputs, so a new adapter mix needs no recapture), and the small buckets once more for
        steps of many adapters ("lora-many"); with `fused_decode`, once more for steps of one
        adapter, whose LoRA runs inside the base kernels ("lora-one"). A step without adapter
        rows keeps replaying the base graphs, which do no LoRA work. With `fused_swiglu`,
        SwiGLU adds gate_up's deltas wherever a step writes its deltas first (graphs and
        eager steps alike)."""
        super().bind_lora(adapters)
        if self.fast is None:
            return
        runtime = adapters.runtime
        if self.tensor_parallel is None:
            # The norms, SwiGLU and the rotary store add the deltas of the one-adapter fold
            # (runtime.fused) and, with fused_swiglu, SwiGLU those of gate_up in steps of
            # several adapters (LoRARuntime.take)
            self.fast.bind_epilogues(runtime)
            if adapters.config.fused_swiglu:
                runtime.tile_consumer = self.fast.ops
            runtime.delta_projections = self.fast.delta_projections
        if not self.use_cuda_graphs:
            return
        graphs = self.fast.graphs
        runtime.graph_rows = graphs.max_batch_size  # wider steps never replay
        runtime.graph_buckets = graphs.buckets
        self._capture_lora_graphs(runtime, side_deltas=adapters.config.side_deltas)
        if adapters.config.fused_decode and self.tensor_parallel is None:
            runtime.fused = self._capture_fused(adapters)

        def select(bucket: int) -> str:
            batch = runtime.batch
            if batch.is_empty:
                return BASE
            fused = runtime.fused  # None: steps of one adapter replay the "lora" graphs
            if fused is not None and fused.supports(batch) and graphs.has(LORA_ONE_GRAPHS, bucket):
                fused.prepare(batch, bucket)
                return LORA_ONE_GRAPHS
            if len(batch.distinct_slots) >= MANY_ADAPTERS and graphs.has(LORA_MANY_GRAPHS, bucket):
                return LORA_MANY_GRAPHS
            return LORA_GRAPHS

        graphs.select_variant = select

    def _capture_lora_graphs(self, runtime: LoRARuntime, *, side_deltas: bool) -> None:
        """Capture the decode graphs of steps of several adapters: with `side_deltas` (and the
        fast path's kernels adding written deltas) one "lora" set whose LoRA kernels run on a
        side stream beside each base matmul (lora/runtime.py); otherwise "lora" (the shrink
        beside the matmul up to SIDE_SHRINK_MAX_ROWS rows, deltas first above) and "lora-many"
        for the small buckets (deltas first)."""
        from services.engine.lora.batch import LoRABatch

        graphs = self.fast.graphs
        graphs.drop(LORA_GRAPHS)
        graphs.drop(LORA_MANY_GRAPHS)
        side_deltas = side_deltas and bool(runtime.delta_projections)
        # No tiles while the warm-up steps run the kernels eagerly: a step's layout left from
        # serving names rows past a smaller bucket's.
        runtime.set_batch(LoRABatch(0))
        small = min(runtime.side_shrink_max_rows, runtime.max_rows)
        started = time.perf_counter()
        runtime.launch_always = True
        runtime.side_deltas = side_deltas
        try:
            self.fast.capture_graphs(LORA_GRAPHS)
            if not side_deltas and graphs.buckets[0] <= small:
                runtime.graph_deltas_first = True
                self.fast.capture_graphs(LORA_MANY_GRAPHS, max_size=small)
        finally:
            runtime.launch_always = runtime.graph_deltas_first = runtime.side_deltas = False
        logger.info(
            "LoRA decode graphs of several adapters captured in %.1fs (%s)",
            time.perf_counter() - started,
            "LoRA kernels beside each projection" if side_deltas else "LoRA kernels in line",
        )

    def recapture_lora_graphs(self, adapters: EngineAdapters, *, side_deltas: bool) -> None:
        """Capture the decode graphs of several adapters again, the LoRA kernels beside the
        base matmuls or in line (benchmarks compare both in one process)."""
        if self.fast is None or not self.use_cuda_graphs or adapters.runtime.graph_rows == 0:
            raise RuntimeError("no LoRA decode graphs to capture on this runner")
        self._capture_lora_graphs(adapters.runtime, side_deltas=side_deltas)

    def _capture_fused(self, adapters: EngineAdapters) -> FusedDecode | None:
        """Fold one adapter's LoRA into the base kernels and capture the "lora-one" graphs;
        None (those steps keep the "lora" graphs) where a projection cannot take it or the
        capture fails."""
        from services.engine.lora.fused import FusedDecode, captured, fusable
        from services.engine.lora.wrap import LoRALinear

        slots, runtime = adapters.slots, adapters.runtime
        bases = []
        for module in self.model.modules():
            if isinstance(module, LoRALinear):
                shape = slots.shapes[module.projection]
                if not fusable(module.base, shape.out_features, shape.in_features, slots.dtype):
                    logger.info("LoRA decode not fused: %s is not a plain projection", module)
                    return None
                bases.append((module.layer, module.projection, module.base))
        started = time.perf_counter()
        fused = FusedDecode(slots, self.fast.graphs.max_batch_size)
        fused.bind(bases, self._fold_weights)
        runtime.fused = fused  # the kernels ask the runtime (bound in bind_lora), it asks this
        try:
            captured(fused, lambda: self.fast.capture_graphs(LORA_ONE_GRAPHS))
        except Exception:  # any model the fast path takes should fold; say so and go on
            logger.exception("LoRA decode not fused: capturing the one-adapter graphs failed")
            self.fast.graphs.drop(LORA_ONE_GRAPHS)
            runtime.fused = None
            return None
        logger.info(
            "LoRA decode of one adapter fused into the base kernels: %.1f MB, captured in %.1fs",
            fused.nbytes / 1e6,
            time.perf_counter() - started,
        )
        return fused

    def _tune_skinny_matmuls(self) -> str:
        """Bind the skinny-matmul choices saved for this GPU, shape, dtype and kernel code
        (services/engine/tuning_cache.py), or tune them now and save them; says which."""
        import triton

        from services.engine import tuning_cache
        from services.engine.kernels.triton import skinny_matmul

        config = self.model_config
        shape = {
            name: getattr(config, name)
            for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                         "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings")
        }  # fmt: skip
        device_name = torch.cuda.get_device_name(self.device)
        dtype = str(self.dtype).removeprefix("torch.")
        version = tuning_cache.code_version(
            Path(skinny_matmul.__file__),
            extra=f"torch {torch.__version__} triton {triton.__version__}",
        )
        key = tuning_cache.tuning_key(
            device_name=device_name, model_shape=shape, dtype=dtype, code_version=version
        )
        started = time.perf_counter()
        saved = tuning_cache.load_choices(key)
        if saved is not None and self.fast.apply_skinny_choices(saved, SKINNY_ROW_COUNTS):
            return f"choices loaded from the tuning cache, key {key}"
        self.fast.tune_skinny_matmuls(SKINNY_ROW_COUNTS)
        about = {"device": device_name, "dtype": dtype, "shape": shape, "code": version}
        path = tuning_cache.save_choices(key, self.fast.skinny_choices_record(), about=about)
        elapsed = time.perf_counter() - started
        return f"tuned in {elapsed:.1f}s" + (f", saved to {path}" if path else ", not saved")

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; float32 logits [batch.num_logits, vocab_size] on the GPU."""
        if self.fast is None:
            return super().execute(batch)
        self._previous_rows = {}
        if not batch.sequences:
            return torch.empty((0, self.model_config.vocab_size), device=self.device)
        if self._graph_ready(batch):
            return self._graph_decode(batch)[0]
        return self._eager(batch)

    @torch.inference_mode()
    def execute_greedy(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; int64 argmax token ids [batch.num_logits] (the all-greedy path): a
        graph decode step already samples on the GPU, so only those ids reach the host."""
        if self.fast is None:
            return super().execute_greedy(batch)
        self._previous_rows = {}
        if not batch.sequences:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        if self._graph_ready(batch):
            return self._graph_decode(batch)[1]
        return self._eager(batch).argmax(dim=-1)

    @torch.inference_mode()
    def launch_greedy(self, batch: ScheduledBatch) -> PendingTokens:
        """Enqueue one all-greedy step and return at once; `.result()` waits for its argmax
        ids [batch.num_logits]. A decode token may be sequence.PENDING_TOKEN: it is then the
        id the previous launch sampled for the same sequence, fed on the device."""
        if self.fast is None:
            return super().launch_greedy(batch)
        started = torch.cuda.Event(enable_timing=True)
        started.record()
        if not batch.sequences:
            ids = torch.empty((0,), dtype=torch.int64, device=self.device)
        elif self._graph_ready(batch):
            ids = self._graph_decode(batch)[1]
        else:
            ids = self._eager(batch, with_pending=True).argmax(dim=-1)
        sampled = [seq.seq_id for seq in batch.sequences if seq.needs_logits]
        self._previous_rows = {seq_id: row for row, seq_id in enumerate(sampled)}
        self._previous_ids = ids
        turn = self._turn
        self._turn ^= 1
        host, event = self._id_outputs[turn], self._id_events[turn]
        event.synchronize()  # that buffer's copy (two launches ago) has landed
        count = ids.shape[0]
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        host[:count].copy_(ids, non_blocking=True)
        event.record()
        previous, self._last_launch_end = self._last_launch_end, ended
        return PendingIds(host[:count], event, (started, ended, previous))

    def _graph_ready(self, batch: ScheduledBatch) -> bool:
        return (
            self.use_cuda_graphs
            and batch.is_pure_decode
            and len(batch.sequences) <= self.fast.graphs.max_batch_size
            and all(seq.needs_logits for seq in batch.sequences)
        )

    def _eager(self, batch: ScheduledBatch, *, with_pending: bool = False) -> torch.Tensor:
        """Prefill, mixed or oversized steps: the fused kernels without a graph. With
        `with_pending`, a decode row's sequence.PENDING_TOKEN is the id the previous launch
        sampled for that sequence, filled in on the device (no wait for it)."""
        pending: list[tuple[int, int]] | None = [] if with_pending else None
        input_ids, positions, metadata = self.prepare_inputs(batch, pending=pending)
        if pending:
            self._fill_pending(input_ids, pending)
        if self.tensor_parallel is not None:  # the other ranks run the same step
            self.tensor_parallel.send_step(input_ids, positions, metadata)
        self.eager_steps += 1
        # Every token's K/V lands in the cache, whether any row samples or not.
        with after_send(self.tensor_parallel):
            return self.fast.forward(input_ids, positions, metadata)

    def _fill_pending(self, input_ids: torch.Tensor, pending: list[tuple[int, int]]) -> None:
        """input_ids[index] = the previous launch's id for each (flat index, seq_id)."""
        rows = self._previous_rows
        pairs = []
        for index, seq_id in pending:
            source = rows.get(seq_id)
            if source is None:
                raise InvalidArgumentError(
                    f"sequence {seq_id} has a pending token the last step did not sample"
                )
            pairs.append((index, source))
        index, source = to_device(pairs, torch.long, self.device).t()
        input_ids.index_copy_(0, index, self._previous_ids.index_select(0, source))

    @torch.inference_mode()
    def reference_execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """The same step through the plain torch ops (the CPU path's code), for checks."""
        if self.fast is None:
            return super().execute(batch)
        with self.fast.reference():
            return super().execute(batch)

    def _graph_decode(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits [n, vocab], argmax ids [n]): views of the graph's static outputs."""
        sequences = batch.sequences
        count = len(sequences)
        block_size = self.block_size
        vocab = self.model_config.vocab_size
        limit = self.model_config.max_model_len
        width = max(len(seq.block_table) for seq in sequences)
        if width > self._host_inputs[0].tables.shape[1]:
            raise InvalidArgumentError(f"a block table of {width} blocks exceeds max_model_len")
        tokens, positions, sources = [], [], []
        pending = False
        for seq in sequences:
            token, position = seq.token_ids[0], seq.start_position
            if token == PENDING_TOKEN:
                source = self._previous_rows.get(seq.seq_id)
                if source is None:
                    raise InvalidArgumentError(
                        f"sequence {seq.seq_id} has a pending token the last step did not sample"
                    )
                token, pending = 0, True
            elif not 0 <= token < vocab:
                raise InvalidArgumentError(f"token ids must be in [0, {vocab})")
            else:
                source = -1
            if position >= limit:
                raise InvalidArgumentError(
                    f"sequence {seq.seq_id} reaches {position + 1} tokens, over max_model_len "
                    f"{limit}"
                )
            table = seq.block_table
            if len(table) * block_size <= position:
                raise InvalidArgumentError(
                    f"sequence {seq.seq_id}: {len(table)} blocks cannot hold {position + 1} tokens"
                )
            tokens.append(token)
            positions.append(position)
            sources.append(source)
        host = self._host_inputs[self.graph_steps % 2]
        host.copies_done.synchronize()  # the copies of two steps ago have left these buffers
        host.ids[:count] = torch.tensor(tokens, dtype=torch.long)
        host.positions[:count] = torch.tensor(positions, dtype=torch.long)
        tables = host.tables_array  # numpy view of the pinned rows: no nested-list tensor
        for row, seq in enumerate(sequences):
            tables[row, : len(seq.block_table)] = seq.block_table
        if pending:
            host.sources[:count] = torch.tensor(sources, dtype=torch.long)
        # Whole rows (contiguous, pinned): entries past a row's blocks (stale) are never read.
        if self.tensor_parallel is not None:  # the other ranks replay the same graph
            self.tensor_parallel.send_decode(
                host.ids[:count],
                host.positions[:count],
                host.tables[:count],
                host.sources[:count] if pending else None,
            )
        with after_send(self.tensor_parallel):
            outputs = self.fast.decode(
                host.ids[:count],
                host.positions[:count],
                host.tables[:count],
                sources=host.sources[:count] if pending else None,
                previous_ids=self._previous_ids,
                copies_done=host.copies_done,
            )
        self.graph_steps += 1
        return outputs


class PendingIds:
    """Sampled ids on their way to pinned host memory; result() waits for them.

    `device_time_s()` (after result()) is the step's time on the device: from its first work,
    or from the end of the launch before it if the device was still on that, to its ids.
    Host work of a later launch planned meanwhile is not in it, nor time the device idled
    before the step began.
    """

    def __init__(
        self,
        host: torch.Tensor,
        copied: torch.cuda.Event,
        timing: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event | None],
    ) -> None:
        self._host = host
        self._copied = copied
        self._timing = timing

    def result(self) -> list[int]:
        self._copied.synchronize()
        return self._host.tolist()

    def device_time_s(self) -> float:
        started, ended, previous = self._timing
        ms = started.elapsed_time(ended)
        if previous is not None:
            ms = min(ms, previous.elapsed_time(ended))
        return max(ms, 0.0) / 1000.0


class _HostInputs:
    """Pinned host buffers one graph decode step copies its inputs from."""

    def __init__(self, rows: int, width: int) -> None:
        self.ids = torch.zeros(rows, dtype=torch.long).pin_memory()
        self.positions = torch.zeros(rows, dtype=torch.long).pin_memory()
        self.tables = torch.zeros((rows, width), dtype=torch.int32).pin_memory()
        self.tables_array = self.tables.numpy()
        self.sources = torch.full((rows,), -1, dtype=torch.long).pin_memory()
        self.copies_done = torch.cuda.Event()
        self.copies_done.record()
