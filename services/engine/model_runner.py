"""ModelRunner: owns the weights, the paged KV cache and the attention backend; runs one step.

`execute(batch)` turns the scheduler's ScheduledBatch into flat tensors (token ids, positions,
cache slots, per-sequence offsets and lengths, padded block tables), runs the model over the
paged cache, and returns float32 logits only for the sequences that sample this step (the LM
head runs on those rows alone). Host-side preparation is a handful of list operations and one
tensor per field, so the per-step overhead stays small at batch 1 and batch 32 alike.

Default dtype (`default_dtype`): bfloat16 on CUDA; on CPU bfloat16 when the CPU multiplies
bf16 natively (AVX512-BF16 or AMX, ~4x the float32 matmul rate on such CPUs, as vLLM's CPU
backend defaults to), else float32. KV budget per kv_cache.py.

On CPU the runner also packs the linear weights and the LM head for oneDNN once at load
(layers/linear.py), tunes glibc malloc to reuse freed activations (keep_freed_cpu_memory), and
binds the native fused kernels (kernels/cpu_native.py; `cpu_kernels=False` keeps PyTorch ops).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

from services.common.errors import InvalidArgumentError
from services.common.model_files import ModelFiles
from services.common.protocol.dummy_shapes import dummy_config
from services.engine.backends.base import get_backend
from services.engine.forward_batch import ScheduledBatch
from services.engine.kernels.cpu.cpu_native import cpu_kernels as load_cpu_kernels
from services.engine.kv_cache import KVCache
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.layers.linear import pack_linear_layers
from services.engine.loader.weights import build_model
from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# CPU models at most this wide run their ops on one torch thread (see ModelRunner.__init__).
SINGLE_THREAD_MAX_HIDDEN = 256
# glibc mallopt parameters (malloc.h) and the values set for CPU inference (see
# keep_freed_cpu_memory): blocks up to 32 MiB come from the heap, which keeps up to 1 GiB free.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_CPU_MALLOC_SETTINGS = (
    (_M_MMAP_THRESHOLD, 32 << 20),
    (_M_TRIM_THRESHOLD, 1 << 30),
    (_M_TOP_PAD, 64 << 20),
)
_allocator_tuned = False
# Model dtypes the native CPU kernels (kernels/cpu_native.py) cover.
NATIVE_CPU_DTYPES = (torch.float32, torch.bfloat16)


class ModelRunner:
    """One model on one device with its KV cache; `execute` runs a scheduled step."""

    def __init__(
        self,
        model_files: ModelFiles,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        backend: str = "torch",
        seed: int = 0,
        cpu_kernels: bool = True,
    ) -> None:
        self.model_files = model_files
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgumentError("device 'cuda' requested but CUDA is not available")
        self.dtype = dtype or default_dtype(self.device)
        self.block_size = block_size
        self.model_config = load_model_config(model_files, max_model_len)
        config = self.model_config
        if self.device.type == "cpu" and config.hidden_size <= SINGLE_THREAD_MAX_HIDDEN:
            # A tiny model's ops are too small to split: extra threads only spin and contend
            # with the router/tokenizer processes (measured: ~13 ms vs 10-60 ms per step of
            # dummy:tiny at 64 sequences on 2 cores).
            torch.set_num_threads(1)
        if self.device.type == "cpu":
            keep_freed_cpu_memory()
        backend_cls = get_backend(backend)  # fail fast, before loading any weights
        torch.manual_seed(seed)
        self.model = build_model(
            config,
            weights_dir=model_files.weights_dir,
            device=self.device,
            dtype=self.dtype,
            seed=seed,
        )
        if self.device.type == "cpu":  # oneDNN-prepacked weights: 1.2-3x faster projections
            pack_linear_layers(self.model, exclude=("lm_head",))
            self.model.pack_lm_head()
        self.backend_name = backend
        self.backend = backend_cls(
            config.num_heads, config.num_kv_heads, config.head_dim, config.head_dim**-0.5
        )
        self.kv_cache = KVCache.allocate(
            config,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
            kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        self.num_blocks = self.kv_cache.num_blocks
        self.model.bind_attention(self.backend, self.kv_cache.layers)
        self.cpu_kernels = None
        if self.device.type == "cpu" and cpu_kernels and self.dtype in NATIVE_CPU_DTYPES:
            self.cpu_kernels = load_cpu_kernels()
            self.model.use_cpu_kernels(self.cpu_kernels)
            if hasattr(self.backend, "cpu_kernels"):
                self.backend.cpu_kernels = self.cpu_kernels
        logger.info(
            "model %s on %s (%s): %d KV blocks of %d tokens, backend %s%s",
            config.name,
            self.device,
            self.dtype,
            self.num_blocks,
            block_size,
            backend,
            ", native CPU kernels" if self.cpu_kernels is not None else "",
        )

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

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Hidden states of the rows that need logits, or None when no row does."""
        if not batch.sequences:
            return None
        input_ids, positions, metadata = self.prepare_inputs(batch)
        self.backend.prepare(metadata)
        hidden = self.model(input_ids, positions, metadata)
        if metadata.logits_indices.numel() == 0:
            return None
        return hidden.index_select(0, metadata.logits_indices)

    def prepare_inputs(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat tensors of one step: token ids, positions and the attention metadata."""
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
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            is_pure_decode=max_query_len == 1,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            block_size=block_size,
            query_start_loc_host=query_start_loc,
            seq_lens_host=seq_lens,
            context_lens_host=context_lens,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        position_tensor = torch.tensor(positions, dtype=torch.int64, device=device)
        return input_ids, position_tensor, metadata


def keep_freed_cpu_memory() -> bool:
    """Make glibc malloc reuse freed activation memory instead of mapping fresh pages.

    By default glibc serves blocks over 128 KiB-32 MiB with mmap and gives them back on free, so
    every step's activations (a few MiB each) come back as new pages that the kernel must fault
    in and zero: measured 2-4x slower attention and ~25 % slower batch-32 generation of SmolLM2
    on CPU. Raising the mmap and trim thresholds keeps those blocks in the heap for reuse (the
    process keeps up to ~1 GiB of freed memory). Once per process; False where not glibc.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _allocator_tuned = all(mallopt(param, value) == 1 for param, value in _CPU_MALLOC_SETTINGS)
    if _allocator_tuned:
        logger.info("glibc malloc tuned for CPU inference (freed activations are reused)")
    return _allocator_tuned


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
