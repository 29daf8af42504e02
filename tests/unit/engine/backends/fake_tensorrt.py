"""A stand-in for TensorRT's Python API, for testing the builder and runtime logic without it.

It has the surface the engine uses (Logger, Builder, OnnxParser, builder config, optimization
profiles, timing cache, Runtime, engine, execution context) and records what it was asked.
An "engine" is the graph path, its tensor names, the profile and the flags as JSON bytes; its
execution context really computes: it reads each input from the address it was bound to
(float32 host memory), runs the ONNX graph with onnxruntime, and writes the output to its bound
address. So a wrong pointer, shape or name gives wrong numbers, not a silent pass.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

import numpy as np
import onnx
import onnxruntime

from services.engine.backends.tensorrt_segments import create_executor


class FakeTensorRT:
    """One fake `tensorrt` module; attributes count builds, flags and launches."""

    __version__ = "10.99.0"

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class BuilderFlag:
        BF16 = "BF16"
        FP16 = "FP16"

    class MemoryPoolType:
        WORKSPACE = "WORKSPACE"

    def __init__(self) -> None:
        self.builds: list[dict[str, Any]] = []
        self.timing_caches_seen: list[bytes] = []
        self.launches = 0
        self.fail_builds = False
        self._sessions: dict[str, Any] = {}
        fake = self

        class Builder:
            def __init__(self, logger: Any) -> None:
                self.logger = logger

            def create_network(self, flags: int) -> _Network:
                return _Network()

            def create_builder_config(self) -> _Config:
                return _Config(fake)

            def create_optimization_profile(self) -> _Profile:
                return _Profile()

            def build_serialized_network(self, network: _Network, config: _Config) -> Any:
                if fake.fail_builds:
                    return None
                record = {
                    "graph": network.graph_path,
                    "inputs": network.inputs,
                    "outputs": network.outputs,
                    "profiles": [profile.shapes for profile in config.profiles],
                    "flags": sorted(config.flags),
                    "workspace": config.pools.get("WORKSPACE"),
                }
                fake.builds.append(record)
                return json.dumps(record).encode()

        class OnnxParser:
            def __init__(self, network: _Network, logger: Any) -> None:
                self.network = network
                self.errors: list[str] = []

            def parse_from_file(self, path: str) -> bool:
                try:
                    graph = onnx.load(path, load_external_data=False).graph
                except Exception as exc:
                    self.errors.append(f"cannot read {path}: {exc}")
                    return False
                self.network.graph_path = path
                self.network.inputs = [value.name for value in graph.input]
                self.network.outputs = [value.name for value in graph.output]
                return True

            @property
            def num_errors(self) -> int:
                return len(self.errors)

            def get_error(self, index: int) -> str:
                return self.errors[index]

        class Runtime:
            def __init__(self, logger: Any) -> None:
                self.logger = logger

            def deserialize_cuda_engine(self, data: bytes) -> _Engine | None:
                try:
                    return _Engine(fake, json.loads(bytes(data)))
                except ValueError:
                    return None

        self.Builder = Builder
        self.OnnxParser = OnnxParser
        self.Runtime = Runtime

    def session(self, path: str) -> Any:
        if path not in self._sessions:
            self._sessions[path] = onnxruntime.InferenceSession(
                path, providers=["CPUExecutionProvider"]
            )
        return self._sessions[path]


class _Network:
    def __init__(self) -> None:
        self.graph_path = ""
        self.inputs: list[str] = []
        self.outputs: list[str] = []


class _Profile:
    def __init__(self) -> None:
        self.shapes: dict[str, list[list[int]]] = {}

    def set_shape(self, name: str, low: Any, opt: Any, high: Any) -> None:
        self.shapes[name] = [list(low), list(opt), list(high)]


class _TimingCache:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def serialize(self) -> bytes:
        return self.data + b"timing;"


class _Config:
    def __init__(self, fake: FakeTensorRT) -> None:
        self.fake = fake
        self.flags: set[str] = set()
        self.pools: dict[str, int] = {}
        self.profiles: list[_Profile] = []
        self.timing_cache: _TimingCache | None = None

    def set_flag(self, flag: str) -> None:
        self.flags.add(flag)

    def set_memory_pool_limit(self, pool: str, size: int) -> None:
        self.pools[pool] = size

    def add_optimization_profile(self, profile: _Profile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    def create_timing_cache(self, data: bytes) -> _TimingCache:
        self.fake.timing_caches_seen.append(bytes(data))
        return _TimingCache(bytes(data))

    def set_timing_cache(self, cache: _TimingCache, ignore_mismatch: bool) -> bool:
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> _TimingCache:
        assert self.timing_cache is not None
        return self.timing_cache


class _Engine:
    def __init__(self, fake: FakeTensorRT, record: dict[str, Any]) -> None:
        self.fake = fake
        self.record = record
        self.names = record["inputs"] + record["outputs"]

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def create_execution_context(self) -> _Context:
        return _Context(self)


class _Context:
    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        low, _, high = self.engine.record["profiles"][0][name]
        if not all(lo <= dim <= hi for lo, dim, hi in zip(low, shape, high, strict=True)):
            raise ValueError(f"shape {shape} of {name} outside the profile {low}..{high}")
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream: int) -> bool:
        record = self.engine.record
        feeds = {name: _view(self.addresses[name], self.shapes[name]) for name in record["inputs"]}
        (result,) = self.engine.fake.session(record["graph"]).run(None, feeds)
        output = record["outputs"][0]
        np.copyto(_view(self.addresses[output], result.shape), result)
        self.engine.fake.launches += 1
        return True


def _view(address: int, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    buffer = (ctypes.c_float * count).from_address(address)
    return np.ctypeslib.as_array(buffer).reshape(shape)


class RecordingCapture:
    """A CUDA graph capture double: runs the launch at capture and at each replay, counting."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, launch: Any) -> Any:
        self.captures += 1
        launch(0)

        def replay() -> None:
            self.replays += 1
            launch(0)

        return replay


FAKE_GPU_NAME = "Fake GPU"


def create_fake_executor(graphs: Any, config: Any, device: Any, **limits: Any) -> Any:
    """The "tensorrt" executor on the CPU through FakeTensorRT (for the engine-level test)."""
    from services.engine.backends.tensorrt_build import GpuIdentity

    return create_executor(
        graphs,
        config,
        device,
        trt=FakeTensorRT(),
        gpu=GpuIdentity(FAKE_GPU_NAME, (9, 0)),
        cache_root=None,  # the engine cache under env.cache_dir()
        graph_capture=RecordingCapture(),
        require_cuda=False,
        **limits,
    )


def check_installed() -> None:
    """The fake is always installed."""


def check_device(device: Any) -> None:
    """The fake runs on the CPU."""
