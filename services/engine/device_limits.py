"""Step limits sized from the device: how many sequences and tokens one forward step takes.

`max_num_seqs` and `max_num_batched_tokens` left unset in EngineConfig are chosen here. On the
CPU they stay the small fixed defaults (256 sequences, 2,048 tokens: a CPU step is slow, and a
smaller budget keeps time to first token down). On a GPU they follow its memory and the model,
as vLLM sizes its defaults: a large card (>= 70 GiB, H100/H200 class) takes 512 sequences (the
batch where the fast path's decode rate peaks; also its largest CUDA-graph bucket) and an
8,192-token step (prefill runs near the matmul rate from ~4k tokens per step); a mid-size card
(>= 20 GiB) 256 and 4,096; a smaller one 128 and 2,048. Both are then cut so the KV cache left
after the weights and the step's activations holds every sequence's share of context
(`MIN_TOKENS_PER_SEQUENCE`), and the step budget so its activations fit. Explicit values always
win. `plan_limits` is plain arithmetic, unit-tested without a GPU; `resolve_limits` reads the
device and the model's shape.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from services.engine.config import EngineConfig

logger = logging.getLogger(__name__)

CPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_BATCHED_TOKENS = 2048
GIB = 1 << 30
# (at least this much device memory, max_num_seqs, max_num_batched_tokens), largest first.
GPU_TIERS = ((70 * GIB, 512, 8192), (20 * GIB, 256, 4096), (0, 128, 2048))
# A sequence is given room for at least this much context in the KV cache, on average.
MIN_TOKENS_PER_SEQUENCE = 512
MIN_NUM_SEQS = 16
MIN_BATCHED_TOKENS = 512


@dataclass(frozen=True)
class ModelShape:
    """What the sizing needs of the model (from its ModelConfig)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    parameter_count: int


@dataclass(frozen=True)
class StepLimits:
    """The chosen limits and why (printed at start)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    reason: str


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def activation_bytes(shape: ModelShape, tokens: int, rows: int, dtype_bytes: int) -> int:
    """Peak activation memory of a step of `tokens` tokens sampling `rows` rows (rough upper
    bound: the gate/up output and the residual stream, plus float32 logits of the rows)."""
    per_token = (3 * shape.intermediate_size + 6 * shape.hidden_size) * dtype_bytes
    return tokens * per_token + rows * shape.vocab_size * 4 * 2


def plan_limits(
    *,
    device_type: str,
    total_memory_bytes: int,
    gpu_memory_utilization: float,
    shape: ModelShape,
    dtype_bytes: int,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> StepLimits:
    """The step limits for a device of `total_memory_bytes`; explicit values are kept."""
    if device_type != "cuda":
        seqs = max_num_seqs or CPU_MAX_NUM_SEQS
        tokens = max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS
        return StepLimits(seqs, tokens, f"{device_type} defaults")
    tier_seqs, tier_tokens = next(
        (seqs, tokens) for floor, seqs, tokens in GPU_TIERS if total_memory_bytes >= floor
    )
    usable = total_memory_bytes * gpu_memory_utilization
    weights = shape.parameter_count * dtype_bytes
    tokens = max_num_batched_tokens or tier_tokens
    if max_num_batched_tokens is None:
        # Activations of a full step may take at most a tenth of what the weights leave.
        while (
            tokens > MIN_BATCHED_TOKENS
            and activation_bytes(shape, tokens, tier_seqs, dtype_bytes) > (usable - weights) / 10
        ):
            tokens //= 2
    seqs = max_num_seqs or tier_seqs
    kv_tokens = (usable - weights - activation_bytes(shape, tokens, seqs, dtype_bytes)) // max(
        kv_bytes_per_token(shape, dtype_bytes), 1
    )
    if max_num_seqs is None:
        while seqs > MIN_NUM_SEQS and seqs * MIN_TOKENS_PER_SEQUENCE > kv_tokens:
            seqs //= 2
    reason = (
        f"sized for {total_memory_bytes / GIB:.0f} GiB at utilization {gpu_memory_utilization}: "
        f"weights {weights / GIB:.1f} GiB, about {max(int(kv_tokens), 0):,} KV tokens"
    )
    return StepLimits(int(seqs), int(tokens), reason)


def resolve_limits(config: EngineConfig, model_config, device: str) -> tuple[EngineConfig, str]:
    """`config` with its unset step limits filled for `device` and the model; and a line
    saying what was chosen (for the start-up log), with the step-time target when set."""
    target = f", target_step_ms {config.target_step_ms:g}" if config.target_step_ms else ""
    if config.max_num_seqs is not None and config.max_num_batched_tokens is not None:
        return config, (
            f"max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
            f"{config.max_num_batched_tokens} (set){target}"
        )
    device_type = device.partition(":")[0]
    if device_type == "cuda":
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        limits = plan_limits(
            device_type=device_type,
            total_memory_bytes=total,
            gpu_memory_utilization=config.gpu_memory_utilization,
            shape=model_shape(model_config),
            dtype_bytes=4 if config.dtype == "float32" else 2,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
    else:
        limits = StepLimits(
            config.max_num_seqs or CPU_MAX_NUM_SEQS,
            config.max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS,
            f"{device_type} defaults",
        )
    resolved = dataclasses.replace(
        config,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
    )
    line = (
        f"max_num_seqs {limits.max_num_seqs}, max_num_batched_tokens "
        f"{limits.max_num_batched_tokens} ({limits.reason}){target}"
    )
    return resolved, line


def model_shape(config) -> ModelShape:
    """The sizing's view of a ModelConfig (parameters counted from its dimensions)."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_layers
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    embed = config.vocab_size * hidden
    head = 0 if config.tie_word_embeddings else embed
    return ModelShape(
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        parameter_count=layers * per_layer + embed + head + hidden,
    )
