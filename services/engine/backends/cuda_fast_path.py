"""A Llama forward pass for CUDA built on the Triton kernels: the fast path's model.

Per layer: fused residual-add + RMSNorm, one QKV matmul (weights concatenated at load), the
fused rotary + KV-cache store kernel, paged attention (kernels via CudaPagedAttention), the
output projection, fused add + RMSNorm, one gate/up matmul, SwiGLU, the down projection. Decode
runs through CUDA graphs per batch-size bucket with greedy sampling (argmax) on the GPU, slot
mapping computed on the GPU, and inputs copied from pinned memory without a host sync, so the
host prepares step N+1 while step N runs and only reading the sampled tokens waits.
Weights come from a Hugging Face LlamaForCausalLM (random or loaded), config from its config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as functional

from services.common.errors import InvalidArgumentError
from services.engine.backends.cuda_attention import CudaPagedAttention
from services.engine.cuda_graph import DEFAULT_BUCKETS, DecodeCudaGraphs
from services.engine.kernels.triton.rms_norm import rms_norm
from services.engine.kernels.triton.rotary_kv_store import rotary_kv_store
from services.engine.kernels.triton.skinny_matmul import pick_fastest, skinny_matmul
from services.engine.kernels.triton.swiglu import swiglu
from services.engine.layers.attention_metadata import AttentionMetadata


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    output: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    @classmethod
    def from_hf(cls, model: torch.nn.Module) -> ModelWeights:
        """Fused copies of a LlamaForCausalLM's weights (QKV and gate/up concatenated)."""
        layers = []
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            qkv = [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach().clone(),
                    qkv=torch.cat(qkv, dim=0).detach(),
                    output=attention.o_proj.weight.detach().clone(),
                    post_norm=layer.post_attention_layernorm.weight.detach().clone(),
                    gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0).detach(),
                    down=mlp.down_proj.weight.detach().clone(),
                )
            )
        embed = model.model.embed_tokens.weight.detach().clone()
        head = model.lm_head.weight.detach()
        lm_head = embed if head.data_ptr() == model.model.embed_tokens.weight.data_ptr() else head
        return cls(embed, layers, model.model.norm.weight.detach().clone(), lm_head.clone())

    def decode_bytes(self) -> int:
        """Bytes a decode step must read: every weight except the embedding table (one row)."""
        total = self.final_norm.numel() * self.final_norm.element_size()
        total += self.lm_head.numel() * self.lm_head.element_size()
        for layer in self.layers:
            for tensor in vars(layer).values():
                total += tensor.numel() * tensor.element_size()
        return total

    def parameter_bytes(self) -> int:
        """Bytes of every parameter, the embedding table included (the issue's floor counts
        these; a tied lm_head counts once)."""
        total = self.decode_bytes()
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            total += self.embed.numel() * self.embed.element_size()
        return total


def rotary_tables(config, max_position: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """cos/sin [max_position, head_dim // 2] float32 with the model's own rope scaling."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    try:
        rotary = LlamaRotaryEmbedding(config)
    except TypeError:  # older transformers take (config, device)
        rotary = LlamaRotaryEmbedding(config, device=None)
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    angles = torch.arange(max_position, device=device, dtype=torch.float32)[:, None] * inv_freq
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    return (angles.cos() * scaling).contiguous(), (angles.sin() * scaling).contiguous()


class CudaLlama:
    """Llama on CUDA over a paged KV cache; eager forward plus graph-captured greedy decode."""

    def __init__(
        self,
        config,
        weights: ModelWeights,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_blocks_per_seq: int = 512,
        graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """kv_caches: per layer (key, value) caches to share (e.g. the engine's), else allocated;
        rotary: float32 (cos, sin) [max_position, head_dim // 2], else built from the config."""
        self.config = config
        self.weights = weights
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.attention = CudaPagedAttention()
        if kv_caches is None:
            shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
            kv_caches = [
                (
                    torch.empty(shape, dtype=self.dtype, device=self.device),
                    torch.empty(shape, dtype=self.dtype, device=self.device),
                )
                for _ in weights.layers
            ]
        self.key_caches = [key for key, _ in kv_caches]
        self.value_caches = [value for _, value in kv_caches]
        if rotary is None:
            rotary = rotary_tables(config, max_blocks_per_seq * block_size, self.device)
        self.cos, self.sin = rotary
        self._static = _StaticDecodeBuffers(
            max(graph_buckets), max_blocks_per_seq, weights.lm_head.shape[0], self.device
        )
        self.graphs = DecodeCudaGraphs(self._graph_step, graph_buckets)
        self.skinny_choices: dict[tuple[str, int], tuple] = {}

    def tune_skinny_matmuls(self, row_counts: tuple[int, ...] = (1, 2, 4, 8)) -> None:
        """Per projection and small row count, use the Triton skinny matmul where it measures
        faster than cuBLAS over all layers' weights (call before capture_graphs)."""
        layers = self.weights.layers
        roles = {
            "qkv": [layer.qkv for layer in layers],
            "output": [layer.output for layer in layers],
            "gate_up": [layer.gate_up for layer in layers],
            "down": [layer.down for layer in layers],
            "lm_head": [self.weights.lm_head],
        }
        for role, matrices in roles.items():
            for rows in row_counts:
                config = pick_fastest(matrices, rows)
                if config is not None:
                    self.skinny_choices[(role, rows)] = config

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, role: str) -> torch.Tensor:
        config = self.skinny_choices.get((role, x.shape[0]))
        if config is None:
            return functional.linear(x, weight)
        return skinny_matmul(x, weight, config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """float32 logits [len(metadata.logits_indices), vocab] for one flat step."""
        weights = self.weights
        hidden = functional.embedding(input_ids, weights.embed)
        residual = None
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        tokens = input_ids.shape[0]
        for index, layer in enumerate(weights.layers):
            normed, residual = rms_norm(hidden, residual, layer.input_norm, self.eps)
            qkv = self._linear(normed, layer.qkv, "qkv")
            query, key, value = qkv.split([q_width, kv_width, kv_width], dim=-1)
            key_cache, value_cache = self.key_caches[index], self.value_caches[index]
            query = rotary_kv_store(
                query, key, value, positions, self.cos, self.sin, metadata.slot_mapping,
                key_cache, value_cache,
            )  # fmt: skip
            attended = self.attention.forward(query, key_cache, value_cache, metadata, self.scale)
            hidden = self._linear(attended.view(tokens, q_width), layer.output, "output")
            normed, residual = rms_norm(hidden, residual, layer.post_norm, self.eps)
            gate_up = self._linear(normed, layer.gate_up, "gate_up")
            hidden = self._linear(swiglu(gate_up), layer.down, "down")
        rows = metadata.logits_indices
        normed, _ = rms_norm(hidden[rows], residual[rows], weights.final_norm, self.eps)
        return self._linear(normed, weights.lm_head, "lm_head").float()

    def capture_graphs(self) -> None:
        self.graphs.capture()

    def _graph_step(self, batch_size: int) -> None:
        buffers = self._static
        positions = buffers.positions[:batch_size]
        block_tables = buffers.block_tables[:batch_size]
        seq_lens = buffers.seq_lens[:batch_size]
        blocks = block_tables.gather(1, (positions // self.block_size)[:, None]).squeeze(1)
        slots = blocks.long() * self.block_size + positions % self.block_size
        buffers.slot_mapping[:batch_size] = torch.where(seq_lens > 0, slots, -1)
        metadata = AttentionMetadata(
            slot_mapping=buffers.slot_mapping[:batch_size],
            query_start_loc=buffers.query_start_loc[: batch_size + 1],
            seq_lens=seq_lens,
            context_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=1,
            max_seq_len=0,
            is_pure_decode=True,
            logits_indices=buffers.logits_indices[:batch_size],
        )
        logits = self.forward(buffers.input_ids[:batch_size], positions, metadata)
        buffers.logits[:batch_size] = logits
        buffers.next_tokens[:batch_size] = logits.argmax(dim=-1)

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        sources: torch.Tensor | None = None,
        previous_ids: torch.Tensor | None = None,
        copies_done: torch.cuda.Event | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy decode step for n sequences: (logits [n, vocab], next tokens [n]) views.

        Inputs may be pinned host tensors (copied without a sync) or device tensors; each
        sequence's new token sits at `positions[i]`, its cache then holds positions[i] + 1.
        sources [n] (optional, int64): where >= 0, sequence i's token is previous_ids[sources[i]]
        (ids a step still running sampled: the host never read them) instead of input_ids[i].
        copies_done is recorded once the host inputs have been copied (the host may refill them
        after it completes). Views stay valid until the next decode call.
        """
        count = input_ids.shape[0]
        buffers = self._static
        bucket = self.graphs.bucket_for(count)
        if bucket is None:
            raise InvalidArgumentError(f"decode batch {count} exceeds the largest graph bucket")
        width = block_tables.shape[1]
        buffers.input_ids[:count].copy_(input_ids, non_blocking=True)
        buffers.positions[:count].copy_(positions, non_blocking=True)
        buffers.block_tables[:count, :width].copy_(block_tables, non_blocking=True)
        if sources is not None:
            buffers.sources[:count].copy_(sources, non_blocking=True)
        if copies_done is not None:
            copies_done.record()
        if sources is not None:
            if previous_ids is None:
                raise InvalidArgumentError("decode sources need the previous step's ids")
            source = buffers.sources[:count]
            fed = previous_ids[source.clamp(min=0)]
            buffers.input_ids[:count] = torch.where(source >= 0, fed, buffers.input_ids[:count])
        buffers.seq_lens[:count] = buffers.positions[:count].int() + 1
        buffers.seq_lens[count:bucket] = 0
        buffers.positions[count:bucket] = 0
        self.graphs.replay(count)
        return buffers.logits[:count], buffers.next_tokens[:count]

    def decode_next(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next greedy step of the same `count` sequences, fed on the GPU from the previous
        step's sampled tokens (positions advance by one), so the host can enqueue it before it
        reads those tokens. Block tables must already cover the new positions."""
        buffers = self._static
        buffers.input_ids[:count].copy_(buffers.next_tokens[:count])
        buffers.positions[:count] += 1
        buffers.seq_lens[:count] += 1
        self.graphs.replay(count)
        return buffers.logits[:count], buffers.next_tokens[:count]


class _StaticDecodeBuffers:
    """The fixed tensors captured decode graphs read and write."""

    def __init__(self, max_batch: int, max_blocks: int, vocab_size: int, device) -> None:
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.long, device=device)
        self.logits = torch.zeros((max_batch, vocab_size), dtype=torch.float32, device=device)
        self.next_tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.sources = torch.full((max_batch,), -1, dtype=torch.long, device=device)


def prefill_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) for a flat step: sequence i computes query_lens[i] tokens after
    context_lens[i] cached ones, its KV blocks listed in block_tables[i]."""
    positions, slots, starts, logits_rows = [], [], [0], []
    for query_len, context_len, table in zip(query_lens, context_lens, block_tables, strict=True):
        for position in range(context_len, context_len + query_len):
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
        starts.append(starts[-1] + query_len)
        logits_rows.append(starts[-1] - 1)
    width = max(len(table) for table in block_tables)
    padded = [table + [0] * (width - len(table)) for table in block_tables]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = AttentionMetadata(
        slot_mapping=tensor(slots, torch.long),
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        context_lens=tensor(context_lens, torch.int32),
        block_tables=tensor(padded, torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        is_pure_decode=all(q == 1 for q in query_lens) and all(c > 0 for c in context_lens),
        logits_indices=tensor(logits_rows, torch.long),
    )
    return tensor(positions, torch.long), metadata
