"""Step limits sized from the device: how many sequences and tokens one forward step takes.

`max_num_seqs` and `max_num_batched_tokens` left unset in EngineConfig are chosen here. On the
CPU they stay the small fixed defaults (256 sequences, 2,048 tokens: a CPU step is slow, and a
smaller budget keeps time to first token down). On a GPU they follow its memory and the model,
as vLLM sizes its defaults: a large card (>= 70 GiB, H100/H200 class) takes at most 512
sequences (its largest CUDA-graph bucket) and an 8,192-token step (prefill runs near the matmul
rate from ~4k tokens per step); a mid-size card (>= 20 GiB) 256 and 4,096; a smaller one 128 and
2,048. Both are then cut so the KV cache left after the weights and the step's activations holds
every sequence's share of context (`MIN_TOKENS_PER_SEQUENCE`), and the step budget so its
activations fit. Explicit values always win.

The running batch is also held near where a larger one stops paying: a decode step reads every
weight once, and each row adds two FLOPs per weight and its own KV reads. Past the ridge row
count (the device's matmul rate over its memory bandwidth, in rows: `ridge_rows`) the
projections are compute-bound, so every further row costs its full share of matmul and KV time
and output tokens/s stays flat while each request's time per output token grows with the batch.
On an H100 with Llama-3-8B (512 prompt / 256 output tokens, saturated) caps of 320, 384, 448
and 512 sequences gave the same output tokens/s within 6 %, and time per output token p50 of 35,
40, 47 and 56 ms. The cap taken is the graph bucket nearest `RIDGE_MARGIN` x the ridge (a margin
for the batch's dips as requests finish in waves): 384 there. The rates are measured once per
GPU and dtype (a second, `measure_device_rates`) and kept in the tuning cache.

`plan_limits` is plain arithmetic, unit-tested without a GPU; `resolve_limits` reads the device
and the model's shape.
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
# The running-batch cap is the choice nearest RIDGE_MARGIN x the ridge row count (the CUDA
# graph buckets from 128 up).
RIDGE_MARGIN = 1.5
BATCH_CAP_CHOICES = (128, 192, 256, 384, 512)


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
class DeviceRates:
    """What a GPU sustains: the dense matmul rate in the engine's dtype, and copy bandwidth
    (bytes read + written per second)."""

    matmul_flops_per_s: float
    bandwidth_bytes_per_s: float


def ridge_rows(rates: DeviceRates, dtype_bytes: int) -> float:
    """Decode rows at which the projections turn from reading weights to computing: each
    weight (dtype_bytes) takes two FLOPs per row."""
    return rates.matmul_flops_per_s * dtype_bytes / (2.0 * rates.bandwidth_bytes_per_s)


def ridge_batch_cap(rates: DeviceRates, dtype_bytes: int) -> int:
    """The running-batch cap for `rates`: the choice nearest RIDGE_MARGIN x the ridge."""
    want = RIDGE_MARGIN * ridge_rows(rates, dtype_bytes)
    return min(BATCH_CAP_CHOICES, key=lambda choice: (abs(choice - want), choice))


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
    rates: DeviceRates | None = None,
    kv_dtype_bytes: int | None = None,
) -> StepLimits:
    """The step limits for a device of `total_memory_bytes` (and `rates`, where measured);
    explicit values are kept. `kv_dtype_bytes`: a KV cache element (default: the model's)."""
    if device_type != "cuda":
        seqs = max_num_seqs or CPU_MAX_NUM_SEQS
        tokens = max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS
        return StepLimits(seqs, tokens, f"{device_type} defaults")
    tier_seqs, tier_tokens = next(
        (seqs, tokens) for floor, seqs, tokens in GPU_TIERS if total_memory_bytes >= floor
    )
    ridge_note = ""
    if rates is not None:
        cap = ridge_batch_cap(rates, dtype_bytes)
        ridge_note = (
            f"; batch cap {cap} from the ridge at {ridge_rows(rates, dtype_bytes):.0f} rows "
            f"({rates.matmul_flops_per_s / 1e12:.0f} TFLOP/s over "
            f"{rates.bandwidth_bytes_per_s / 1e12:.2f} TB/s)"
        )
        tier_seqs = min(tier_seqs, cap)
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
        kv_bytes_per_token(shape, kv_dtype_bytes or dtype_bytes), 1
    )
    if max_num_seqs is None:
        while seqs > MIN_NUM_SEQS and seqs * MIN_TOKENS_PER_SEQUENCE > kv_tokens:
            seqs //= 2
    reason = (
        f"sized for {total_memory_bytes / GIB:.0f} GiB at utilization {gpu_memory_utilization}: "
        f"weights {weights / GIB:.1f} GiB, about {max(int(kv_tokens), 0):,} KV tokens"
        f"{ridge_note}"
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
        dtype_bytes = 4 if config.dtype == "float32" else 2
        rates = None
        if config.max_num_seqs is None:
            rates = device_rates(device, torch.float32 if dtype_bytes == 4 else torch.bfloat16)
        limits = plan_limits(
            device_type=device_type,
            total_memory_bytes=total,
            gpu_memory_utilization=config.gpu_memory_utilization,
            shape=model_shape(model_config),
            dtype_bytes=dtype_bytes,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            rates=rates,
            kv_dtype_bytes=1 if config.kv_cache_dtype == "fp8" else dtype_bytes,
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


def device_rates(device: str, dtype) -> DeviceRates | None:
    """The GPU's rates for `dtype`, from the tuning cache or measured (and saved) now; None
    when the measurement's buffers do not fit (the GPU already holds a model and its cache):
    the running batch then keeps the memory tier's cap."""
    import torch

    from services.engine import tuning_cache

    name = torch.cuda.get_device_name(torch.device(device))
    key = tuning_cache.tuning_key(
        device_name=name,
        model_shape={"measure": "device rates"},
        dtype=str(dtype),
        code_version=RATES_VERSION,
    )
    saved = tuning_cache.load_choices(key)
    if saved is not None:
        try:
            return DeviceRates(
                float(saved["matmul_flops_per_s"]), float(saved["bandwidth_bytes_per_s"])
            )
        except (KeyError, TypeError, ValueError):
            logger.warning("ignoring the saved device rates for %s: malformed", name)
    try:
        rates = measure_device_rates(device, dtype)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        logger.warning("no room on %s to measure its rates: the batch cap stays the tier's", name)
        return None
    logger.info(
        "measured %s: %.0f TFLOP/s %s matmul, %.2f TB/s copy",
        name,
        rates.matmul_flops_per_s / 1e12,
        dtype,
        rates.bandwidth_bytes_per_s / 1e12,
    )
    tuning_cache.save_choices(key, dataclasses.asdict(rates), about={"device": name})
    return rates


RATES_VERSION = "rates-1"
MATMUL_SIZE = 8192
COPY_BYTES = 512 << 20


def measure_device_rates(device: str, dtype) -> DeviceRates:
    """A square matmul of MATMUL_SIZE in `dtype` and a COPY_BYTES device copy, each timed
    as the median of a few runs after warm-up (about a second on a first start)."""
    import torch

    target = torch.device(device)

    def timed() -> tuple[float, float]:
        a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=target, dtype=dtype)
        b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=target, dtype=dtype)
        out = torch.empty_like(a)
        source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=target)
        copy = torch.empty_like(source)
        return (
            _median_seconds(lambda: torch.mm(a, b, out=out), target),
            _median_seconds(lambda: copy.copy_(source), target),
        )

    matmul_s, copy_s = timed()
    torch.cuda.empty_cache()  # the buffers are gone with timed()'s frame
    return DeviceRates(
        matmul_flops_per_s=2.0 * MATMUL_SIZE**3 / matmul_s,
        bandwidth_bytes_per_s=2.0 * COPY_BYTES / copy_s,
    )


def _median_seconds(work, device, *, warmup: int = 3, runs: int = 10) -> float:
    import torch

    with torch.cuda.device(device):
        for _ in range(warmup):
            work()
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


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
