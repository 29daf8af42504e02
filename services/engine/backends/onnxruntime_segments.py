"""The batchful segments run by ONNX Runtime, on tensors the engine owns.

One InferenceSession per exported graph (backends/onnx_export.py), on the CPU execution
provider, or on the CUDA one where the installed onnxruntime has it and the engine runs on a
GPU. Inputs and outputs are bound by pointer (IOBinding) to torch tensors: the engine's residual
stream and attention output go in, and the segment writes into a tensor the engine allocated,
so no step copies through numpy. What the provider cannot run (bf16 or fp16 kernels missing on
CPU) fails at start-up with a FailedPreconditionError that says which dtype to use.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

import torch

from services.common.errors import FailedPreconditionError
from services.engine.backends import segments
from services.engine.backends.onnx_cache import SegmentGraphs
from services.engine.backends.onnx_export import ONNX_DTYPES
from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
# Threads of each session's intra-op pool. One: on a 2-core machine shared with the engine's
# torch attention, SmolLM2 float32 measured 71 ms per 8-sequence decode step and ~500 prefill
# tokens/s with one thread, against 144 ms and ~230 tokens/s with two non-spinning threads
# (a wake-up per operator) and over a second per step with two spinning ones.
SESSION_THREADS = 1


def providers_for(device: torch.device, available: Sequence[str]) -> list[str]:
    """Execution providers for `device`: CUDA first on a GPU where onnxruntime has it."""
    if device.type == "cuda":
        if CUDA_PROVIDER not in available:
            raise FailedPreconditionError(
                "backend 'onnxruntime' on a GPU needs onnxruntime's CUDA execution provider "
                f"(installed: {', '.join(available)}); install onnxruntime-gpu"
            )
        return [CUDA_PROVIDER]
    return [CPU_PROVIDER]


def check_installed() -> None:
    """Raise FailedPreconditionError naming what to install when the exporter or runtime is
    missing (onnx and onnxscript export the graphs, onnxruntime runs them)."""
    for module, package in (
        ("onnx", "onnx"),
        ("onnxscript", "onnxscript"),
        ("onnxruntime", "onnxruntime"),
    ):
        try:
            importlib.import_module(module)
        except ImportError:
            raise FailedPreconditionError(
                f"backend 'onnxruntime' needs the {package} package: "
                "pip install onnx onnxscript onnxruntime (onnxruntime-gpu for CUDA)"
            ) from None


def check_device(device: torch.device) -> None:
    """Raise FailedPreconditionError before any weight loads where `device` has no provider."""
    import onnxruntime as ort

    providers_for(torch.device(device), ort.get_available_providers())


def create_executor(
    graphs: SegmentGraphs,
    config: ModelConfig,
    device: torch.device,
    *,
    max_tokens: int,
    max_rows: int,
) -> OnnxRuntimeSegments:
    """The segment executor of the "onnxruntime" forward backend (token counts are free)."""
    del max_tokens, max_rows  # onnxruntime takes any token count
    return OnnxRuntimeSegments(graphs, config, device)


class OnnxRuntimeSegments:
    """Runs segment `kind` of layer `layer` on torch tensors: `run(kind, layer, inputs)`."""

    name = "onnxruntime"

    def __init__(
        self,
        graphs: SegmentGraphs,
        config: ModelConfig,
        device: torch.device,
        *,
        threads: int = SESSION_THREADS,
    ) -> None:
        import onnxruntime as ort

        self.config = config
        self.device = torch.device(device)
        self.dtype = graphs.dtype
        self.providers = providers_for(self.device, ort.get_available_providers())
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        # Dozens of sessions (two per layer) each own a thread pool: spinning idle threads
        # would take the cores from the one session running and from torch's attention.
        # (Only where `threads` > 1.)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._element_type = ONNX_DTYPES[self.dtype]
        self._device_type = "cuda" if self.device.type == "cuda" else "cpu"
        self._device_id = self.device.index or 0
        self.sessions: dict[str, list] = {}
        for kind, paths in graphs.graphs.items():
            self.sessions[kind] = [self._session(ort, path, options) for path in paths]
        self._widths = {
            spec.kind: segments.output_width(config, spec.kind) for spec in segments.SEGMENTS
        }
        self.check()

    def _session(self, ort, path, options):
        try:
            return ort.InferenceSession(str(path), sess_options=options, providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own, unexported exception types
            raise FailedPreconditionError(
                f"onnxruntime ({', '.join(self.providers)}) cannot load {path.name} in "
                f"{self.dtype}: {str(exc).splitlines()[0][:300]}; use dtype float32"
            ) from None

    def check(self) -> None:
        """Run every segment kind once on one token: fail at start-up, not on a request."""
        for spec in segments.SEGMENTS:
            inputs = segments.segment_inputs(
                self.config, spec.kind, 1, dtype=self.dtype, device=self.device
            )
            try:
                self.run(spec.kind, 0, inputs)
            except Exception as exc:
                raise FailedPreconditionError(
                    f"onnxruntime ({', '.join(self.providers)}) cannot run segment "
                    f"{spec.kind} in {self.dtype}: {str(exc).splitlines()[0][:300]}; "
                    "use dtype float32"
                ) from None

    def run(self, kind: str, layer: int, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Segment output [rows, width] (float32 logits for the head, else the model dtype)."""
        session = self.sessions[kind][layer]
        spec = segments.spec(kind)
        rows = inputs[0].shape[0]
        out_dtype = torch.float32 if kind == segments.HEAD.kind else self.dtype
        output = torch.empty((rows, self._widths[kind]), dtype=out_dtype, device=self.device)
        binding = session.io_binding()
        held = [tensor.contiguous() for tensor in inputs]  # alive until the run returns
        for name, tensor in zip(spec.inputs, held, strict=True):
            binding.bind_input(
                name,
                self._device_type,
                self._device_id,
                self._element_type,
                tuple(tensor.shape),
                tensor.data_ptr(),
            )
        binding.bind_output(
            spec.outputs[0],
            self._device_type,
            self._device_id,
            ONNX_DTYPES[out_dtype],
            tuple(output.shape),
            output.data_ptr(),
        )
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        session.run_with_iobinding(binding)
        return output
