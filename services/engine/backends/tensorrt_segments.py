"""The batchful segments run as TensorRT engines on CUDA tensors the engine owns.

One engine and one execution context per segment graph (built or loaded by
backends/tensorrt_build.py). A call binds the engine's input and output tensors by device
pointer (`set_tensor_address`), sets the input shapes (the token dimension of the step) and
enqueues the engine on the current CUDA stream; the output tensor is one the engine allocated,
so nothing is copied through the host. Token counts up to `graph_max_tokens` (the decode
batches) are captured once per count as a CUDA graph around the enqueue, over static input and
output buffers, and replayed afterwards; where capture fails the engine runs eagerly, and the
reason is logged once. Token counts past the profile's maximum (the step token budget the
engines were built for) are an error, never a silent rebuild.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.engine.backends import segments
from services.engine.backends.onnx_cache import SegmentGraphs
from services.engine.backends.tensorrt_build import (
    EngineBuilder,
    GpuIdentity,
    Profile,
    import_tensorrt,
    profile_for,
)
from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# Token counts captured as CUDA graphs (decode steps of up to this many sequences).
GRAPH_MAX_TOKENS = 64


def check_installed() -> None:
    """Raise FailedPreconditionError naming the package when TensorRT does not import."""
    import_tensorrt()


def check_device(device: torch.device) -> None:
    """Raise FailedPreconditionError before any weight loads where `device` is not CUDA."""
    if torch.device(device).type != "cuda":
        raise FailedPreconditionError(
            f"backend 'tensorrt' runs on a CUDA device, not {device}; on CPU use 'onnxruntime'"
        )


def create_executor(
    graphs: SegmentGraphs,
    config: ModelConfig,
    device: torch.device,
    *,
    max_tokens: int,
    max_rows: int,
    trt: Any = None,
    gpu: GpuIdentity | None = None,
    cache_root: Path | None = None,
    graph_capture: Any = None,
    require_cuda: bool = True,
) -> TensorRTSegments:
    """The "tensorrt" forward backend's executor: engines for every graph of `graphs`."""
    trt = import_tensorrt(trt)
    device = torch.device(device)
    if require_cuda:
        check_device(device)
    if gpu is None:
        gpu = GpuIdentity.of(device)
    if graph_capture is None and device.type == "cuda":
        graph_capture = CudaGraphCapture(device)
    builder = EngineBuilder(trt, gpu, graphs.dtype, cache_root=cache_root)
    return TensorRTSegments(
        graphs,
        config,
        device,
        builder=builder,
        max_tokens=max_tokens,
        max_rows=max_rows,
        graph_capture=graph_capture,
    )


class CudaGraphCapture:
    """Captures one launch on a side stream into a torch CUDA graph; returns its replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, launch: Callable[[int], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            launch(torch.cuda.current_stream(self.device).cuda_stream)
        return graph.replay


def current_stream(device: torch.device) -> int:
    """The CUDA stream handle to enqueue on (0 off CUDA: test doubles run synchronously)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


class SegmentEngine:
    """One segment graph's engine, execution context and CUDA graphs per token count."""

    def __init__(
        self,
        engine: Any,
        kind: str,
        profile: Profile,
        width: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.spec = segments.spec(kind)
        self.engine = engine
        self.profile = profile
        self.width = width
        self.device = device
        self.dtype = dtype
        self.out_dtype = torch.float32 if kind == segments.HEAD.kind else dtype
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        expected = set(self.spec.inputs) | set(self.spec.outputs)
        if names != expected:
            raise FailedPreconditionError(
                f"TensorRT engine of {kind} binds {sorted(names)}, expected {sorted(expected)}"
            )
        self.context = engine.create_execution_context()
        self.replays: dict[int, Callable[[], None]] = {}
        self.static_inputs: list[torch.Tensor] = []
        self.static_output: torch.Tensor | None = None

    def enqueue(self, inputs: Sequence[torch.Tensor], output: torch.Tensor, stream: int) -> None:
        """Bind inputs and output by pointer, set the token count, launch on `stream`."""
        context = self.context
        for name, tensor in zip(self.spec.inputs, inputs, strict=True):
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        context.set_tensor_address(self.spec.outputs[0], output.data_ptr())
        if not context.execute_async_v3(stream):
            raise FailedPreconditionError(f"TensorRT failed to enqueue segment {self.spec.kind}")

    def run(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        rows = inputs[0].shape[0]
        output = torch.empty((rows, self.width), dtype=self.out_dtype, device=self.device)
        self.enqueue(
            [tensor.contiguous() for tensor in inputs], output, current_stream(self.device)
        )
        return output

    def run_graphed(
        self, inputs: Sequence[torch.Tensor], capture: Any, max_tokens: int
    ) -> torch.Tensor:
        """Replay (capturing on first use) the CUDA graph of this token count."""
        rows = inputs[0].shape[0]
        if self.static_output is None:
            self.static_inputs = [
                torch.zeros((max_tokens, tensor.shape[1]), dtype=self.dtype, device=self.device)
                for tensor in inputs
            ]
            self.static_output = torch.zeros(
                (max_tokens, self.width), dtype=self.out_dtype, device=self.device
            )
        for static, tensor in zip(self.static_inputs, inputs, strict=True):
            static[:rows].copy_(tensor)
        replay = self.replays.get(rows)
        if replay is None:
            views = [static[:rows] for static in self.static_inputs]
            output = self.static_output[:rows]
            # One eager launch first: TensorRT settles a new shape before it can be captured.
            self.enqueue(views, output, current_stream(self.device))
            replay = capture.capture(lambda stream: self.enqueue(views, output, stream))
            self.replays[rows] = replay
        replay()
        return self.static_output[:rows].clone()


class TensorRTSegments:
    """Runs segment `kind` of layer `layer` on torch tensors: `run(kind, layer, inputs)`."""

    name = "tensorrt"

    def __init__(
        self,
        graphs: SegmentGraphs,
        config: ModelConfig,
        device: torch.device,
        *,
        builder: EngineBuilder,
        max_tokens: int,
        max_rows: int,
        graph_capture: Any = None,
        graph_max_tokens: int = GRAPH_MAX_TOKENS,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = graphs.dtype
        self.graph_capture = graph_capture
        self.graph_max_tokens = min(graph_max_tokens, max_tokens)
        self.graphs_off_reason: str | None = None if graph_capture else "no CUDA graph capture"
        self.engines: dict[str, list[SegmentEngine]] = {}
        for kind, paths in graphs.graphs.items():
            profile = profile_for(kind, config, max_tokens, max_rows)
            width = segments.output_width(config, kind)
            self.engines[kind] = [
                SegmentEngine(
                    builder.load_or_build(path, graphs.digests.get(path.name, ""), profile),
                    kind,
                    profile,
                    width,
                    device=self.device,
                    dtype=self.dtype,
                )
                for path in paths
            ]
        logger.info(
            "TensorRT segments: %d engines built, %d from the cache %s",
            builder.built,
            builder.loaded,
            builder.cache_root,
        )

    def run(self, kind: str, layer: int, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Segment output [rows, width] (float32 logits for the head, else the model dtype)."""
        engine = self.engines[kind][layer]
        rows = inputs[0].shape[0]
        if not 1 <= rows <= engine.profile.max_rows:
            raise InvalidArgumentError(
                f"segment {kind} got {rows} rows; its TensorRT profile covers 1 to "
                f"{engine.profile.max_rows} (the step token budget it was built for)"
            )
        if self.graphs_off_reason is None and rows <= self.graph_max_tokens:
            try:
                return engine.run_graphed(inputs, self.graph_capture, self.graph_max_tokens)
            except FailedPreconditionError:
                raise
            except Exception as exc:  # capture support varies by driver and TensorRT build
                self.graphs_off_reason = f"CUDA graph capture failed: {exc}"
                logger.warning("TensorRT segments run eagerly: %s", self.graphs_off_reason)
        return engine.run(inputs)
