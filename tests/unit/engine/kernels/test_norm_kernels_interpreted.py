"""The fused norm kernels on a CPU, run by Triton's interpreter (float32).

`rms_norm` against PyTorch; `sum_norm` (the tensor-parallel sum + residual add + RMSNorm) with
two ranks as two processes, each rank's receive buffer in a shared memory file that both map
(each at its own address, as peers' GPU memory is mapped over NVLink): a run of calls
alternating turns with different row counts gives every rank the rank-order sum, added and
normed, and leaves every receive slot empty (-0.0). The interpreter has no bfloat16, CUDA graphs
or GPUs; the GPU runs are tests/gpu/test_tensor_parallel.py and benchmarks/tp_sum_norm_bench.py.
`TRITON_INTERPRET` is read when a kernel module is imported, so the checks run in children.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="scripts/setup.sh installs Triton for these checks")

ROOT = Path(__file__).resolve().parents[4]
RMS_NORM = """
import torch
from services.engine.kernels.triton.rms_norm import rms_norm
torch.manual_seed(0)
hidden, eps = 48, 1e-5
weight = torch.rand(hidden)
for rows, has_residual in ((1, True), (5, False), (3, True)):
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    normed, summed = rms_norm(x, residual if has_residual else None, weight, eps)
    want = x + residual if has_residual else x
    assert torch.equal(summed, want)
    want_normed = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + eps) * weight
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
print("ok", flush=True)
"""
SUM_NORM = """
import sys, torch
from services.engine.kernels.triton.sum_norm import empty_mark, sum_norm
rank, world, folder = int(sys.argv[1]), 2, sys.argv[2]
hidden, eps, max_rows = 48, 1e-5, 4
size = 2 * world * max_rows * hidden
buffers = [torch.from_file(f"{folder}/rank{r}", shared=True, size=size) for r in range(world)]
table = torch.tensor([buffer.data_ptr() for buffer in buffers], dtype=torch.int64)
generator = torch.Generator().manual_seed(0)  # every rank draws every rank's rows alike
weight = torch.rand(hidden, generator=generator)
for turn, rows in enumerate((1, 1, 3, 3, 4, 4, 2, 2)):
    parts = [torch.randn(rows, hidden, generator=generator) for _ in range(world)]
    parts[0][0, 0], parts[1][0, 1] = 0.0, -0.0  # sent as +0.0, the same value
    residual = torch.randn(rows, hidden, generator=generator)
    normed, summed = sum_norm(parts[rank], residual, weight, eps, data_ptrs=table, rank=rank,
                              world_size=world, turn=turn % 2, max_rows=max_rows)
    want = parts[0] + parts[1] + residual
    assert torch.equal(summed, want), turn
    want_normed = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + eps) * weight
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
empty = buffers[rank].view(torch.int32) == empty_mark(torch.float32)
assert bool(empty.all()), "a receive slot left full"
print("ok", flush=True)
"""


def run_children(children: list[list[str]], timeout_s: float = 240) -> list[str]:
    """Run each `[code, *args]` in a Python child with the interpreter on, side by side; the
    children's stdout (a child that fails or hangs fails the test)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", *child],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for child in children
    ]
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout_s)
            assert process.returncode == 0, stdout + stderr[-4000:]
            outputs.append(stdout)
    finally:
        for process in processes:
            process.kill()
    return outputs


def test_rms_norm_in_the_interpreter() -> None:
    assert run_children([[RMS_NORM]]) == ["ok\n"]


def test_two_ranks_sum_and_norm_through_each_others_buffers(tmp_path: Path) -> None:
    size = 2 * 2 * 4 * 48  # turns x ranks x rows x hidden, as the children lay them out
    for rank in range(2):  # every slot empty: -0.0 in float32
        (tmp_path / f"rank{rank}").write_bytes(b"\x00\x00\x00\x80" * size)
    outputs = run_children([[SUM_NORM, str(rank), str(tmp_path)] for rank in range(2)])
    assert outputs == ["ok\n", "ok\n"]
