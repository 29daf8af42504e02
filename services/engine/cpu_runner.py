"""CpuModelRunner: the engine's model runner on CPU (the default here and in CI).

On top of the device-neutral BaseModelRunner it runs a tiny model's ops on one thread, tunes
glibc malloc to reuse freed activations (keep_freed_cpu_memory), packs the linear weights and
the LM head for oneDNN once at load (layers/linear.py), and binds the native fused kernels
(kernels/cpu/cpu_native.py; `cpu_kernels=False` keeps PyTorch ops) to the model and to the
attention backend.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import TYPE_CHECKING

import torch

from services.common.errors import InvalidArgumentError
from services.common.model_files import ModelFiles
from services.engine.config import EngineConfig
from services.engine.kernels.cpu.cpu_native import CpuKernels
from services.engine.kernels.cpu.cpu_native import cpu_kernels as load_cpu_kernels
from services.engine.layers.linear import pack_linear_layers
from services.engine.model_runner import BaseModelRunner, RunnerCapabilities, runner_arguments
from services.engine.models.config import ModelConfig

if TYPE_CHECKING:
    from services.engine.lora.engine_adapters import EngineAdapters

logger = logging.getLogger(__name__)

# CPU models at most this wide run their ops on one torch thread (see _prepare_device).
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
# Model dtypes the native CPU kernels (kernels/cpu/cpu_native.py) cover.
NATIVE_CPU_DTYPES = (torch.float32, torch.bfloat16)


class CpuModelRunner(BaseModelRunner):
    """One model on the CPU with its KV cache; `execute` runs a scheduled step."""

    capabilities = RunnerCapabilities(greedy_ids=True)

    def __init__(self, model_files: ModelFiles, *, cpu_kernels: bool = True, **kwargs) -> None:
        device = torch.device(kwargs.pop("device", "cpu"))
        if device.type != "cpu":
            raise InvalidArgumentError(f"CpuModelRunner runs on the CPU, not {device}")
        self._use_cpu_kernels = cpu_kernels
        self.cpu_kernels: CpuKernels | None = None
        super().__init__(model_files, device="cpu", **kwargs)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, model_files: ModelFiles) -> CpuModelRunner:
        return cls(model_files, cpu_kernels=config.cpu_kernels, **runner_arguments(config))

    def _prepare_device(self, config: ModelConfig) -> None:
        if config.hidden_size <= SINGLE_THREAD_MAX_HIDDEN:
            # A tiny model's ops are too small to split: extra threads only spin and contend
            # with the router/tokenizer processes (measured: ~13 ms vs 10-60 ms per step of
            # dummy:tiny at 64 sequences on 2 cores).
            torch.set_num_threads(1)
        keep_freed_cpu_memory()

    def _prepare_model(self) -> None:
        # oneDNN-prepacked weights: 1.2-3x faster projections.
        pack_linear_layers(self.model, exclude=("lm_head",))
        self.model.pack_lm_head()

    def _bind_kernels(self) -> str:
        if not self._use_cpu_kernels or self.dtype not in NATIVE_CPU_DTYPES:
            return ""
        self.cpu_kernels = load_cpu_kernels()
        self.model.use_cpu_kernels(self.cpu_kernels)
        if hasattr(self.backend, "cpu_kernels"):  # the torch backend's native attention
            self.backend.cpu_kernels = self.cpu_kernels
        return "native CPU kernels" if self.cpu_kernels is not None else ""

    def bind_lora(self, adapters: EngineAdapters) -> None:
        """As the base runner; the LoRA deltas go through the native kernels where they are."""
        super().bind_lora(adapters)
        adapters.runtime.cpu_kernels = self.cpu_kernels


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
