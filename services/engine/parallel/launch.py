"""Start a tensor-parallel engine worker group: rank 0 here, ranks 1..N-1 as child processes.

`sluice serve engine --tensor-parallel-size N` builds its model runner through
`create_parallel_runner`: it checks that the model's shape splits N ways, starts N-1 rank
processes (`python -m services.engine.parallel.rank_main`, the engine config passed as JSON
on the command line), joins the group as rank 0 and builds its own runner, which keeps the
scheduler and the block manager of the whole group. With a CUDA device, rank r uses GPU
base + r of the GPUs this process sees (base: the N of `cuda:N`, else 0); on CPU the ranks
talk over gloo. On CUDA every rank builds the same fast path and captures the same decode
graphs, the all-reduces inside them.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading

import torch

from services.common.errors import InvalidArgumentError
from services.common.model_files import ModelFiles
from services.engine.config import EngineConfig
from services.engine.model_runner import BaseModelRunner, load_model_config, runner_arguments
from services.engine.parallel import guard
from services.engine.parallel.channel import StepChannel
from services.engine.parallel.group import TensorParallelGroup, TensorParallelRank
from services.engine.parallel.sharding import check_divisible

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS) stays off in every rank, also where a rank starts with its own
# environment: a fault in it can take every GPU of a shared host out of service for a long
# time, and a ring or tree all-reduce over 2-8 GPUs does not need it.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
RANK_CHECK_S = 1.0


def rank_device(config: EngineConfig, rank: int) -> str:
    """The device of `rank`: GPU base + rank on CUDA, the CPU otherwise."""
    device = config.resolved_device()
    if not device.startswith("cuda"):
        return "cpu"
    base = int(device.partition(":")[2] or 0)
    if torch.cuda.is_available() and base + rank >= torch.cuda.device_count():
        raise InvalidArgumentError(
            f"tensor_parallel_size {config.tensor_parallel_size} from {device} needs GPU "
            f"{base + rank}, but {torch.cuda.device_count()} are visible"
        )
    return f"cuda:{base + rank}"


def build_rank_runner(
    config: EngineConfig, model_files: ModelFiles, tensor_parallel: TensorParallelRank
) -> BaseModelRunner:
    """The model runner of one rank (rank 0's also serves the engine)."""
    arguments = runner_arguments(config)
    arguments["device"] = rank_device(config, tensor_parallel.rank)
    if arguments["device"] == "cpu":
        from services.engine.cpu_runner import CpuModelRunner

        return CpuModelRunner(
            model_files,
            cpu_kernels=config.cpu_kernels,
            tensor_parallel=tensor_parallel,
            **arguments,
        )
    from services.engine.cuda_runner import CudaModelRunner

    return CudaModelRunner(
        model_files,
        max_num_seqs=config.max_num_seqs,
        tensor_parallel=tensor_parallel,
        **arguments,
    )


def create_parallel_runner(config: EngineConfig, model_files: ModelFiles) -> BaseModelRunner:
    """Start ranks 1..N-1, join the group as rank 0 and return rank 0's model runner."""
    world_size = config.tensor_parallel_size
    full = load_model_config(model_files, config.max_model_len)
    check_divisible(full.num_heads, full.num_kv_heads, full.intermediate_size, world_size)
    for rank in range(world_size):
        rank_device(config, rank)  # refuse too few GPUs before starting anything
    os.environ.update(NO_MULTICAST_ENV)  # this process is rank 0
    init_method = f"tcp://127.0.0.1:{free_port()}"
    encoded = json.dumps(dataclasses.asdict(config))
    environment = {**os.environ, **NO_MULTICAST_ENV}
    channel = StepChannel.create(readers=world_size - 1)
    followers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.engine.parallel.rank_main",
                f"--rank={rank}",
                f"--world-size={world_size}",
                f"--init-method={init_method}",
                f"--step-channel={channel.path}",
                f"--parent-pid={os.getpid()}",
                f"--engine-config={encoded}",
            ],
            env=environment,
        )
        for rank in range(1, world_size)
    ]
    stopping = threading.Event()
    exit_when_a_rank_dies(followers, stopping)
    try:
        group = TensorParallelGroup(
            rank=0,
            world_size=world_size,
            init_method=init_method,
            device=torch.device(rank_device(config, 0)),
        )
        channel.unlink()  # every rank has mapped it before joining the group
        tensor_parallel = TensorParallelRank(
            group,
            channel,
            stopping=stopping,
            custom_all_reduce=config.custom_all_reduce,
            fuse_sum_norm=config.fuse_sum_norm,
        )
        tensor_parallel.followers = followers
        runner = build_rank_runner(config, model_files, tensor_parallel)
    except BaseException:
        stopping.set()
        channel.unlink()
        for process in followers:
            process.kill()
        raise
    atexit.register(tensor_parallel.close)
    path = getattr(runner, "execution_path", "") or f"{config.backend} ops"
    runner.execution_path = (
        f"{path}, tensor parallel over {world_size} ranks ({tensor_parallel.all_reduce_path})"
    )
    logger.info("tensor parallel: %d ranks, init %s", world_size, init_method)
    return runner


def exit_when_a_rank_dies(
    followers: list[subprocess.Popen], stopping: threading.Event
) -> threading.Thread:
    """End this process (rank 0) at once when another rank's process ends unasked.

    The group cannot step without every rank (NCCL would wait for the lost one until the
    collective timeout); exiting lets the engine's supervisor restart the whole group.
    """

    def watch() -> None:
        while not stopping.wait(RANK_CHECK_S):
            for process in followers:
                if process.poll() is not None and not stopping.is_set():
                    logger.error(
                        "tensor-parallel rank process %d ended (exit %s): stopping the engine",
                        process.pid,
                        process.returncode,
                    )
                    guard.leave_process(1)

    thread = threading.Thread(target=watch, name="rank-watch", daemon=True)
    thread.start()
    return thread


def free_port() -> int:
    """A TCP port free on the loopback now (for the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
