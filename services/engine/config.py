"""The engine's configuration: one frozen, validated dataclass for LLM, LLMEngine and the worker.

Filled from flags, then `SLUICE_*` environment variables, then these defaults through
`services.common.config.from_layers`. Defaults suit the CPU (the default here and in CI); on a
GPU the KV cache is sized from `gpu_memory_utilization` unless `kv_cache_bytes` is given, and
unset step limits (`max_num_seqs`, `max_num_batched_tokens`) from the GPU's memory and the
model (services/engine/device_limits.py), before the runner is built. `target_step_ms` (off by
default) adds a time limit to each step (services/engine/step_budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import field
from services.common.errors import InvalidArgumentError
from services.engine.lora.config import (
    DEFAULT_LOAD_WORKERS,
    DEFAULT_MAX_CPU_LORAS,
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    DEFAULT_SLOT_QUANTUM_MS,
    LoRAConfig,
)

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "fp8")
FORWARD_THREAD_POLICIES = ("normal", "idle")
# Forward backends a tensor-parallel group runs (the exported graphs hold no collectives).
TENSOR_PARALLEL_BACKENDS = ("torch", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine loads its model and schedules its requests."""

    model: str | None = field(
        None, help="model: None = default SmolLM2-135M, an HF dir, a .gguf file, or dummy:<shape>"
    )
    backend: str = field(
        "torch",
        help="forward backend: torch (any device), cuda (Triton attention), onnxruntime or "
        "tensorrt (exported ONNX graphs of the batchful layer parts around the engine's "
        "paged attention; tensorrt needs CUDA)",
    )
    device: str = field("auto", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    dtype: str = field(
        "auto",
        help="auto (bfloat16 on CUDA and on CPUs with native bf16 matmul: AVX512-BF16 or AMX; "
        "else float32), float32, float16, bfloat16",
    )
    block_size: int = field(16, help="tokens per KV cache block")
    kv_cache_dtype: str = field(
        "auto",
        help="KV cache element type: auto (the model's dtype) or fp8 (float8 e4m3, one byte: "
        "twice the tokens of a bf16 cache in the same memory and half the bytes each decode "
        "step reads; keys and values rounded to 3 mantissa bits and clamped to +-448, no "
        "scales; CUDA with Triton attention only)",
    )
    kv_cache_bytes: int | None = field(
        None, help="bytes of KV cache (default: the model runner's choice for the device)"
    )
    gpu_memory_utilization: float = field(
        0.85, help="fraction of GPU memory the engine may use (weights + KV cache)"
    )
    swap_space_gib: float | None = field(
        None,
        help="GiB of host memory (pinned on a GPU) for the KV blocks of sequences paused for a "
        "LoRA slot turn: when the KV cache runs short, paused sequences move there instead of "
        "holding device blocks or being recomputed, and come back when their adapter has a slot "
        "(services/engine/kv_swap.py); default: 16 GiB, at most an eighth of the host's memory "
        "(or of the container's limit), on a GPU with time-sliced LoRA slots, else 0 (off)",
    )
    max_num_seqs: int | None = field(
        None,
        help="most sequences in one forward step (default: 256 on CPU; on CUDA sized from the "
        "GPU's memory, the model and its matmul rate over bandwidth, 384 on an H100: "
        "services/engine/device_limits.py)",
    )
    max_num_batched_tokens: int | None = field(
        None,
        help="token budget of one forward step, longer prompts are prefilled in chunks "
        "(default: 2048 on CPU; on CUDA sized from the GPU's memory, 8192 on an 80 GB card)",
    )
    target_step_ms: float = field(
        0.0,
        help="step-time target in ms (0: off): chunked prefill gives a step only as many prompt "
        "tokens as keep its predicted time, beside its decodes, within this, from step costs "
        "the engine measures (services/engine/step_budget.py); bounds the time per output token "
        "under load, e.g. set it a little below a TPOT SLO",
    )
    max_model_len: int | None = field(
        None, help="context length cap (default: the model's own context)"
    )
    enable_prefix_caching: bool = field(True, help="reuse KV blocks of shared prompt prefixes")
    tensor_parallel_size: int = field(
        1,
        help="ranks one model is split over (attention heads, MLP width, KV cache by KV heads); "
        "on CUDA rank r uses GPU r of those visible, on CPU the ranks are processes (gloo)",
    )
    custom_all_reduce: bool = field(
        True,
        help="with tensor_parallel_size > 1 on GPUs, sum decode-sized activations with a "
        "one-shot all-reduce over CUDA symmetric memory (peer-to-peer reads, one kernel), NCCL "
        "for larger ones; set up only where every GPU reaches its peers and a check sum is "
        "exact, else NCCL throughout (the engine log says why); off = NCCL throughout",
    )
    fuse_sum_norm: bool = field(
        True,
        help="with custom_all_reduce: sum each decode step's o_proj and down_proj outputs (up to "
        "64 rows) in the kernel of the residual add and RMSNorm that follow, peers' rows pushed "
        "over peer-to-peer stores; set up only where every GPU can and a check is exact; off = "
        "an all-reduce, then the norm",
    )
    warm_up: bool = field(
        True,
        help="before reporting SERVING, run every step shape once (prefill sizes, every "
        "CUDA-graph decode batch, sampler paths; one small step on CPU): services/engine/warmup.py",
    )
    seed: int = field(0, help="seed of the random weights (dummy models) and unseeded sampling")
    cpu_kernels: bool = field(
        True,
        help="on CPU, fused native kernels (compiled once with g++ into the cache directory) "
        "for attention, norms, rotary and SwiGLU; off = PyTorch ops only",
    )
    forward_thread_policy: str = field(
        "normal",
        help="CPU scheduling of the serving engine's forward thread: normal, or idle (Linux "
        "SCHED_IDLE: it runs only when no other thread wants the core, so on a CPU engine the "
        "gRPC threads of the machine never queue behind a forward step; lower and steadier "
        "time to first token under load, less throughput, and a busy neighbour process can "
        "starve the engine; BENCHMARKS.md has the figures)",
    )
    stats_log_interval_s: float = field(
        10.0,
        help="seconds between the engine's stats lines in its log (steps/s and mean step "
        "time, prompt and generated tokens/s, running/paused/waiting sequences, KV use, LoRA "
        "slot writes); 0 = off",
    )
    max_loras: int = field(
        DEFAULT_MAX_LORAS,
        help="LoRA adapters resident on the device at once (slots; one batch mixes them)",
    )
    max_cpu_loras: int = field(
        DEFAULT_MAX_CPU_LORAS, help="LoRA adapters kept in host memory (LRU; >= max_loras)"
    )
    max_lora_rank: int = field(
        DEFAULT_MAX_LORA_RANK,
        help="largest LoRA rank served; slot memory is sized for max_loras adapters of it",
    )
    adapter_root: str | None = field(
        None,
        help="directory every registered LoRA adapter path must resolve under (unset: no adapters)",
    )
    lora_slot_quantum_ms: float = field(
        DEFAULT_SLOT_QUANTUM_MS,
        help="time-slice LoRA slots: when an adapter in host memory waits for a slot that "
        "running requests have held this long, those requests pause (KV kept) and the slot "
        "changes hands, so up to max_cpu_loras adapters are served at once; 0 = a request "
        "keeps its adapter's slot to the end, and at most max_loras adapters are in flight",
    )
    lora_first_token_joins: bool = field(
        True,
        help="with time-sliced slots, a request yet to give its first token may join its "
        "adapter's slot while that slot drains for another adapter (its sequences still "
        "running): it is prefilled beside them and paused with them when the slot changes "
        "hands, rather than waiting for the adapter's next turn for its first token; "
        "--no-lora-first-token-joins makes it wait",
    )
    lora_load_workers: int = field(
        DEFAULT_LOAD_WORKERS,
        help="threads that read, verify and lay out LoRA adapters from disk into host memory "
        "at once, off the step loop: a burst of requests for adapters not in memory waits for "
        "loads side by side, not in a line (an 8B model's rank-16 adapter takes ~0.2-0.5 s of "
        "one core); default: the cores, at most 4",
    )
    lora_deterministic: bool = field(
        True,
        help="on a GPU, the LoRA kernels sum their K splits in a fixed order, so a request "
        "repeated alone gets the same tokens; --no-lora-deterministic adds them with float "
        "atomics instead: the projections of a LoRA decode step 2-6 %% faster (BENCHMARKS.md), "
        "answers that may change from run to run where two tokens are nearly tied",
    )
    lora_fused_decode: bool = field(
        True,
        help="on a GPU, decode steps whose adapter rows all use one adapter run its LoRA "
        "inside the base kernels (A below each projection's weight, the expand in the norm, "
        "SwiGLU and rotary kernels after it) instead of as kernels of their own (~8 %% off "
        "such a step of an 8B model, BENCHMARKS.md); the weights get that room at load "
        "(max_lora_rank rows a slice: ~160 MB on an 8B model at rank 64). "
        "--no-lora-fused-decode runs those steps through the LoRA kernels",
    )
    lora_fused_swiglu: bool = field(
        True,
        help="on a GPU, steps of several adapters leave gate_up's LoRA deltas to the SwiGLU "
        "kernel, which adds them as it reads gate and up, instead of writing them out for the "
        "matmul to add onto (prefill and mixed steps under 16 adapters 2.5-5 %% faster on an "
        "H100, BENCHMARKS.md); --no-lora-fused-swiglu writes every delta first (not used on "
        "tensor-parallel engines)",
    )
    lora_side_deltas: bool = field(
        True,
        help="on a GPU, decode steps of several adapters run each projection's LoRA kernels "
        "on a second stream beside its base matmul, the kernel that reads the projection "
        "next adding the deltas they wrote (1-3 %% off such steps of an 8B model on an H100, "
        "BENCHMARKS.md; a delta buffer of the widest decode graph's rows per projection, "
        "~44 MB at 512 rows of an 8B model); --no-lora-side-deltas runs them in line with "
        "the matmuls",
    )

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise InvalidArgumentError("model must be a non-empty string or None")
        if not isinstance(self.backend, str) or not self.backend:
            raise InvalidArgumentError("backend must be a non-empty string")
        if not isinstance(self.device, str) or not _valid_device(self.device):
            raise InvalidArgumentError(
                f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}"
            )
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _positive_int("block_size", self.block_size)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidArgumentError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "fp8" and self.backend not in ("torch", "cuda"):
            raise InvalidArgumentError(
                f"kv_cache_dtype fp8 needs the engine's Triton attention: backend torch or "
                f"cuda on a GPU, not {self.backend!r}"
            )
        if self.kv_cache_dtype == "fp8" and self.device == "cpu":
            raise InvalidArgumentError(
                "kv_cache_dtype fp8 needs a CUDA device: the CPU path reads a cache of the "
                "model's dtype"
            )
        if self.block_size & (self.block_size - 1):
            raise InvalidArgumentError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes is not None:
            _positive_int("kv_cache_bytes", self.kv_cache_bytes)
        if self.swap_space_gib is not None:
            _off_or_positive("swap_space_gib", self.swap_space_gib)
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)):
            raise InvalidArgumentError("gpu_memory_utilization must be a number")
        if not 0.0 < utilization <= 1.0:
            raise InvalidArgumentError(
                f"gpu_memory_utilization must be in (0, 1], got {utilization}"
            )
        if self.max_num_seqs is not None:
            _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _off_or_positive("target_step_ms", self.target_step_ms)
        _off_or_positive("stats_log_interval_s", self.stats_log_interval_s)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
            if self.max_model_len < 2:
                raise InvalidArgumentError("max_model_len must be >= 2")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size > 1 and self.backend not in TENSOR_PARALLEL_BACKENDS:
            raise InvalidArgumentError(
                f"tensor_parallel_size > 1 runs the backends {TENSOR_PARALLEL_BACKENDS}, "
                f"not {self.backend!r}"
            )
        if self.tensor_parallel_size > 1 and self.adapter_root is not None:
            raise InvalidArgumentError(
                "LoRA adapters (adapter_root) are not served with tensor_parallel_size > 1: "
                "their deltas are not split over the ranks"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidArgumentError("enable_prefix_caching must be a boolean")
        if self.forward_thread_policy not in FORWARD_THREAD_POLICIES:
            raise InvalidArgumentError(
                f"forward_thread_policy must be one of {FORWARD_THREAD_POLICIES}, "
                f"got {self.forward_thread_policy!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgumentError(f"seed must be an integer >= 0, got {self.seed!r}")
        LoRAConfig.from_engine_config(self)  # validates the LoRA fields

    def resolved_device(self) -> str:
        """The concrete device: `auto` becomes cuda when a GPU is visible, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _valid_device(device: str) -> bool:
    if device in ("cpu", "cuda", "auto"):
        return True
    prefix, _, index = device.partition(":")
    return prefix == "cuda" and index.isdigit()


def _off_or_positive(name: str, value: object) -> None:
    """A finite number >= 0 (0: off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number")
    if not 0.0 <= value < float("inf"):
        raise InvalidArgumentError(f"{name} must be >= 0 (0: off), got {value}")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
