"""The CUDA fast path: Triton kernels bound to the engine's one Llama model, decode in CUDA graphs.

Not a second model: `CudaFastPath` takes a models/llama.LlamaForCausalLM (its weights already
fused: one QKV and one gate/up matrix per layer) and binds, per op, what runs on the GPU: the
Triton fused residual-add + RMSNorm and SwiGLU (`use_fused_ops`), each projection through the
Triton skinny matmul at the row counts where it measures faster than cuBLAS (TunedLinear), an
attention backend whose store kernel also rotates q/k (`fuses_rotary`), and the LM head the
same way. The model's own forward then runs those kernels, eagerly for prefill and mixed
steps, and, captured once per batch-size bucket, as one CUDA graph replay per greedy decode
step with the argmax on the GPU. Decode inputs are copied from pinned memory without a host
sync, so the host prepares step N+1 while step N runs and only reading the sampled tokens
waits; `sources` feeds a token the previous step sampled without the host reading it.
`reference()` unbinds all of it for a while, so checks can run the plain torch ops on the
same weights and KV cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as functional
from torch import nn

from services.common.errors import InvalidArgumentError
from services.engine.backends.base import AttentionBackend
from services.engine.backends.cuda_backend import CudaAttentionBackend
from services.engine.cuda_graph import BASE, DEFAULT_BUCKETS, DecodeCudaGraphs
from services.engine.kernels.triton.lora_epilogue import EpilogueSource
from services.engine.kernels.triton.rms_norm import rms_norm
from services.engine.kernels.triton.skinny_matmul import pick_fastest, skinny_matmul
from services.engine.kernels.triton.swiglu import swiglu
from services.engine.layers.attention_metadata import AttentionMetadata

# The model's projections by role: each role's matrices share one tuned choice per row count.
_ROLES = {"qkv_proj": "qkv", "o_proj": "output", "gate_up_proj": "gate_up", "down_proj": "down"}


class TritonOps:
    """The fused element-wise Triton kernels (layers/fused_ops.FusedOps) for CUDA tensors; each
    adds the LoRA delta awaiting its input, if any (`epilogues`, set with LoRA bound). SwiGLU
    also takes the deltas of a step of several adapters (`consumes`: lora/runtime.py)."""

    consumes = frozenset({"gate_up_proj"})

    def __init__(self) -> None:
        self.epilogues: EpilogueSource | None = None
        self.bound = False  # whether the model runs through these now (CudaFastPath._bind)

    def supports(self, x: torch.Tensor) -> bool:
        return x.is_cuda

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lora = None if self.epilogues is None else self.epilogues.take(x)
        return rms_norm(x, residual, weight, eps, lora=lora)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        lora = None if self.epilogues is None else self.epilogues.take(gate_up)
        return swiglu(gate_up, lora=lora)

    def warm(self, projection: str, y: torch.Tensor) -> None:
        """Run the kernel that reads `projection`'s output (lora/runtime.py: TileConsumer)."""
        if projection != "gate_up_proj":
            raise ValueError(f"no kernel here reads {projection}'s output")
        self.silu_mul(y)


class TunedLinear(nn.Module):
    """`x W^T (+ b)` that takes the Triton skinny matmul at the row counts tuned for it.

    Holds the replaced nn.Linear's own parameters (nothing is copied; state-dict names stay).
    """

    def __init__(self, linear: nn.Linear, role: str) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.role = role
        self.choices: dict[int, tuple] = {}  # row count -> skinny matmul configuration
        self.active = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with(x, self.weight)

    def forward_with(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x weightᵀ (+ b) the way this projection runs its own weight at x's row count (the
        LoRA runtime hands it its weight with an adapter's A below: lora/fused.py)."""
        config = self.choices.get(x.shape[0]) if self.active else None
        if config is None or self.bias is not None:
            return functional.linear(x, weight, self.bias)
        return skinny_matmul(x, weight, config)

    def plain_weight(self, rows: int) -> torch.Tensor | None:
        """The weight where `rows` rows take cuBLAS's plain x Wᵀ (no bias, no tuned choice):
        a caller may then add x Wᵀ onto an output of its own (LoRARuntime.project)."""
        tuned = self.active and rows in self.choices
        return None if tuned or self.bias is not None else self.weight


class CudaFastPath:
    """A LlamaForCausalLM on CUDA over its paged KV cache, with Triton kernels bound."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int = 16,
        max_blocks_per_seq: int = 512,
        graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        config = model.config
        self.model = model
        self.device = model.head_weight.device
        self.block_size = block_size
        self.num_blocks = kv_caches[0][0].shape[0]
        self.key_caches = [key for key, _ in kv_caches]
        self.value_caches = [value for _, value in kv_caches]
        self.attention = CudaAttentionBackend(
            config.num_heads, config.num_kv_heads, config.head_dim, config.head_dim**-0.5
        )
        rotary = model.model.rotary  # the model's own tables (rope scaling included), halved
        half = rotary.head_dim // 2
        self.cos = rotary.cos_cache[:, :half].float().contiguous()
        self.sin = rotary.sin_cache[:, :half].float().contiguous()
        self.attention.bind_rotary(self.cos, self.sin)
        self._plain_backends: list[AttentionBackend | None] = [
            layer.backend for layer in model.attention_layers
        ]
        self.linears = _tune_projections(model)
        self.head_choices: dict[int, tuple] = {}
        self.skinny_choices: dict[tuple[str, int], tuple] = {}
        self._static = _StaticDecodeBuffers(
            max(graph_buckets), max_blocks_per_seq, model.config.vocab_size, self.device
        )
        self.graphs = DecodeCudaGraphs(self._graph_step, graph_buckets)
        self.ops = TritonOps()
        # The projections whose output the kernel reading it next (norm, SwiGLU, the rotary
        # store) can add a written LoRA delta to (LoRADeltas: lora/runtime.py, side_deltas).
        self.delta_projections = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
        self._bind()

    # ---- binding --------------------------------------------------------------------------
    def _bind(self) -> None:
        model = self.model
        model.use_fused_ops(self.ops)
        for layer, key_cache, value_cache in zip(
            model.attention_layers, self.key_caches, self.value_caches, strict=True
        ):
            layer.backend, layer.key_cache, layer.value_cache = (
                self.attention,
                key_cache,
                value_cache,
            )
        for linear in self.linears:
            linear.active = True
        model.head_projection = self._head
        self.ops.bound = True

    def _unbind(self) -> None:
        model = self.model
        self.ops.bound = False
        model.use_fused_ops(None)
        for layer, backend in zip(model.attention_layers, self._plain_backends, strict=True):
            layer.backend = backend
        for linear in self.linears:
            linear.active = False
        model.head_projection = None

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The plain torch ops (and the runner's own attention backend) for the duration."""
        self._unbind()
        try:
            yield
        finally:
            self._bind()

    def bind_epilogues(self, source: EpilogueSource | None) -> None:
        """Let the norms, SwiGLU and the rotary KV store add the LoRA deltas `source` holds
        for their inputs (None: stop)."""
        self.ops.epilogues = source
        self.attention.epilogues = source

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        config = self.head_choices.get(hidden.shape[0])
        if config is None:
            return functional.linear(hidden, self.model.head_weight)
        return skinny_matmul(hidden, self.model.head_weight, config)

    def tune_skinny_matmuls(self, row_counts: tuple[int, ...] = (1, 2, 4, 8)) -> None:
        """Per projection role and small row count, use the Triton skinny matmul where it
        measures faster than cuBLAS over all layers' weights (call before capture_graphs)."""
        roles: dict[str, list[TunedLinear]] = {}
        for linear in self.linears:
            roles.setdefault(linear.role, []).append(linear)
        with torch.inference_mode():
            for role, linears in roles.items():
                for rows in row_counts:
                    config = pick_fastest([linear.weight.detach() for linear in linears], rows)
                    if config is not None:
                        self.skinny_choices[(role, rows)] = config
                        for linear in linears:
                            linear.choices[rows] = config
            for rows in row_counts:
                config = pick_fastest([self.model.head_weight.detach()], rows)
                if config is not None:
                    self.skinny_choices[("lm_head", rows)] = config
                    self.head_choices[rows] = config

    def skinny_choices_record(self) -> dict[str, list]:
        """The tuned choices as JSON-ready data ("role:rows" -> configuration), for the cache."""
        return {
            f"{role}:{rows}": list(config) for (role, rows), config in self.skinny_choices.items()
        }

    def apply_skinny_choices(self, record: dict[str, list], row_counts: tuple[int, ...]) -> bool:
        """Bind choices saved by `skinny_choices_record` (tuned on this GPU, shape, dtype and
        kernel code); False, binding nothing, when the record is malformed."""
        roles = {linear.role for linear in self.linears} | {"lm_head"}
        parsed: dict[tuple[str, int], tuple] = {}
        try:
            for name, config in record.items():
                role, _, rows = name.rpartition(":")
                if role not in roles or int(rows) not in row_counts or not config:
                    return False
                parsed[(role, int(rows))] = tuple(config)
        except (TypeError, ValueError, AttributeError):
            return False
        self.skinny_choices = parsed
        for linear in self.linears:
            linear.choices = {rows: c for (role, rows), c in parsed.items() if role == linear.role}
        self.head_choices = {rows: c for (role, rows), c in parsed.items() if role == "lm_head"}
        return True

    # ---- eager steps ----------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """float32 logits [len(metadata.logits_indices), vocab] for one flat step (the K/V of
        every token lands in the cache, rows that sample or not)."""
        hidden = self.model(input_ids, positions, metadata)
        rows = hidden.index_select(0, metadata.logits_indices)
        return self.model.compute_logits(rows).float()

    # ---- graph-captured greedy decode -----------------------------------------------------
    def capture_graphs(self, variant: str = BASE, max_size: int | None = None) -> None:
        with torch.inference_mode():
            self.graphs.capture(variant, max_size)

    def _graph_step(self, batch_size: int) -> None:
        buffers = self._static
        positions = buffers.positions[:batch_size]
        block_tables = buffers.block_tables[:batch_size]
        seq_lens = buffers.seq_lens[:batch_size]
        blocks = block_tables.gather(1, (positions // self.block_size)[:, None]).squeeze(1)
        slots = blocks.long() * self.block_size + positions % self.block_size
        buffers.slot_mapping[:batch_size] = torch.where(seq_lens > 0, slots, -1)
        metadata = AttentionMetadata(
            slot_mapping=buffers.slot_mapping[:batch_size],
            query_start_loc=buffers.query_start_loc[: batch_size + 1],
            seq_lens=seq_lens,
            context_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=1,
            max_seq_len=0,
            is_pure_decode=True,
            logits_indices=buffers.logits_indices[:batch_size],
            block_size=self.block_size,
        )
        hidden = self.model(buffers.input_ids[:batch_size], positions, metadata)
        logits = self.model.compute_logits(hidden).float()
        buffers.logits[:batch_size] = logits
        buffers.next_tokens[:batch_size] = logits.argmax(dim=-1)

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        sources: torch.Tensor | None = None,
        previous_ids: torch.Tensor | None = None,
        copies_done: torch.cuda.Event | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy decode step for n sequences: (logits [n, vocab], next tokens [n]) views.

        Inputs may be pinned host tensors (copied without a sync) or device tensors; each
        sequence's new token sits at `positions[i]`, its cache then holds positions[i] + 1.
        sources [n] (optional, int64): where >= 0, sequence i's token is previous_ids[sources[i]]
        (ids a step still running sampled: the host never read them) instead of input_ids[i].
        copies_done is recorded once the host inputs have been copied (the host may refill them
        after it completes). Views stay valid until the next decode call.
        """
        count = input_ids.shape[0]
        buffers = self._static
        bucket = self.graphs.bucket_for(count)
        if bucket is None:
            raise InvalidArgumentError(f"decode batch {count} exceeds the largest graph bucket")
        width = block_tables.shape[1]
        buffers.input_ids[:count].copy_(input_ids, non_blocking=True)
        buffers.positions[:count].copy_(positions, non_blocking=True)
        buffers.block_tables[:count, :width].copy_(block_tables, non_blocking=True)
        if sources is not None:
            buffers.sources[:count].copy_(sources, non_blocking=True)
        if copies_done is not None:
            copies_done.record()
        if sources is not None:
            if previous_ids is None:
                raise InvalidArgumentError("decode sources need the previous step's ids")
            source = buffers.sources[:count]
            fed = previous_ids[source.clamp(min=0)]
            buffers.input_ids[:count] = torch.where(source >= 0, fed, buffers.input_ids[:count])
        buffers.seq_lens[:count] = buffers.positions[:count].int() + 1
        # Zeroed on the device: assigning a Python number copies it from the host and waits
        # for the stream, i.e. for the step in flight.
        buffers.seq_lens[count:bucket].zero_()
        buffers.positions[count:bucket].zero_()
        self.graphs.replay(count)
        return buffers.logits[:count], buffers.next_tokens[:count]

    def decode_next(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next greedy step of the same `count` sequences, fed on the GPU from the previous
        step's sampled tokens (positions advance by one), so the host can enqueue it before it
        reads those tokens. Block tables must already cover the new positions."""
        buffers = self._static
        buffers.input_ids[:count].copy_(buffers.next_tokens[:count])
        buffers.positions[:count] += 1
        buffers.seq_lens[:count] += 1
        self.graphs.replay(count)
        return buffers.logits[:count], buffers.next_tokens[:count]

    # ---- sizes ----------------------------------------------------------------------------
    def decode_bytes(self) -> int:
        """Bytes a decode step must read: every weight except the embedding table (one row)."""
        embed = self.model.model.embed_tokens.weight
        total = 0
        for parameter in self.model.parameters():
            if parameter is not embed:
                total += parameter.numel() * parameter.element_size()
        if self.model.lm_head is None:  # tied: the table is read whole as the LM head
            total += embed.numel() * embed.element_size()
        return total

    def parameter_bytes(self) -> int:
        """Bytes of every parameter, the embedding table included (a tied head counts once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def _tune_projections(model: nn.Module) -> list[TunedLinear]:
    """Swap the model's projection nn.Linears for TunedLinear (same parameters) in place."""
    tuned = []
    for name, module in list(model.named_modules()):
        role = _ROLES.get(name.rpartition(".")[2])
        if role is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(getattr(module, "inner", None), nn.Module):
            # A tensor-parallel RowParallel (parallel/weights.py): tune its projection, keep
            # its all-reduce.
            parent, child, module = module, "inner", module.inner
        if isinstance(module, TunedLinear):
            tuned.append(module)
            continue
        if type(module) is not nn.Linear:
            raise InvalidArgumentError(f"{name} is a {type(module).__name__}, not a projection")
        replacement = TunedLinear(module, role)
        setattr(parent, child, replacement)
        tuned.append(replacement)
    return tuned


class _StaticDecodeBuffers:
    """The fixed tensors captured decode graphs read and write."""

    def __init__(self, max_batch: int, max_blocks: int, vocab_size: int, device) -> None:
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.long, device=device)
        self.logits = torch.zeros((max_batch, vocab_size), dtype=torch.float32, device=device)
        self.next_tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.sources = torch.full((max_batch,), -1, dtype=torch.long, device=device)


def prefill_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) for a flat step: sequence i computes query_lens[i] tokens after
    context_lens[i] cached ones, its KV blocks listed in block_tables[i]."""
    positions, slots, starts, logits_rows = [], [], [0], []
    for query_len, context_len, table in zip(query_lens, context_lens, block_tables, strict=True):
        for position in range(context_len, context_len + query_len):
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
        starts.append(starts[-1] + query_len)
        logits_rows.append(starts[-1] - 1)
    width = max(len(table) for table in block_tables)
    padded = [table + [0] * (width - len(table)) for table in block_tables]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = AttentionMetadata(
        slot_mapping=tensor(slots, torch.long),
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        context_lens=tensor(context_lens, torch.int32),
        block_tables=tensor(padded, torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        is_pure_decode=all(q == 1 for q in query_lens) and all(c > 0 for c in context_lens),
        logits_indices=tensor(logits_rows, torch.long),
        block_size=block_size,
    )
    return tensor(positions, torch.long), metadata
