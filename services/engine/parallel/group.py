"""The process group of one tensor-parallel engine, and each step's inputs sent to its ranks.

`TensorParallelGroup` wraps torch.distributed: NCCL between GPUs, gloo between CPU processes
(where the tests run TP=2), plus a gloo group for the few host-side agreements (KV block count,
whether every rank can use the one-shot all-reduce). `TensorParallelRank` is what a model runner
holds: its shard layout, its model builder, its all-reduce, and the step transfer.

Rank 0 owns the scheduler and the block manager; before each forward it puts the step's flat
inputs (token ids, positions, KV slots, lengths, block tables) into the group's StepChannel
(shared host memory, channel.py) as one int64 message: a fixed header of sizes, then the
payload. Rank 0 never waits for its GPU to send a step (graph decode inputs are already in
pinned host memory), and the collectives carry only the activations' sums.
No pickle, no Python objects: ranks 1..N-1 rebuild the same AttentionMetadata from the numbers
and run the same forward, so every all-reduce meets its peers in the same order. A CUDA-graph
decode step (the CUDA fast path, its graphs captured with the all-reduces inside on every rank)
sends only token ids, positions, block tables and, where a token is the previous step's
sampled id still on the GPU, its source row: every rank replays the same graph.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from services.common.errors import FailedPreconditionError
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.models.config import ModelConfig
from services.engine.parallel import sum_norm, symmetric
from services.engine.parallel.channel import StepChannel
from services.engine.parallel.sharding import ShardLayout
from services.engine.parallel.sum_norm import FusedSumNorm
from services.engine.parallel.symmetric import SymmetricAllReduce
from services.engine.parallel.weights import (
    build_sharded_model,
    defer_row_sums,
    local_model_config,
    shard_layout,
    shard_lm_head,
)

logger = logging.getLogger(__name__)

# Header: opcode, tokens, sequences, block-table width, max query len, max seq len, pure decode,
# logits rows, block size.
HEADER_SIZE = 9
OP_STOP, OP_STEP, OP_DECODE = 0, 1, 2
DEFAULT_TIMEOUT_S = 600.0
RANK_STOP_TIMEOUT_S = 30.0
LEAVE_TIMEOUT_S = 10.0


def backend_for(device: torch.device) -> str:
    """The collective library for `device`: NCCL on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


class TensorParallelGroup:
    """One rank's membership of the group: the default torch.distributed group for the
    all-reduces (NCCL or gloo) and a gloo group for host tensors (steps, block counts)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        init_method: str,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend_for(device),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on each), stacked in rank order."""
        out = torch.empty(
            (self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device
        )
        if tensor.device.type == "cuda":
            dist.all_gather_into_tensor(out, tensor)
        else:  # gloo gathers into a list
            dist.all_gather(list(out.unbind(0)), tensor)
        return out

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def close(self) -> None:
        """Leave the group; every rank does, at the same time (rank 0 after telling the others
        to stop). Bounded: a library that still blocks is left behind with a warning."""
        if not dist.is_initialized():
            return
        thread = threading.Thread(target=dist.destroy_process_group, name="leave", daemon=True)
        thread.start()
        thread.join(LEAVE_TIMEOUT_S)
        if thread.is_alive():
            logger.warning("tensor-parallel group not left after %.0f s", LEAVE_TIMEOUT_S)


class RankInputSum:
    """A norm's unsummed input on one rank (layers/norm.py InputSum): `turn` is that of the
    projection whose sum it finishes."""

    def __init__(self, rank: TensorParallelRank, turn: int) -> None:
        self.rank = rank
        self.turn = turn

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.rank.all_reduce(x, self.turn)

    def sum_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.rank.fused_sum_norm(x, residual, weight, eps, self.turn)


@dataclass
class StepMessage:
    """One flat step: what BaseModelRunner's forward takes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata


@dataclass
class DecodeMessage:
    """One CUDA-graph decode step: what CudaFastPath.decode takes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    sources: torch.Tensor | None


class TensorParallelRank:
    """What a model runner of one rank needs: its layout, model, and the step transfer."""

    def __init__(
        self,
        group: TensorParallelGroup,
        channel: StepChannel,
        *,
        stopping: threading.Event | None = None,
        custom_all_reduce: bool = True,
        fuse_sum_norm: bool = True,
    ) -> None:
        self.group = group
        self.channel = channel
        # Small sums over CUDA symmetric memory (parallel/symmetric.py) where every rank can.
        self.want_custom_all_reduce = custom_all_reduce
        self.custom: SymmetricAllReduce | None = None
        self.custom_off_reason: str | None = "not set up"
        # Decode sums fused with the norm that reads them (parallel/sum_norm.py).
        self.want_fused_sum_norm = custom_all_reduce and fuse_sum_norm
        self.fused: FusedSumNorm | None = None
        self.fused_off_reason: str | None = "not set up"
        # Set when rank 0 stops the group: its rank processes may end from then on.
        self.stopping = stopping or threading.Event()
        self.rank = group.rank
        self.world_size = group.world_size
        self.layout: ShardLayout | None = None
        self.followers: list[subprocess.Popen] = []  # the rank processes rank 0 started
        # Run before leaving the group: a communicator cannot be torn down while CUDA graphs
        # captured with its collectives are alive (the runner drops its decode graphs here).
        self.before_leaving: list[Callable[[], None]] = []

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """This rank's model shape (refuses a size the model cannot be split by)."""
        self.layout = shard_layout(config, self.world_size, self.rank)
        return local_model_config(config, self.layout)

    def build_model(
        self,
        config: ModelConfig,
        *,
        weights_dir: Path | None,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
    ) -> nn.Module:
        """This rank's model of the full model `config`, its row-parallel sums on the group."""
        self.layout = shard_layout(config, self.world_size, self.rank)
        model = build_sharded_model(
            config,
            self.layout,
            weights_dir=weights_dir,
            device=device,
            dtype=dtype,
            seed=seed,
            all_reduce=self.all_reduce,
        )
        shard_lm_head(model, self.layout, self.group.all_gather)
        defer_row_sums(model, lambda turn: RankInputSum(self, turn))
        if device.type == "cuda":
            self.enable_custom_all_reduce(dtype)
            self.enable_fused_sum_norm(dtype, config.hidden_size)
        return model

    def enable_custom_all_reduce(self, dtype: torch.dtype) -> None:
        """Set up the one-shot all-reduce on every rank, or leave the sums on the group's
        library (NCCL) with the reason; collective, every rank after building its model."""
        if not self.want_custom_all_reduce:
            self.custom, self.custom_off_reason = None, "turned off"
            return
        self.custom, self.custom_off_reason = symmetric.enable(
            group_name=dist.group.WORLD.group_name,
            rank=self.rank,
            world_size=self.world_size,
            device=self.group.device,
            dtype=dtype,
            agree=self.group.min_int,
        )
        if self.custom_off_reason is not None:
            logger.warning("tensor parallel: all-reduces on NCCL (%s)", self.custom_off_reason)

    def enable_fused_sum_norm(self, dtype: torch.dtype, hidden_size: int) -> None:
        """Set up the decode sums fused with their norms on every rank, or leave them on the
        all-reduce with the reason; collective, every rank after building its model."""
        if not self.want_fused_sum_norm:
            self.fused, self.fused_off_reason = None, "turned off"
            return
        self.fused, self.fused_off_reason = sum_norm.enable(
            group_name=dist.group.WORLD.group_name,
            rank=self.rank,
            world_size=self.world_size,
            device=self.group.device,
            dtype=dtype,
            hidden_size=hidden_size,
            agree=self.group.min_int,
        )
        if self.fused_off_reason is not None:
            logger.warning("tensor parallel: decode sums not fused (%s)", self.fused_off_reason)

    @property
    def all_reduce_path(self) -> str:
        """How the row-parallel sums run, in words."""
        fused = ""
        if self.fused is not None:
            fused = (
                f"sums of up to {self.fused.max_rows} rows fused with the residual add and "
                "RMSNorm (peer-to-peer stores), "
            )
        if self.custom is not None:
            limit = self.custom.max_bytes >> 10
            return f"{fused}one-shot all-reduce over symmetric memory up to {limit} KiB, NCCL above"
        return f"{fused}{backend_for(self.group.device)} all-reduce"

    def all_reduce(self, tensor: torch.Tensor, turn: int = 0) -> torch.Tensor:
        """The sum of `tensor` over the ranks (RowParallel's; `turn`: see there)."""
        custom = self.custom
        if custom is not None and custom.fits(tensor):
            return custom(tensor, turn)
        return self.group.all_reduce(tensor)

    def fused_sum_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        turn: int,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sum of `x` over the ranks, the residual add and the norm in one kernel; None
        where it is not set up or `x` does not fit."""
        fused = self.fused
        if fused is None or not fused.fits(x):
            return None
        return fused(x, residual, weight, eps, turn)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV block count every rank can hold (rank 0's block manager uses this many)."""
        return self.group.min_int(num_blocks)

    # ---- the step transfer ----------------------------------------------------------------
    def send_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Rank 0: give the other ranks this step's inputs (before its forward)."""
        tables = metadata.block_tables
        header = [
            OP_STEP,
            input_ids.numel(),
            tables.shape[0],
            tables.shape[1],
            metadata.max_query_len,
            metadata.max_seq_len,
            int(metadata.is_pure_decode),
            metadata.logits_indices.numel(),
            metadata.block_size,
        ]
        parts = (
            input_ids,
            positions,
            metadata.slot_mapping,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.context_lens,
            metadata.logits_indices,
            tables.reshape(-1),
        )
        self.channel.put(_message(header, parts))

    def send_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        sources: torch.Tensor | None,
    ) -> None:
        """Rank 0: give the other ranks one graph decode step's inputs (before its replay)."""
        count, width = block_tables.shape
        header = [OP_DECODE, count, width, int(sources is not None), 0, 0, 0, 0, 0]
        parts = [input_ids, positions, block_tables.reshape(-1)]
        if sources is not None:
            parts.append(sources)
        self.channel.put(_message(header, parts))

    def send_stop(self) -> None:
        """Rank 0: tell the other ranks to leave their step loop."""
        header = [OP_STOP] + [0] * (HEADER_SIZE - 1)
        self.channel.put(np.asarray(header, dtype=np.int64))

    def receive(self) -> StepMessage | DecodeMessage | None:
        """Ranks 1..N-1: the next step from rank 0, or None when told to stop."""
        message = torch.from_numpy(self.channel.get())
        header = message[:HEADER_SIZE].tolist()
        payload = message[HEADER_SIZE:]
        if header[0] == OP_STOP:
            return None
        if header[0] == OP_DECODE:
            return self._receive_decode(header, payload)
        return self._receive_step(header, payload)

    def _receive_decode(self, header: list[int], payload: torch.Tensor) -> DecodeMessage:
        _, count, width, has_sources = header[:4]
        sizes = [count, count, count * width] + ([count] if has_sources else [])
        parts = payload.split(sizes)  # host tensors: CudaFastPath.decode copies them over
        return DecodeMessage(
            input_ids=parts[0],
            positions=parts[1],
            block_tables=parts[2].to(torch.int32).view(count, width),
            sources=parts[3] if has_sources else None,
        )

    def _receive_step(self, header: list[int], payload: torch.Tensor) -> StepMessage:
        _, tokens, seqs, width, max_query, max_seq, pure_decode, logits, block_size = header
        sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs, logits, seqs * width]
        host = payload.split(sizes)
        starts_host, seq_lens_host, context_lens_host = (host[i].tolist() for i in (3, 4, 5))
        parts = payload.to(self.group.device).split(sizes)
        ids, positions, slots, starts, seq_lens, context_lens, rows, tables = parts
        int32 = torch.int32
        metadata = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts.to(int32),
            seq_lens=seq_lens.to(int32),
            context_lens=context_lens.to(int32),
            block_tables=tables.to(int32).view(seqs, width),
            max_query_len=max_query,
            max_seq_len=max_seq,
            is_pure_decode=bool(pure_decode),
            logits_indices=rows,
            block_size=block_size,
            query_start_loc_host=starts_host,
            seq_lens_host=seq_lens_host,
            context_lens_host=context_lens_host,
        )
        return StepMessage(ids, positions, metadata)

    def close(self) -> None:
        """Rank 0: stop the other ranks, leave the group with them, wait for their processes.
        Ranks 1..N-1 (after the stop): leave the group."""
        self.stopping.set()
        if self.rank == 0 and self.followers:
            try:
                self.send_stop()
            except FailedPreconditionError as exc:  # a rank gone: its process is reaped below
                logger.warning("tensor-parallel ranks not told to stop: %s", exc)
        for release in self.before_leaving:
            release()
        self.before_leaving = []
        if self.group.device.type == "cuda":
            torch.cuda.synchronize(self.group.device)
        # The symmetric buffers go before the group they were mapped over.
        self.custom = self.fused = None
        self.group.close()
        for process in self.followers:
            try:
                process.wait(timeout=RANK_STOP_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a rank that does not leave is killed
                process.kill()
        self.followers = []
        self.channel.close()


def _message(header: list[int], parts: Iterable[torch.Tensor]) -> np.ndarray:
    """The header and `parts` (device parts are copied to the host) as one int64 array."""
    host = [part.to(device="cpu", dtype=torch.int64).reshape(-1).numpy() for part in parts]
    return np.concatenate([np.asarray(header, dtype=np.int64), *host])
