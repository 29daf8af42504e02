"""create_model_runner: pick the engine's model runner for a config.

On a CUDA device with Triton importable and a model the fast path covers, the engine gets
cuda_runner.CudaModelRunner (Triton kernels, decode CUDA graphs per batch bucket); everywhere
else (CPU, no Triton, biases or q/k norm) the plain ModelRunner, so the CPU path is unchanged.
Torch and Triton are imported lazily: importing this module stays cheap.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from services.common.model_files import ModelFiles
from services.engine.config import EngineConfig

logger = logging.getLogger(__name__)

FAST_PATH_BACKENDS = ("torch", "cuda")


def create_model_runner(config: EngineConfig, model_files: ModelFiles) -> Any:
    """A ModelRunner (or its CUDA fast-path subclass) built from the engine config."""
    import torch

    from services.engine.model_runner import ModelRunner

    device = config.resolved_device()
    kwargs = dict(
        device=device,
        dtype=None if config.dtype == "auto" else getattr(torch, config.dtype),
        block_size=config.block_size,
        kv_cache_bytes=config.kv_cache_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        backend=config.backend,
        seed=config.seed,
        cpu_kernels=config.cpu_kernels,
    )
    reason = _why_not_fast(config, model_files, device)
    if reason is not None:
        if device.startswith("cuda"):
            logger.info("CUDA fast path off (%s): plain ModelRunner", reason)
        return ModelRunner(model_files, **kwargs)
    from services.engine.cuda_runner import CudaModelRunner

    return CudaModelRunner(model_files, max_num_seqs=config.max_num_seqs, **kwargs)


def _why_not_fast(config: EngineConfig, model_files: ModelFiles, device: str) -> str | None:
    if not device.startswith("cuda"):
        return "not a CUDA device"
    if config.backend not in FAST_PATH_BACKENDS:
        return f"backend {config.backend!r}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available"
    from services.engine.cuda_runner import fast_path_unsupported
    from services.engine.model_runner import load_model_config

    return fast_path_unsupported(load_model_config(model_files, config.max_model_len))
