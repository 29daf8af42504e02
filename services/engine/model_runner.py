"""The model runner interface LLMEngine drives, and the device-neutral base of its runners.

A runner owns the weights, the paged KV cache and the attention backend, and runs one step:
`execute(batch)` turns the scheduler's ScheduledBatch into flat tensors (token ids, positions,
cache slots, per-sequence offsets and lengths, padded block tables), runs the model over the
paged cache, and returns float32 logits only for the sequences that sample this step (the LM
head runs on those rows alone). Host-side preparation is a handful of list operations and one
tensor per field, so the per-step overhead stays small at batch 1 and batch 32 alike.

`ModelRunner` is the protocol: what LLMEngine reads, including the `RunnerCapabilities` a
runner declares (an argmax-only greedy step, steps launched without waiting), so the engine
never probes a runner for optional methods. `BaseModelRunner` is what every device shares
(configuration, weights, KV cache, input preparation, the plain forward); cpu_runner.py and
cuda_runner.py are its siblings, and runner_factory.py picks one by device type.

Default dtype (`default_dtype`): bfloat16 on CUDA; on CPU bfloat16 when the CPU multiplies
bf16 natively (AVX512-BF16 or AMX, ~4x the float32 matmul rate on such CPUs, as vLLM's CPU
backend defaults to), else float32. KV budget per kv_cache.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.common.model_files import ModelFiles
from services.common.protocol.dummy_shapes import dummy_config
from services.engine.backends.base import get_backend
from services.engine.config import EngineConfig
from services.engine.forward_batch import ScheduledBatch
from services.engine.kv_cache import KVCache
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.loader.weights import build_model
from services.engine.models.config import ModelConfig
from services.engine.parallel.guard import after_send
from services.engine.sequence import PENDING_TOKEN

if TYPE_CHECKING:
    from services.engine.lora.engine_adapters import EngineAdapters
    from services.engine.parallel.group import TensorParallelRank

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerCapabilities:
    """What a runner can do beyond `execute`; LLMEngine plans its steps from these."""

    # execute_greedy returns the argmax ids without building the [rows, vocab] logits.
    greedy_ids: bool = False
    # launch_greedy enqueues an all-greedy step and returns at once, for batches of at most
    # this many sequences, so the engine may schedule the next step before reading its ids
    # (services/engine/overlap.py); 0: the runner cannot.
    overlap_max_batch: int = 0
    # launch_greedy also takes pending tokens in steps with prompt rows (eager steps of any
    # size), so the engine may plan any all-greedy step ahead: admissions, LoRA slot turns
    # and chunked prefills included, not only a graph replay of the same running set.
    overlap_mixed: bool = False

    @property
    def supports_overlap(self) -> bool:
        return self.overlap_max_batch > 0


class PendingTokens(Protocol):
    """A launched step's sampled ids; `result()` waits for them (one per sampled sequence).
    A handle may also have `device_time_s()`: the step's own time on the device, read after
    `result()` (LLMEngine reports it as the step's time)."""

    def result(self) -> list[int]: ...


class ModelRunner(Protocol):
    """One model on one device with its paged KV cache, as LLMEngine uses it."""

    model_config: Any  # ModelConfig: name, vocab_size, max_model_len, eos_token_ids
    model_files: ModelFiles | None
    num_blocks: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    capabilities: RunnerCapabilities

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; float32 logits [batch.num_logits, vocab_size]."""
        ...

    def execute_greedy(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; int64 argmax ids [batch.num_logits] (capabilities.greedy_ids)."""
        ...

    def launch_greedy(self, batch: ScheduledBatch) -> PendingTokens:
        """Enqueue one all-greedy step and return at once (capabilities.overlap_max_batch)."""
        ...


class BaseModelRunner:
    """Configuration, weights, KV cache, input preparation and the plain forward of a runner.

    Subclasses set up their device around the build through three hooks: `_prepare_device`
    (before any weight exists), `_prepare_model` (weights loaded, no cache yet) and
    `_bind_kernels` (cache and attention bound).
    """

    capabilities = RunnerCapabilities(greedy_ids=True)
    lora_kernels = "torch"  # the LoRA runtime's kernels here (services/engine/lora/runtime.py)

    def __init__(
        self,
        model_files: ModelFiles,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        backend: str = "torch",
        seed: int = 0,
        tensor_parallel: TensorParallelRank | None = None,
    ) -> None:
        self.model_files: ModelFiles | None = model_files
        # One rank of a tensor-parallel group (services/engine/parallel/): this rank's shard of
        # the model and of the KV cache; rank 0 sends each step's inputs to the others.
        self.tensor_parallel = tensor_parallel
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.block_size = block_size
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, self.dtype)
        if self.kv_dtype != self.dtype and self.device.type != "cuda":
            raise InvalidArgumentError(
                f"kv_cache_dtype {kv_cache_dtype} needs a CUDA device, not {self.device}"
            )
        full_config = load_model_config(model_files, max_model_len)
        self.model_config = full_config
        if tensor_parallel is not None:  # this rank's heads and MLP width
            self.model_config = tensor_parallel.local_config(full_config)
        config = self.model_config
        self.backend_name = backend
        self._prepare_device(config)
        backend_cls = get_backend(backend)  # fail fast, before loading any weights
        torch.manual_seed(seed)
        build = build_model if tensor_parallel is None else tensor_parallel.build_model
        self.model = build(
            full_config,
            weights_dir=model_files.weights_dir,
            device=self.device,
            dtype=self.dtype,
            seed=seed,
        )
        self._prepare_model()
        self.backend = backend_cls(
            config.num_heads, config.num_kv_heads, config.head_dim, config.head_dim**-0.5
        )
        self.kv_cache = KVCache.allocate(
            config,
            block_size=block_size,
            dtype=self.kv_dtype,
            device=self.device,
            kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        self.num_blocks = self.kv_cache.num_blocks
        if tensor_parallel is not None:  # rank 0's block manager hands out what all ranks hold
            self.num_blocks = tensor_parallel.agree_num_blocks(self.num_blocks)
        self.model.bind_attention(self.backend, self.kv_cache.layers)
        extras = self._bind_kernels()
        if self.kv_dtype != self.dtype and not self._reads_narrow_kv():
            raise FailedPreconditionError(
                f"kv_cache_dtype {kv_cache_dtype} needs the Triton attention of the CUDA fast "
                f"path or backend cuda, which this model does not run"
            )
        logger.info(
            "model %s on %s (%s): %d KV blocks of %d tokens%s, backend %s%s",
            config.name,
            self.device,
            self.dtype,
            self.num_blocks,
            block_size,
            f" ({self.kv_dtype})" if self.kv_dtype != self.dtype else "",
            backend,
            f", {extras}" if extras else "",
        )

    # ---- device hooks ---------------------------------------------------------------------
    def _prepare_device(self, config: ModelConfig) -> None:
        """Before the weights are built (threads, allocator, device checks)."""

    def _prepare_model(self) -> None:
        """After the weights are built, before the KV cache is allocated."""

    def _bind_kernels(self) -> str:
        """After cache and attention are bound; returns what to add to the start-up line."""
        return ""

    def _reads_narrow_kv(self) -> bool:
        """Whether every attention this runner runs reads a KV cache narrower than the model's
        dtype (kv_cache_dtype fp8), converting each tile as it loads it."""
        return False

    # ---- LoRA -----------------------------------------------------------------------------
    def lora_max_rows(self, config: EngineConfig) -> int:
        """The most rows one step hands the LoRA runtime."""
        return config.max_num_batched_tokens

    def bind_lora(self, adapters: EngineAdapters) -> None:
        """Make the model's projections add each step's adapter deltas (after packing)."""
        if self.tensor_parallel is not None:
            raise FailedPreconditionError("LoRA adapters are not served with tensor parallelism")
        adapters.attach(self.model)

    # ---- steps ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; float32 logits [batch.num_logits, vocab_size] on self.device."""
        selected = self._forward(batch)
        if selected is None:
            return torch.empty((0, self.model_config.vocab_size), device=self.device)
        return self.model.compute_logits(selected).float()

    @torch.inference_mode()
    def execute_greedy(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; int64 argmax token ids [batch.num_logits] (the all-greedy fast path).

        Same tokens as `execute(batch).argmax(-1)`, without building the full logits.
        """
        selected = self._forward(batch)
        if selected is None:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        return self.model.compute_greedy(selected)

    def launch_greedy(self, batch: ScheduledBatch) -> PendingTokens:
        """Runners that declare no overlap (capabilities) cannot launch without waiting."""
        raise FailedPreconditionError(
            f"{type(self).__name__} cannot launch a step without waiting for it"
        )

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Hidden states of the rows that need logits, or None when no row does."""
        if not batch.sequences:
            return None
        input_ids, positions, metadata = self.prepare_inputs(batch)
        if self.tensor_parallel is not None:
            self.tensor_parallel.send_step(input_ids, positions, metadata)
        with after_send(self.tensor_parallel):
            self.backend.prepare(metadata)
            hidden = self.model(input_ids, positions, metadata)
        if metadata.logits_indices.numel() == 0:
            return None
        return hidden.index_select(0, metadata.logits_indices)

    def prepare_inputs(
        self, batch: ScheduledBatch, *, pending: list[tuple[int, int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat tensors of one step: token ids, positions and the attention metadata.

        With `pending` (a list to fill), a decode token may be sequence.PENDING_TOKEN: its
        (flat index, seq_id) goes into `pending` and its id stays 0 for the caller to fill on
        the device.
        """
        block_size = self.block_size
        max_model_len = self.model_config.max_model_len
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        max_blocks = 0
        max_query_len = 0
        total = 0
        for seq in batch.sequences:
            count = len(seq.token_ids)
            start = seq.start_position
            end = start + count
            table = seq.block_table
            num_blocks = len(table)
            if count == 0:
                raise InvalidArgumentError(f"sequence {seq.seq_id} schedules no tokens")
            if num_blocks * block_size < end:
                raise InvalidArgumentError(
                    f"sequence {seq.seq_id}: {num_blocks} blocks cannot hold {end} tokens"
                )
            if end > max_model_len:
                raise InvalidArgumentError(
                    f"sequence {seq.seq_id} reaches {end} tokens, over max_model_len "
                    f"{max_model_len}"
                )
            if pending is not None and count == 1 and seq.token_ids[0] == PENDING_TOKEN:
                pending.append((total, seq.seq_id))
                token_ids.append(0)
            else:
                token_ids += seq.token_ids
            if count == 1:  # a decode: one position, one slot
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                span = range(start, end)
                positions += span
                slots += [table[pos // block_size] * block_size + pos % block_size for pos in span]
            total += count
            query_start_loc.append(total)
            seq_lens.append(end)
            context_lens.append(start)
            if seq.needs_logits:
                logits_indices.append(total - 1)
            if num_blocks > max_blocks:
                max_blocks = num_blocks
            if count > max_query_len:
                max_query_len = count
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidArgumentError(f"token ids must be in [0, {vocab})")
        tables = [
            seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch.sequences
        ]
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, device),
            query_start_loc=to_device(query_start_loc, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            context_lens=to_device(context_lens, torch.int32, device),
            block_tables=to_device(tables, torch.int32, device),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            is_pure_decode=max_query_len == 1,
            logits_indices=to_device(logits_indices, torch.int64, device),
            block_size=block_size,
            query_start_loc_host=query_start_loc,
            seq_lens_host=seq_lens,
            context_lens_host=context_lens,
        )
        input_ids = to_device(token_ids, torch.int64, device)
        position_tensor = to_device(positions, torch.int64, device)
        return input_ids, position_tensor, metadata


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` on `device`. On a GPU through pinned memory without waiting: the
    host goes on launching the step while the device still runs the one before (a pageable
    copy would wait for it); PyTorch's pinned-memory cache keeps the buffer until the copy ran."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def runner_arguments(config: EngineConfig) -> dict[str, Any]:
    """The BaseModelRunner arguments every runner takes from an EngineConfig."""
    return dict(
        device=config.resolved_device(),
        dtype=None if config.dtype == "auto" else getattr(torch, config.dtype),
        block_size=config.block_size,
        kv_cache_dtype=config.kv_cache_dtype,
        kv_cache_bytes=config.kv_cache_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        backend=config.backend,
        seed=config.seed,
    )


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for the `kv_cache_dtype` setting."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    raise InvalidArgumentError(f"kv_cache_dtype must be auto or fp8, got {kv_cache_dtype!r}")


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype of `dtype="auto"`: bf16 on CUDA and on CPUs with native bf16, else float32."""
    if torch.device(device).type == "cuda" or cpu_has_native_bfloat16():
        return torch.bfloat16
    return torch.float32


def load_model_config(files: ModelFiles, max_model_len: int | None) -> ModelConfig:
    """The model's ModelConfig from config.json or its dummy shape (cheap: no weights)."""
    if files.weights_dir is None:
        if files.dummy_shape is None:
            raise InvalidArgumentError(f"model {files.name!r} has neither weights nor a shape")
        return ModelConfig.from_dict(
            dummy_config(files.dummy_shape), name=files.name, max_model_len=max_model_len
        )
    return ModelConfig.from_directory(
        files.weights_dir, name=files.name, max_model_len=max_model_len
    )
