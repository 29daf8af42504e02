"""create_model_runner: the engine's model runner for a config, from a registry by device type.

"cpu" is cpu_runner.CpuModelRunner (oneDNN-packed weights, native CPU kernels); "cuda" is
cuda_runner.CudaModelRunner, which takes the fast path (Triton kernels, decode CUDA graphs per
batch bucket) where Triton and the model allow and the plain torch ops otherwise. Each runner
class builds itself from the EngineConfig (`from_engine_config`). Runner modules are imported
on first use, so importing this module stays cheap (no torch, no Triton).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from services.common.errors import InvalidArgumentError
from services.common.model_files import ModelFiles
from services.engine.config import EngineConfig

if TYPE_CHECKING:
    from services.engine.model_runner import ModelRunner

# device type -> "module:class" of its runner
RUNNERS: dict[str, str] = {
    "cpu": "services.engine.cpu_runner:CpuModelRunner",
    "cuda": "services.engine.cuda_runner:CudaModelRunner",
}
# forward backend -> "module:class" of its runner, ahead of the device registry: the exported
# batchful graphs of services/engine/segmented_runner.py on any device.
FORWARD_BACKEND_RUNNERS: dict[str, str] = {
    "onnxruntime": "services.engine.segmented_runner:SegmentedModelRunner",
    "tensorrt": "services.engine.segmented_runner:SegmentedModelRunner",
}


def runner_class(device_type: str) -> type:
    """The runner class registered for `device_type` ("cpu", "cuda")."""
    target = RUNNERS.get(device_type)
    if target is None:
        known = ", ".join(sorted(RUNNERS))
        raise InvalidArgumentError(f"no model runner for device {device_type!r}; known: {known}")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_model_runner(config: EngineConfig, model_files: ModelFiles) -> ModelRunner:
    """The runner of the config's forward backend or else its device, from the engine config.

    With tensor_parallel_size > 1, rank 0's runner of a group it starts (parallel/launch.py).
    """
    if config.tensor_parallel_size > 1:
        from services.engine.parallel.launch import create_parallel_runner

        return create_parallel_runner(config, model_files)
    target = FORWARD_BACKEND_RUNNERS.get(config.backend)
    if target is not None:
        module_name, _, class_name = target.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        return cls.from_engine_config(config, model_files)
    device_type = config.resolved_device().partition(":")[0]
    return runner_class(device_type).from_engine_config(config, model_files)
