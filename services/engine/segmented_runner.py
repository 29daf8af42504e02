"""SegmentedModelRunner: the model as exported batchful graphs around the engine's own attention.

The forward backends "onnxruntime" and "tensorrt" run each decoder layer in two batchful
segments (backends/segments.py: norm + QKV projection; output projection + MLP) and the model's
head in a third, all as graphs exported once to ONNX (backends/onnx_export.py). Between them the
engine keeps the batchless part: rotary embedding and paged attention over its KV cache with its
"torch" attention backend (the native CPU kernels on CPU), so scheduling, continuous batching,
chunked prefill and prefix caching work unchanged: the graphs only ever see a flat token
dimension. The torch copies of the batchful weights are released once the graphs are loaded.

The segment executor comes from a registry by backend name: "onnxruntime" (CPU, or its CUDA
execution provider on a GPU; backends/onnxruntime_segments.py) and "tensorrt" (CUDA only;
backends/tensorrt_segments.py). On CPU the runner resolves dtype "auto" to float32, the dtype
onnxruntime's CPU kernels cover.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.common.model_files import ModelFiles
from services.engine.backends import segments
from services.engine.backends.onnx_export import load_or_export
from services.engine.config import EngineConfig
from services.engine.cpu_runner import NATIVE_CPU_DTYPES, keep_freed_cpu_memory
from services.engine.forward_batch import ScheduledBatch
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.model_runner import BaseModelRunner, RunnerCapabilities, runner_arguments
from services.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# forward backend -> "module:function" building its segment executor
SEGMENT_EXECUTORS: dict[str, str] = {
    "onnxruntime": "services.engine.backends.onnxruntime_segments:create_executor",
    "tensorrt": "services.engine.backends.tensorrt_segments:create_executor",
}
# The attention backend of the batchless part.
ATTENTION_BACKEND = "torch"


class SegmentedModelRunner(BaseModelRunner):
    """One model whose batchful segments run as exported graphs (`self.segments`)."""

    capabilities = RunnerCapabilities(greedy_ids=True)

    def __init__(
        self,
        model_files: ModelFiles,
        *,
        backend: str = "onnxruntime",
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        cpu_kernels: bool = True,
        export_root: Any = None,
        **kwargs,
    ) -> None:
        if backend not in SEGMENT_EXECUTORS:
            known = ", ".join(sorted(SEGMENT_EXECUTORS))
            raise InvalidArgumentError(f"unknown segment backend {backend!r}; known: {known}")
        if kwargs.get("tensor_parallel") is not None:
            raise FailedPreconditionError(
                f"backend {backend!r} runs the whole model on one device: no tensor parallelism"
            )
        device = torch.device(kwargs.get("device", "cpu"))
        if kwargs.get("dtype") is None and device.type == "cpu":
            kwargs["dtype"] = torch.float32
        self.segment_backend = backend
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self._use_cpu_kernels = cpu_kernels
        self._export_root = export_root
        self._seed = kwargs.get("seed", 0)
        # fail fast: libraries and device checked before any weight is built
        self._executor_factory = _executor_factory(backend, device)
        self.segments: Any = None
        super().__init__(model_files, backend=ATTENTION_BACKEND, **kwargs)
        self.backend_name = backend

    @classmethod
    def from_engine_config(
        cls, config: EngineConfig, model_files: ModelFiles
    ) -> SegmentedModelRunner:
        if config.max_num_seqs is None or config.max_num_batched_tokens is None:
            from services.engine.device_limits import resolve_limits
            from services.engine.model_runner import load_model_config

            model_config = load_model_config(model_files, config.max_model_len)
            config, _ = resolve_limits(config, model_config, config.resolved_device())
        arguments = runner_arguments(config)
        return cls(
            model_files,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            cpu_kernels=config.cpu_kernels,
            **arguments,
        )

    # ---- device hooks ---------------------------------------------------------------------
    def _prepare_device(self, config: ModelConfig) -> None:
        if self.device.type == "cpu":
            keep_freed_cpu_memory()

    def _prepare_model(self) -> None:
        graphs = load_or_export(
            self.model,
            self.model_config,
            self.model_files,
            dtype=self.dtype,
            seed=self._seed,
            root=self._export_root,
        )
        self.graphs = graphs
        self.segments = self._executor_factory(
            graphs,
            self.model_config,
            self.device,
            max_tokens=self.max_num_batched_tokens,
            max_rows=self.max_num_seqs,
        )
        self._release_batchful_weights()

    def _bind_kernels(self) -> str:
        extras = f"{self.segment_backend} segments from {self.graphs.directory}"
        if self.device.type != "cpu" or not self._use_cpu_kernels:
            return extras
        if self.dtype not in NATIVE_CPU_DTYPES:
            return extras
        from services.engine.kernels.cpu.cpu_native import cpu_kernels

        kernels = cpu_kernels()
        if kernels is not None:  # the batchless part: rotary and attention
            for layer in self.model.attention_layers:
                layer.cpu_kernels = kernels
            self.backend.cpu_kernels = kernels
        return extras

    def _release_batchful_weights(self) -> None:
        """Drop the torch copies of what the graphs now hold (the embedding stays)."""
        embedding = self.model.model.embed_tokens.weight
        for spec in segments.SEGMENTS:
            for layer in range(self.model_config.num_layers if spec.per_layer else 1):
                module = segments.segment_module(self.model, spec.kind, layer)
                for param in module.parameters():
                    if param is not embedding:
                        param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def bind_lora(self, adapters: Any) -> None:
        """LoRA deltas attach to the torch projections, which the exported graphs replace."""
        raise FailedPreconditionError(
            f"LoRA adapters are served by backend 'torch', not {self.segment_backend!r}"
        )

    # ---- steps ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; float32 logits [batch.num_logits, vocab_size]."""
        selected = self._forward(batch)
        if selected is None:
            return torch.empty((0, self.model_config.vocab_size), device=self.device)
        return self.segments.run(segments.HEAD.kind, 0, (selected,))

    @torch.inference_mode()
    def execute_greedy(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; int64 argmax ids [batch.num_logits]."""
        return self.execute(batch).argmax(dim=-1)

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Residual rows of the tokens that need logits, or None when no row does."""
        if not batch.sequences:
            return None
        input_ids, positions, metadata = self.prepare_inputs(batch)
        self.backend.prepare(metadata)
        model = self.model.model
        model.rotary.begin_step()
        residual = model.embed_tokens(input_ids)
        run = self.segments.run
        for index, layer in enumerate(model.layers):
            qkv = run(segments.ATTN_IN.kind, index, (residual,))
            attention = self._attend(layer.self_attn, positions, qkv, metadata)
            residual = run(segments.ATTN_OUT_MLP.kind, index, (attention, residual))
        if metadata.logits_indices.numel() == 0:
            return None
        return residual.index_select(0, metadata.logits_indices)

    def _attend(
        self,
        attention: Any,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The batchless part of a layer: rotary, KV write, paged attention -> [T, q_size]."""
        q_size, kv_size = attention.q_size, attention.kv_size
        heads, head_dim = attention.num_heads, attention.head_dim
        # Query and key heads side by side (q/k norm already applied in the graph): one
        # rotary pass over both, in place, as models/llama.py does on CPU.
        both = qkv[:, : q_size + kv_size].view(-1, heads + attention.num_kv_heads, head_dim)
        kernels = attention.cpu_kernels
        if kernels is not None and kernels.supports(both):
            rotary = attention.rotary
            kernels.rotate_(both, positions, rotary.cos_cache, rotary.sin_cache)
        else:
            both = attention.rotary.rotate(positions, both)
        query, key = both[:, :heads], both[:, heads:]
        value = qkv[:, q_size + kv_size :].view(-1, attention.num_kv_heads, head_dim)
        out = self.backend.forward(
            query, key, value, attention.key_cache, attention.value_cache, metadata
        )
        return out.reshape(-1, q_size)


def _executor_factory(backend: str, device: torch.device) -> Any:
    """The backend's executor builder, after checking its libraries and the device."""
    module_name, _, function = SEGMENT_EXECUTORS[backend].partition(":")
    module = importlib.import_module(module_name)
    module.check_installed()
    module.check_device(device)
    return getattr(module, function)
