"""TensorRT engines built from the exported segment graphs, and their on-disk cache.

Each ONNX segment graph (backends/onnx_export.py) is parsed by TensorRT's ONNX parser and built
with the Python builder API: the BF16 or FP16 builder flag of the model's dtype, one
optimization profile over the token dimension (1 up to the step's token budget; the head's rows
up to the most sequences of a step) and a timing cache file shared by every build on the same GPU
and TensorRT version, so later builds skip the kernel timing. The serialized engine is cached
under `env.cache_dir()/tensorrt/`, keyed by the GPU's name and compute capability, TensorRT's
version, the profile, the dtype and the graph's sha256; a cached engine that does not
deserialize (another TensorRT, a truncated file) is rebuilt with a warning.

TensorRT is imported only when the "tensorrt" backend is selected (`import_tensorrt`), and a
missing module is a FailedPreconditionError that names the package to install for torch's CUDA.
Every function takes the module as a parameter, so the logic runs against any object with
TensorRT's API.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common import env
from services.common.errors import FailedPreconditionError
from services.engine.backends import segments
from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# Bumped when what goes into an engine (flags, profile layout) changes.
BUILDER_VERSION = 1
WORKSPACE_BYTES = 2 << 30
# The token count TensorRT tunes kernels for inside the profile (decode batches are small).
OPT_TOKENS = 64


def install_hint(cuda_version: str | None = None) -> str:
    """What to pip-install for TensorRT's Python builder, matched to torch's CUDA."""
    cuda = cuda_version if cuda_version is not None else torch.version.cuda
    if not cuda:
        return "a CUDA build of torch, then: pip install tensorrt"
    major = cuda.split(".")[0]
    return f"pip install tensorrt-cu{major} (TensorRT for CUDA {cuda}, torch's CUDA)"


def import_tensorrt(module: Any = None) -> Any:
    """The tensorrt module (or `module` where given), else a FailedPreconditionError."""
    if module is not None:
        return module
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise FailedPreconditionError(
            f"backend 'tensorrt' needs TensorRT's Python package ({exc}): {install_hint()}"
        ) from None


@dataclass(frozen=True)
class GpuIdentity:
    """What a built engine is tied to: the GPU model and its compute capability."""

    name: str
    capability: tuple[int, int]

    @classmethod
    def of(cls, device: torch.device) -> GpuIdentity:
        return cls(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))


@dataclass(frozen=True)
class Profile:
    """One optimization profile: (min, opt, max) shape of every input of a segment graph."""

    shapes: tuple[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]

    @property
    def max_rows(self) -> int:
        return self.shapes[0][3][0]

    def as_dict(self) -> dict[str, list[list[int]]]:
        return {name: [list(low), list(opt), list(high)] for name, low, opt, high in self.shapes}


def profile_for(kind: str, config: ModelConfig, max_tokens: int, max_rows: int) -> Profile:
    """Token counts 1..max_tokens (the head: 1..max_rows sampled rows) for segment `kind`."""
    spec = segments.spec(kind)
    high = max_rows if kind == segments.HEAD.kind else max_tokens
    opt = max(1, min(OPT_TOKENS, high))
    q_size = config.num_heads * config.head_dim
    widths = {"residual": config.hidden_size, "attention": q_size}
    shapes = tuple(
        (name, (1, widths[name]), (opt, widths[name]), (high, widths[name])) for name in spec.inputs
    )
    return Profile(shapes)


def engine_key(
    trt: Any, gpu: GpuIdentity, profile: Profile, dtype: torch.dtype, graph_sha256: str
) -> dict[str, Any]:
    """Everything a serialized engine depends on."""
    return {
        "gpu": gpu.name,
        "capability": list(gpu.capability),
        "tensorrt": str(trt.__version__),
        "profile": profile.as_dict(),
        "dtype": str(dtype).removeprefix("torch."),
        "graph": graph_sha256,
        "builder": BUILDER_VERSION,
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


class EngineBuilder:
    """Builds, caches and deserializes the TensorRT engine of one segment graph at a time."""

    def __init__(
        self,
        trt: Any,
        gpu: GpuIdentity,
        dtype: torch.dtype,
        *,
        cache_root: Path | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        self.trt = trt
        self.gpu = gpu
        self.dtype = dtype
        self.workspace_bytes = workspace_bytes
        root = Path(cache_root) if cache_root is not None else Path(env.cache_dir()) / "tensorrt"
        self.cache_root = root
        root.mkdir(parents=True, exist_ok=True)
        self.trt_logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.trt_logger)
        gpu_tag = "".join(ch if ch.isalnum() else "_" for ch in gpu.name)
        self.timing_cache_path = root / (
            f"timing-{gpu_tag}-sm{gpu.capability[0]}{gpu.capability[1]}-trt{trt.__version__}.cache"
        )
        self.built = 0
        self.loaded = 0

    def engine_path(self, graph: Path, key: dict[str, Any]) -> Path:
        return self.cache_root / f"{graph.stem}-{key_digest(key)}.engine"

    def load_or_build(self, graph: Path, graph_sha256: str, profile: Profile) -> Any:
        """The deserialized ICudaEngine of `graph`, from the cache or freshly built."""
        key = engine_key(self.trt, self.gpu, profile, self.dtype, graph_sha256)
        path = self.engine_path(graph, key)
        if path.is_file():
            engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is not None:
                self.loaded += 1
                return engine
            logger.warning("cached TensorRT engine %s does not deserialize: rebuilding", path)
        serialized = self.build(graph, profile)
        _write_atomically(path, serialized)
        path.with_suffix(".json").write_text(json.dumps(key, indent=1))
        engine = self.runtime.deserialize_cuda_engine(serialized)
        if engine is None:
            raise FailedPreconditionError(
                f"TensorRT built an engine for {graph.name} that it cannot deserialize"
            )
        self.built += 1
        return engine

    def build(self, graph: Path, profile: Profile) -> bytes:
        """Parse `graph` and build its serialized engine (flags, profile, timing cache)."""
        trt = self.trt
        builder = trt.Builder(self.trt_logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self.trt_logger)
        if not parser.parse_from_file(str(graph)):  # reads the external weights beside it
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise FailedPreconditionError(f"TensorRT cannot parse {graph.name}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.workspace_bytes)
        if self.dtype == torch.bfloat16:
            config.set_flag(trt.BuilderFlag.BF16)
        elif self.dtype == torch.float16:
            config.set_flag(trt.BuilderFlag.FP16)
        optimization = builder.create_optimization_profile()
        for name, low, opt, high in profile.shapes:
            optimization.set_shape(name, low, opt, high)
        config.add_optimization_profile(optimization)
        cached = self.timing_cache_path.read_bytes() if self.timing_cache_path.is_file() else b""
        timing_cache = config.create_timing_cache(cached)
        config.set_timing_cache(timing_cache, False)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise FailedPreconditionError(
                f"TensorRT could not build an engine for {graph.name} "
                f"(profile {profile.as_dict()}, {self.dtype})"
            )
        _write_atomically(self.timing_cache_path, bytes(config.get_timing_cache().serialize()))
        return bytes(serialized)


def _write_atomically(path: Path, data: bytes) -> None:
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
