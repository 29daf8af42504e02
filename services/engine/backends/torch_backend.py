"""The "torch" attention backend: plain PyTorch over the paged KV cache, correct on any device.

Per step, `prepare` splits the flat batch into its leading decodes (one query token each) and
the prefill chunks after them, and precomputes the cache rows each one reads. Decodes are
computed together: every sequence's keys are gathered from its block table into one padded
[B, KVH, max_seq_len, D] tensor with a length mask, query heads grouped per KV head (GQA
without repeating K/V). Each prefill chunk attends causally to its cached prefix plus itself
(the mask is offset by the context length), so a first prefill, a chunked prefill and a
prefix-cache hit share one path.

On CPU, attention is batched matmuls around a float32 softmax (layers/cpu_attention.py: ~2-2.5x
faster than PyTorch's CPU flash kernel for decodes and for prefill chunks of 48+ tokens). Long
chunks, whose float32 scores would be large, and CUDA use scaled_dot_product_attention. With
native CPU kernels bound (`cpu_kernels`, kernels/cpu/cpu_native.py) the KV write is one call and
decodes read their keys and values straight from the paged cache, each sequence to its own
length (no gather, no padding, no masks to build), and all prefill chunks of a step are one
flash-style causal kernel call over the same cache (no slots, no masks, no per-chunk matmuls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.engine.backends.base import AttentionBackend, register_backend
from services.engine.kernels.cpu.cpu_native import CpuKernels
from services.engine.layers import cpu_attention
from services.engine.layers.attention_metadata import AttentionMetadata

_STATE_KEY = "torch"
# cuDNN attention re-plans for every new shape (every decode step grows max_seq_len): ~30 ms a
# call on an H100. The other CUDA kernels take any shape at once.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# CPU prefill chunks use the matmul path from this many query tokens (below it the flash kernel
# is as fast) while their float32 scores (heads x queries x keys) stay under the cap below.
MATMUL_PREFILL_MIN_QUERIES = 48
MATMUL_MAX_SCORES = 4 << 20
# CPU decodes score all query heads against all KV heads of whole cache blocks (no per-head
# gather copy) when the model has at most this many KV heads; the extra scoring work is x KVH.
ALL_HEADS_MAX_KV_HEADS = 4


@dataclass
class _PrefillChunk:
    token_start: int
    token_end: int
    slots: torch.Tensor | None  # [seq_len] cache slots to read; None when nothing was cached
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True where attention is allowed
    additive: torch.Tensor | None = None  # the mask as float32 0/-inf (matmul path), made once

    def additive_mask(self) -> torch.Tensor:
        """[query_len, seq_len] float32 0/-inf: causal, offset by the cached context."""
        if self.additive is None:
            allowed = self.mask
            if allowed is None:  # a first prefill: plain causal
                size = self.token_end - self.token_start
                allowed = torch.ones(size, size, dtype=torch.bool).tril_()
            self.additive = _additive(allowed, torch.float32)
        return self.additive


@dataclass
class _StepPlan:
    num_decodes: int
    decode_slots: torch.Tensor | None  # [B_decode, max_len] int64
    decode_mask: torch.Tensor | None  # [B_decode, 1, 1, max_len] bool; None when all equal
    prefills: list[_PrefillChunk]
    decode_blocks: torch.Tensor | None = None  # [B_decode, blocks covering max_len] int64
    decode_lengths: torch.Tensor | None = None  # [B_decode] int64
    block_size: int = 16
    # Planned for the native CPU kernels (no gather indices, no masks), int32 views of the
    # metadata: the decodes' block tables [B_decode, max_blocks] and key counts [B_decode]; the
    # prefills' block tables, token offsets in the batch [P + 1] and key counts [P].
    native: bool = False
    native_tables: torch.Tensor | None = None
    native_lengths: torch.Tensor | None = None
    native_prefill_tables: torch.Tensor | None = None
    native_prefill_starts: torch.Tensor | None = None
    native_prefill_lengths: torch.Tensor | None = None
    # Per-step caches shared by all layers, made on first use.
    additive_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    decode_rows: torch.Tensor | None = None
    all_heads_mask: torch.Tensor | None = None

    def decode_mask_for(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The decode mask as 0/-inf in `dtype` (SDPA on CPU is faster with additive masks)."""
        if self.decode_mask is None:
            return None
        if dtype not in self.additive_masks:
            self.additive_masks[dtype] = _additive(self.decode_mask, dtype)
        return self.additive_masks[dtype]

    def decode_rows_for(self, num_kv_heads: int) -> torch.Tensor:
        """Per (sequence, KV head, position) row of the cache viewed as [-1, head_dim]."""
        if self.decode_rows is None:
            heads = torch.arange(num_kv_heads, device=self.decode_slots.device)
            rows = self.decode_slots.unsqueeze(1) * num_kv_heads + heads[None, :, None]
            self.decode_rows = rows.reshape(-1)
        return self.decode_rows

    def all_heads_mask_for(self, num_kv_heads: int) -> torch.Tensor:
        """[B, KVH, 1, L, KVH] 0/-inf: query group h sees KV head h at positions < length."""
        if self.all_heads_mask is None:
            device = self.decode_blocks.device
            length = self.decode_blocks.shape[1] * self.block_size
            valid = torch.arange(length, device=device)[None] < self.decode_lengths[:, None]
            same = torch.eye(num_kv_heads, dtype=torch.bool, device=device)
            allowed = valid[:, None, None, :, None] & same[None, :, None, None, :]
            self.all_heads_mask = _additive(allowed, torch.float32)
        return self.all_heads_mask


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Reference backend; vectorized over the batch for decodes."""

    cpu_kernels: CpuKernels | None = None  # bound by the model runner on CPU

    def _native(self, cache: torch.Tensor) -> CpuKernels | None:
        kernels = self.cpu_kernels
        return kernels if kernels is not None and kernels.supports(cache) else None

    def prepare(self, metadata: AttentionMetadata) -> None:
        native = self.cpu_kernels is not None and metadata.slot_mapping.device.type == "cpu"
        metadata.backend_state[_STATE_KEY] = _plan(metadata, native=native)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan = metadata.backend_state.get(_STATE_KEY)
        if plan is None:
            self.prepare(metadata)
            plan = metadata.backend_state[_STATE_KEY]
        flat_keys = key_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_values = value_cache.view(-1, self.num_kv_heads, self.head_dim)
        native = self._native(key_cache)
        if native is not None:
            native.kv_store(key, value, key_cache, value_cache, metadata.slot_mapping)
        else:
            flat_keys.index_copy_(0, metadata.slot_mapping, key.to(flat_keys.dtype))
            flat_values.index_copy_(0, metadata.slot_mapping, value.to(flat_values.dtype))
            if plan.native:  # planned for the native kernels, run without them
                plan = metadata.backend_state[_STATE_KEY] = _plan(metadata)

        if not plan.prefills and not query.is_cuda:  # pure decode on CPU: no output copy
            return self._decoder(query, plan)(query, flat_keys, flat_values, plan)
        output = torch.empty_like(query)
        kernels = sdpa_kernel(_CUDA_SDPA_BACKENDS) if query.is_cuda else contextlib.nullcontext()
        with kernels:
            self._attend(query, key, value, flat_keys, flat_values, plan, output)
        return output

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        flat_keys: torch.Tensor,
        flat_values: torch.Tensor,
        plan: _StepPlan,
        output: torch.Tensor,
    ) -> None:
        if plan.num_decodes:
            decode = self._decoder(query, plan)
            output[: plan.num_decodes] = decode(
                query[: plan.num_decodes], flat_keys, flat_values, plan
            )
        if plan.native and plan.prefills:  # every chunk in one call, into output's rows
            same_dtype = output.dtype == flat_keys.dtype
            out = self.cpu_kernels.prefill_attention(
                query,
                flat_keys,
                flat_values,
                plan.native_prefill_tables,
                plan.native_prefill_starts,
                plan.native_prefill_lengths,
                self.num_kv_heads,
                plan.block_size,
                self.scale,
                out=output if same_dtype else None,
            )
            if not same_dtype:
                output[plan.num_decodes :] = out[plan.num_decodes :]
            return
        for chunk in plan.prefills:
            output[chunk.token_start : chunk.token_end] = self._prefill(
                query, key, value, flat_keys, flat_values, chunk
            )

    def _decoder(self, query: torch.Tensor, plan: _StepPlan) -> Callable[..., torch.Tensor]:
        """The decode implementation for this step: (query, flat_keys, flat_values, plan)."""
        if query.is_cuda:
            return self._decode_sdpa
        return self._decode_native if plan.native else self._decode_matmul

    def _decode_native(
        self,
        query: torch.Tensor,
        flat_keys: torch.Tensor,
        flat_values: torch.Tensor,
        plan: _StepPlan,
    ) -> torch.Tensor:
        """Decode rows straight from the paged cache (the native CPU kernel, which a native plan
        implies: forward re-plans when the kernels do not apply)."""
        return self.cpu_kernels.decode_attention(
            query,
            flat_keys,
            flat_values,
            plan.native_tables,
            plan.native_lengths,
            self.num_kv_heads,
            plan.block_size,
            self.scale,
        )

    def _decode_sdpa(
        self,
        query: torch.Tensor,
        flat_keys: torch.Tensor,
        flat_values: torch.Tensor,
        plan: _StepPlan,
    ) -> torch.Tensor:
        batch = query.shape[0]
        group = self.num_heads // self.num_kv_heads
        grouped = query.view(batch, self.num_kv_heads, group, self.head_dim)
        slots = plan.decode_slots
        shape = (batch, slots.shape[1], self.num_kv_heads, self.head_dim)
        # index_select on flat slots: much cheaper than advanced indexing.
        keys = flat_keys.index_select(0, slots.view(-1)).view(shape).transpose(1, 2)
        values = flat_values.index_select(0, slots.view(-1)).view(shape).transpose(1, 2)
        keys, values = keys.to(query.dtype), values.to(query.dtype)
        out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=plan.decode_mask_for(query.dtype), scale=self.scale
        )
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _decode_matmul(
        self,
        query: torch.Tensor,
        flat_keys: torch.Tensor,
        flat_values: torch.Tensor,
        plan: _StepPlan,
    ) -> torch.Tensor:
        if self.num_kv_heads <= ALL_HEADS_MAX_KV_HEADS:
            per_block = plan.block_size * self.num_kv_heads * self.head_dim
            return cpu_attention.decode_all_heads(
                query,
                flat_keys.view(-1, per_block),
                flat_values.view(-1, per_block),
                plan.decode_blocks,
                plan.all_heads_mask_for(self.num_kv_heads),
                self.scale,
            )
        return cpu_attention.decode_per_head(
            query,
            flat_keys.view(-1, self.head_dim),
            flat_values.view(-1, self.head_dim),
            plan.decode_rows_for(self.num_kv_heads),
            plan.decode_slots.shape[1],
            plan.decode_mask_for(torch.float32),
            self.scale,
        )

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        flat_keys: torch.Tensor,
        flat_values: torch.Tensor,
        chunk: _PrefillChunk,
    ) -> torch.Tensor:
        start, end = chunk.token_start, chunk.token_end
        if chunk.slots is None:
            keys = key[start:end]
            values = value[start:end]
        else:
            keys = flat_keys.index_select(0, chunk.slots).to(query.dtype)
            values = flat_values.index_select(0, chunk.slots).to(query.dtype)
        queries = query[start:end]
        num_queries, num_keys = end - start, keys.shape[0]
        if (
            not query.is_cuda
            and num_queries >= MATMUL_PREFILL_MIN_QUERIES
            and self.num_heads * num_queries * num_keys <= MATMUL_MAX_SCORES
        ):
            return cpu_attention.prefill_matmul(
                queries, keys, values, chunk.additive_mask(), self.scale
            )
        queries = queries.transpose(0, 1).unsqueeze(0)
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        gqa = self.num_heads != self.num_kv_heads
        if chunk.mask is None:
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        else:
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=chunk.mask, scale=self.scale, enable_gqa=gqa
            )
        return out.squeeze(0).transpose(0, 1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as 0 / -inf in `dtype`."""
    additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return additive.masked_fill_(~allowed, float("-inf"))


def _plan(metadata: AttentionMetadata, native: bool = False) -> _StepPlan:
    """The step's decode/prefill split; gather indices and masks only when not `native` (the
    native CPU kernels read the block tables themselves)."""
    starts = metadata.query_start_loc_host or metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens_host or metadata.seq_lens.tolist()
    context_lens = metadata.context_lens_host or metadata.context_lens.tolist()
    query_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    device = metadata.slot_mapping.device
    block_tables = metadata.block_tables
    if not native:
        block_tables = block_tables.to(torch.int64)
    decode_slots = decode_mask = decode_blocks = lengths = None
    native_tables = native_lengths = None
    if num_decodes and native:
        native_tables = metadata.block_tables[:num_decodes]
        native_lengths = metadata.seq_lens[:num_decodes]
    elif num_decodes:
        max_len = max(seq_lens[:num_decodes])
        lengths = metadata.seq_lens[:num_decodes].to(torch.int64)
        decode_slots, valid = _slots_for(block_tables[:num_decodes], max_len, lengths, metadata)
        if min(seq_lens[:num_decodes]) != max_len:  # equal lengths need no mask
            decode_mask = valid[:, None, None, :]
        num_blocks = -(-max_len // metadata.block_size)
        decode_blocks = block_tables[:num_decodes, :num_blocks].contiguous()
    prefills = []
    for index in range(num_decodes, len(query_lens)):
        context = context_lens[index]
        slots = mask = None
        if context > 0 and not native:
            seq_len = seq_lens[index]
            slots = _slots_for(block_tables[index : index + 1], seq_len, None, metadata)[0][0]
            query_positions = torch.arange(context, seq_len, device=device).unsqueeze(1)
            key_positions = torch.arange(seq_len, device=device).unsqueeze(0)
            mask = key_positions <= query_positions
        prefills.append(_PrefillChunk(starts[index], starts[index + 1], slots, mask))
    return _StepPlan(
        num_decodes,
        decode_slots,
        decode_mask,
        prefills,
        decode_blocks=decode_blocks,
        decode_lengths=lengths,
        block_size=metadata.block_size,
        native=native,
        native_tables=native_tables,
        native_lengths=native_lengths,
        native_prefill_tables=metadata.block_tables[num_decodes:] if native else None,
        native_prefill_starts=metadata.query_start_loc[num_decodes:] if native else None,
        native_prefill_lengths=metadata.seq_lens[num_decodes:] if native else None,
    )


def _slots_for(
    block_tables: torch.Tensor,
    length: int,
    lengths: torch.Tensor | None,
    metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of positions [0, length) for each row of block_tables, and a validity mask."""
    device = block_tables.device
    block_size = metadata.block_size
    positions = torch.arange(length, device=device)
    blocks = block_tables[:, positions // block_size]
    slots = blocks * block_size + (positions % block_size)
    if lengths is None:
        return slots, torch.ones_like(slots, dtype=torch.bool)
    return slots, positions.unsqueeze(0) < lengths.unsqueeze(1)
