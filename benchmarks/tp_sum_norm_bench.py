"""Tensor-parallel decode sums on 2+ GPUs: the fused sum + residual add + RMSNorm kernel
against an all-reduce followed by the fused add + norm kernel (one-shot over symmetric memory,
and NCCL), in the same run.

One process per GPU. Each case captures CALLS sums (turns alternating, as a forward's do) in a
CUDA graph and replays it; the figure is the median replay time over the calls, on rank 0.
The fused results are checked against the all-reduce + norm path (the same bits).

    python -m benchmarks.tp_sum_norm_bench --out tp-sum-norm.json   # NVLink multicast off
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

CALLS = 64  # sums per graph: one decode step of a 32-layer model
REPLAYS = 50
WARPS = (2, 4, 8)
CASES = [(4096, 1), (4096, 8), (4096, 64), (8192, 1), (8192, 64)]  # (hidden size, rows)


def run_rank(rank: int, world_size: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from services.engine.parallel import sum_norm, symmetric

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    control = dist.new_group(backend="gloo")

    def agree(value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=control)
        return int(tensor.item())

    dtype = torch.bfloat16
    group_name = dist.group.WORLD.group_name
    report: dict[str, Any] = {"cases": []}
    one_shot, why = symmetric.enable(
        group_name=group_name,
        rank=rank,
        world_size=world_size,
        device=device,
        dtype=dtype,
        agree=agree,
        max_bytes=2 << 20,
    )
    report["one_shot_off_reason"] = why
    for hidden, rows in CASES:
        fused, why = sum_norm.enable(
            group_name=group_name,
            rank=rank,
            world_size=world_size,
            device=device,
            dtype=dtype,
            hidden_size=hidden,
            agree=agree,
        )
        case = run_case(rank, hidden, rows, one_shot, fused, device)
        case["fused_off_reason"] = why
        report["cases"].append(case)
        if rank == 0:
            print(json.dumps(case), flush=True)
        fused = None
        torch.cuda.synchronize(device)
        agree(1)
    if rank == 0:
        report.update(
            device=f"{world_size} x {torch.cuda.get_device_name(device)}",
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            command="python -m benchmarks.tp_sum_norm_bench " + " ".join(sys.argv[1:]),
            software={"torch": torch.__version__},
            calls_per_graph=CALLS,
            replays=REPLAYS,
        )
        Path(out).write_text(json.dumps(report, indent=1))
    one_shot = None
    torch.cuda.synchronize(device)
    agree(1)
    dist.destroy_process_group()


def run_case(rank: int, hidden: int, rows: int, one_shot, fused, device) -> dict[str, Any]:
    """Time each path of summing rows x hidden over the ranks and normalizing."""
    import torch
    import torch.distributed as dist

    from services.engine.kernels.triton.rms_norm import rms_norm

    dtype, eps = torch.bfloat16, 1e-5
    case: dict[str, Any] = {"hidden_size": hidden, "rows": rows}
    x = torch.randn((rows, hidden), generator=torch.Generator().manual_seed(rank))
    x = x.to(device, dtype)
    residual = torch.randn((rows, hidden), generator=torch.Generator().manual_seed(9))
    residual = residual.to(device, dtype)
    weight = torch.rand(hidden, generator=torch.Generator().manual_seed(3)).to(device, dtype)

    def nccl_then_norm(turn: int) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x.clone()
        dist.all_reduce(summed)
        return rms_norm(summed, residual, weight, eps)

    def one_shot_then_norm(turn: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(one_shot(x, turn), residual, weight, eps)

    def fused_call(turn: int) -> tuple[torch.Tensor, torch.Tensor]:
        return fused(x, residual, weight, eps, turn)

    def fused_with(warps: int):
        from services.engine.kernels.triton.sum_norm import sum_norm

        def call(turn: int) -> tuple[torch.Tensor, torch.Tensor]:
            return sum_norm(
                x, residual, weight, eps, data_ptrs=fused.data_ptrs, rank=fused.rank,
                world_size=fused.world_size, turn=turn, max_rows=fused.max_rows,
                num_warps=warps,
            )  # fmt: skip

        return call

    paths = {"nccl_then_norm": nccl_then_norm}
    if one_shot is not None:
        paths["one_shot_then_norm"] = one_shot_then_norm
    if fused is not None:
        paths["fused"] = fused_call
        for warps in WARPS:  # the same kernel at other widths (the default: BLOCK / 256, <= 16)
            paths[f"fused_{warps}_warps"] = fused_with(warps)
    results = {}
    for name, call in paths.items():
        case[f"{name}_us"], results[name] = time_path(call, device)
    if "fused" in results:
        normed, summed = results["fused"]
        want_normed, want_summed = results["nccl_then_norm"]
        case["fused_equals_all_reduce_then_norm"] = bool(
            torch.equal(summed, want_summed) and torch.equal(normed, want_normed)
        )
        for base in ("nccl_then_norm", "one_shot_then_norm"):
            if f"{base}_us" in case:
                case[f"fused_over_{base}"] = round(case["fused_us"] / case[f"{base}_us"], 3)
    return case


def time_path(
    call, device, calls: int = CALLS, replays: int = REPLAYS, turns: int = 2
) -> tuple[float, Any]:
    """Median microseconds per call over `replays` replays of a CUDA graph of `calls` calls
    (`call(turn)`, turns 0 to `turns` - 1 in a cycle), and the last call's result."""
    import torch

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for turn in range(min(turns, 2)):  # warm (and compile) on the capture stream
            call(turn)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(calls):
            result = call(index % turns)
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return round(statistics.median(times), 2), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tp-sum-norm.json", help="JSON report path")
    parser.add_argument("--gpus", type=int, default=2, help="ranks, one per GPU")
    args = parser.parse_args()
    for name, value in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ[name] = value  # NVLink multicast stays off, in every rank
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.start_processes(
        _entry, args=(args.gpus, port, args.out), nprocs=args.gpus, start_method="spawn"
    )
    print(Path(args.out).read_text())


def _entry(rank: int, world_size: int, port: int, out: str) -> None:
    run_rank(rank, world_size, port, out)


if __name__ == "__main__":
    main()
