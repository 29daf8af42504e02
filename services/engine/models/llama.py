"""The Llama-family decoder (Llama 1/2/3.x, Mistral, Qwen2/2.5, Qwen3) over flat token batches.

Input is one flat batch: token ids [T] and absolute positions [T] of every sequence's tokens
this step, with an AttentionMetadata saying where each sequence starts and where its K/V live.
Projections are fused for speed and for the kernels: q/k/v in one matmul (weights concatenated
at load) and gate/up in one. Family differences come from ModelConfig flags (q/k/v bias,
per-head q/k norm, rope scaling, tied embeddings), never from forked copies.
`load_weights` maps Hugging Face tensor names onto the fused parameters.

This is the only model definition: the runner of each device binds the kernels it runs on. On
CPU, the native kernels (`use_cpu_kernels`) and oneDNN-packed projections; on CUDA, the fast
path (backends/cuda_fast_path.py) binds Triton norms and SwiGLU (`use_fused_ops`), projections
tuned per row count, an attention backend that fuses rotary with the KV write
(`fuses_rotary`), and its LM head (`head_projection`), then captures this forward in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.common.errors import FailedPreconditionError
from services.engine.backends.base import AttentionBackend
from services.engine.kernels.cpu.cpu_native import CpuKernels
from services.engine.layers.activation import SiluAndMul
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.layers.fused_ops import FusedOps
from services.engine.layers.linear import pack_weight, packed_linear
from services.engine.layers.norm import RMSNorm
from services.engine.layers.rotary import RotaryEmbedding
from services.engine.models.config import ModelConfig

# HF name fragment → (fused parameter fragment, shard index)
# Vocabulary slice of the greedy LM head: [rows, 2048] float32 logits stay in L2 cache.
GREEDY_CHUNK = 2048
# Sliced only for narrow models: there writing [rows, vocab] logits dominates the LM head; wider
# ones are compute-bound and one large matmul (split over threads) is faster (measured: SmolLM2's
# 576 is 2-4x slower sliced on 2 threads).
GREEDY_SLICED_MAX_HIDDEN = 256

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional q/k norm, rotary embedding, paged attention, output proj."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.output_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.backend: AttentionBackend | None = None
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.cpu_kernels: CpuKernels | None = None  # bound by the model runner on CPU

    def shard_sizes(self, fused: str) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        backend = self.backend
        if backend is not None and backend.fuses_rotary and self.q_norm is None:
            # One kernel rotates q/k and writes the cache (the CUDA fast path).
            if self.key_cache is None or self.value_cache is None:
                raise FailedPreconditionError("attention layer has no KV cache bound")
            out = backend.forward_rotary(
                query, key, value, positions, self.key_cache, self.value_cache, metadata
            )
            return self.o_proj(out.reshape(-1, self.q_size))
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None and qkv.device.type == "cpu":
            # Query and key heads lie side by side in qkv: one rotary pass over both (CPU: half
            # the small ops; query and key stay strided views, which the torch backend takes).
            heads = self.num_heads + self.num_kv_heads
            both = qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim)
            kernels = self.cpu_kernels
            if kernels is not None and kernels.supports(both):  # in place: qkv is ours
                rotary = self.rotary
                kernels.rotate_(both, positions, rotary.cos_cache, rotary.sin_cache)
            else:
                both = self.rotary.rotate(positions, both)
            query, key = both[:, : self.num_heads], both[:, self.num_heads :]
        else:
            query = query.view(-1, self.num_heads, self.head_dim)
            key = key.view(-1, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                query = self.q_norm.normalize(query)
                key = self.k_norm.normalize(key)
            query, key = self.rotary(positions, query, key)
        if self.backend is None or self.key_cache is None or self.value_cache is None:
            raise FailedPreconditionError("attention layer has no KV cache bound")
        out = self.backend.forward(query, key, value, self.key_cache, self.value_cache, metadata)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        self.act = SiluAndMul()
        self.intermediate_size = config.intermediate_size

    def shard_sizes(self, fused: str) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried alongside and added inside the norms."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # One table of cos/sin shared by all layers (not a parameter: not in state dicts).
        rotary = RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_theta, config.rope_scaling
        )
        self.rotary = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.rotary.begin_step()
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; the head runs only on the rows that sample (logits_indices)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = None
        self._greedy_buffer: torch.Tensor | None = None  # reused by compute_greedy
        self._packed_head: torch.Tensor | None = None  # set by pack_lm_head (CPU)
        self._native_head: torch.Tensor | None = None  # set by use_cpu_kernels (bf16, CPU)
        self.cpu_kernels: CpuKernels | None = None  # set by use_cpu_kernels (CPU)
        # hidden rows -> logits, where a backend brings its own LM head (the CUDA fast path).
        self.head_projection: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Tensor parallelism: the head holds this rank's vocabulary rows; this joins every
        # rank's logits into the full vocabulary (parallel/weights.py, shard_lm_head).
        self.logits_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def bind_attention(
        self, backend: AttentionBackend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Give every layer the shared backend and its own (key, value) cache tensors."""
        for layer, (key_cache, value_cache) in zip(self.attention_layers, kv_caches, strict=True):
            layer.backend = backend
            layer.key_cache = key_cache
            layer.value_cache = value_cache

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token in the flat batch."""
        return self.model(input_ids, positions, metadata)

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run every norm and SwiGLU through `ops` where it applies (None: PyTorch ops)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, SiluAndMul)):
                module.kernels = ops

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        """Route the CPU ops that have a native fused kernel through `kernels` (None: PyTorch)."""
        self.cpu_kernels = kernels
        self.use_fused_ops(kernels)
        for layer in self.attention_layers:
            layer.cpu_kernels = kernels
        # bf16 heads: the native LM head, float32 logits never rounded to bf16 (rounded, near-tied
        # logits of small models tie and flip greedy answers), and a fused greedy head that
        # picks their argmax without writing them (2.5x the packed matmul + argmax at hidden 16,
        # 1.45x at 64, even at 576: 64 rows x 49,152 vocabulary, 1 thread).
        weight = self.head_weight
        self._native_head = None
        if (
            kernels is not None
            and weight.device.type == "cpu"
            and kernels.greedy_head_supports(weight)
        ):
            self._native_head = kernels.pack_greedy_head(weight.detach())
            self._packed_head = None  # the native head serves bf16: no second packed copy

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab, hidden] (the embedding table when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_lm_head(self) -> bool:
        """Keep a oneDNN-packed copy of the LM head for CPU (layers/linear.py; ~1.2-3x faster).

        With tied embeddings this is a second copy of the embedding table (vocab x hidden).
        """
        weight = self.head_weight
        self._packed_head = pack_weight(weight)
        return self._packed_head is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the hidden rows (every rank's slice joined under TP)."""
        logits = self._head_logits(hidden)
        return logits if self.logits_gather is None else self.logits_gather(logits)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden rows times the head this model holds (its vocabulary slice under TP)."""
        if self.head_projection is not None:
            return self.head_projection(hidden)
        if self._native_head is not None and hidden.dtype == self._native_head.dtype:
            vocab = self.head_weight.shape[0]
            return self.cpu_kernels.lm_head(hidden, self._native_head, vocab)
        if self._packed_head is not None and hidden.dtype == self._packed_head.dtype:
            return packed_linear(hidden, self._packed_head)
        return F.linear(hidden, self.head_weight)

    def compute_greedy(self, hidden: torch.Tensor, chunk: int = GREEDY_CHUNK) -> torch.Tensor:
        """Argmax token of each row, cheaper than `compute_logits(hidden).argmax(-1)` on CPU.

        With the native CPU kernels: for a bf16 head their fused greedy head (the argmax of
        compute_logits' float32 logits), else the packed LM head, then their row argmax.
        Without them, the LM head writes vocabulary slices of `chunk` columns into one reused
        buffer [slices, rows, chunk] (no fresh 10+ MB allocation per step); each row's best
        slice is found with `amax` (vectorised, unlike a full-width argmax) and only that slice
        is argmax-ed. Ties go to the lowest id, exactly as `argmax`. Under tensor parallelism
        the head holds a slice of the vocabulary: the joined logits' argmax.
        """
        if self.logits_gather is not None:
            return self.compute_logits(hidden).float().argmax(dim=-1)
        weight = self.head_weight
        vocab, rows = weight.shape[0], hidden.shape[0]
        kernels = self.cpu_kernels
        if self._native_head is not None and hidden.dtype == self._native_head.dtype:
            # bf16: products and argmax in one native pass, no logits written.
            return kernels.greedy_head(hidden, self._native_head, vocab)
        if kernels is not None and kernels.supports(hidden) and hidden.dtype == weight.dtype:
            # One packed matmul and a native row argmax: ~2x the slices below on dummy:tiny,
            # and no float32 copy of the logits for wide models.
            return kernels.argmax_rows(self.compute_logits(hidden))
        if (
            vocab <= chunk
            or hidden.shape[1] > GREEDY_SLICED_MAX_HIDDEN
            or hidden.device.type != "cpu"
            or hidden.dtype != weight.dtype
        ):
            # argmax over float32 (PyTorch's bf16 argmax on CPU is ~5x slower than the copy).
            return self.compute_logits(hidden).float().argmax(dim=-1)
        slices = -(-vocab // chunk)
        size = slices * rows * chunk
        buffer = self._greedy_buffer
        if buffer is None or buffer.numel() < size or buffer.dtype != hidden.dtype:
            buffer = self._greedy_buffer = torch.empty(size, dtype=hidden.dtype)
        logits = buffer[:size].view(slices, rows, chunk)
        for index in range(slices):
            start = index * chunk
            part = weight[start : start + chunk]
            if part.shape[0] == chunk:
                torch.mm(hidden, part.t(), out=logits[index])
            else:  # the last, narrower slice: pad with -inf so it never wins on padding
                logits[index].fill_(float("-inf"))
                logits[index, :, : part.shape[0]] = F.linear(hidden, part)
        best_slice = logits.amax(dim=-1).argmax(dim=0)
        row_index = torch.arange(rows, device=hidden.device)
        return logits[best_slice, row_index].argmax(dim=-1) + best_slice * chunk

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the names of those loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the head
            target, shard = _fused_target(hf_name)
            if target not in params:
                raise FailedPreconditionError(
                    f"checkpoint tensor {hf_name!r} has no place in model"
                )
            param = params[target]
            if shard is None:
                _copy_checked(param.data, tensor, hf_name)
            else:
                owner = self.get_submodule(target.rsplit(".", 2)[0])
                sizes = owner.shard_sizes(target)  # type: ignore[operator]
                offset = sum(sizes[:shard])
                _copy_checked(param.data.narrow(0, offset, sizes[shard]), tensor, hf_name)
                loaded.add(f"{target}#{shard}")
                continue
            loaded.add(target)
        return loaded

    def expected_weight_names(self) -> set[str]:
        """What load_weights must have filled for the model to be complete."""
        names: set[str] = set()
        for name, param in self.named_parameters():
            del param
            fragment = name.split(".")[-2] if "." in name else name
            if fragment == "qkv_proj":
                names.update(f"{name}#{index}" for index in range(3))
            elif fragment == "gate_up_proj":
                names.update(f"{name}#{index}" for index in range(2))
            else:
                names.add(name)
        return names


def _fused_target(hf_name: str) -> tuple[str, int | None]:
    for fragment, (fused, shard) in _FUSED.items():
        if f".{fragment}." in hf_name:
            return hf_name.replace(f".{fragment}.", f".{fused}."), shard
    return hf_name, None


def _copy_checked(destination: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(destination.shape) != tuple(source.shape):
        raise FailedPreconditionError(
            f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, "
            f"model expects {tuple(destination.shape)}"
        )
    destination.copy_(source.to(destination.dtype))
