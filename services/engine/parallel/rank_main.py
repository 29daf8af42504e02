"""Ranks 1..N-1 of a tensor-parallel engine: build this rank's model, then run rank 0's steps.

Started by launch.py with the engine config as JSON. The rank holds its shard of the weights
and of the KV cache, receives each step's inputs from rank 0 (group.py) and runs the same
forward, meeting rank 0 at every all-reduce; it samples nothing. It leaves when rank 0 says
stop, and exits at once when its parent (rank 0's process) is gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch

from services.common.errors import FailedPreconditionError
from services.common.heap import freeze_startup_heap
from services.common.model_files import resolve_model
from services.engine.config import EngineConfig
from services.engine.model_runner import BaseModelRunner
from services.engine.parallel.channel import StepChannel
from services.engine.parallel.group import DecodeMessage, TensorParallelGroup, TensorParallelRank
from services.engine.parallel.launch import build_rank_runner, rank_device

logger = logging.getLogger("services.engine.parallel.rank")
PARENT_CHECK_S = 1.0


@torch.inference_mode()
def serve_steps(runner: BaseModelRunner, tensor_parallel: TensorParallelRank) -> int:
    """Run rank 0's steps until it says stop, each as rank 0 runs it; how many ran.

    With the CUDA fast path (rank 0 has it too: same config), eager steps run its kernels and
    decode steps replay its graphs; the sampled ids of the last step stay on the GPU, as on
    rank 0, for decode tokens that rank 0 feeds from them.
    """
    fast = getattr(runner, "fast", None)
    previous_ids: torch.Tensor | None = None
    steps = 0
    while (message := tensor_parallel.receive()) is not None:
        if isinstance(message, DecodeMessage):
            if fast is None:
                raise FailedPreconditionError("a graph decode step reached a rank without graphs")
            _, previous_ids = fast.decode(
                message.input_ids,
                message.positions,
                message.block_tables,
                sources=message.sources,
                previous_ids=previous_ids,
            )
        elif fast is not None:
            logits = fast.forward(message.input_ids, message.positions, message.metadata)
            previous_ids = logits.argmax(dim=-1)
        else:
            runner.backend.prepare(message.metadata)
            hidden = runner.model(message.input_ids, message.positions, message.metadata)
            rows = message.metadata.logits_indices
            if rows.numel():  # rank 0 joins its logits with this rank's vocabulary slice
                runner.model.compute_logits(hidden.index_select(0, rows))
        steps += 1
    return steps


def exit_with_parent(parent_pid: int) -> None:
    """Leave at once when the parent process is gone (rank 0 killed: no stop will come)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(PARENT_CHECK_S)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--step-channel", required=True, help="rank 0's StepChannel file")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--engine-config", required=True, help="EngineConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"rank {args.rank} %(levelname)s %(message)s")
    exit_with_parent(args.parent_pid)
    config = EngineConfig(**json.loads(args.engine_config))
    files = resolve_model(config.model)
    channel = StepChannel.attach(Path(args.step_channel), args.rank, args.world_size - 1)
    group = TensorParallelGroup(
        rank=args.rank,
        world_size=args.world_size,
        init_method=args.init_method,
        device=torch.device(rank_device(config, args.rank)),
    )
    tensor_parallel = TensorParallelRank(
        group,
        channel,
        custom_all_reduce=config.custom_all_reduce,
        fuse_sum_norm=config.fuse_sum_norm,
    )
    runner = build_rank_runner(config, files, tensor_parallel)
    freeze_startup_heap()  # the model and imports: never walked by a collection again
    steps = serve_steps(runner, tensor_parallel)
    logger.info("stopped after %d steps", steps)
    tensor_parallel.close()  # leaves the group with rank 0
    logging.shutdown()
    # No interpreter teardown: the collective library's threads can abort a normal exit.
    os._exit(0)


if __name__ == "__main__":
    main()
