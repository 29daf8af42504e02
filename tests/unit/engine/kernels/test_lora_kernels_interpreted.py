"""The LoRA shrink/expand Triton kernels on a CPU, run by Triton's interpreter (float32).

The same checks as tests/gpu/test_lora_kernels.py (the kernels against the per-segment torch
path; base rows untouched bit for bit) on the tiny and a wider shape: adapters of different
ranks and target modules, one adapter for every row, runs of adapters among base rows, split K
with the alternating shrink buffers (the splits summed in split order through the workspace),
long runs through cuBLAS beside the kernels, a plain base matmul adding onto deltas written
first (the kernels' too, or added after it), a step narrower than its CUDA graph bucket,
SwiGLU adding a step's tile deltas as it reads gate and up (check_swiglu_tiles; long runs'
u from cuBLAS too); and
the one-adapter LoRA epilogues of the norm, SwiGLU and rotary kernels
(tests/gpu/test_lora_epilogue.py), and those kernels adding deltas written beside the matmul.
The
interpreter has no bfloat16 and no CUDA graphs; those run on a GPU. `TRITON_INTERPRET` is read
when a kernel module is imported, so the checks run in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="scripts/setup.sh installs Triton for these checks")

ROOT = Path(__file__).resolve().parents[4]
CASES = [
    ("tiny", "distinct", 64, 16),
    ("tiny", "one-adapter", 40, 24),
    ("tiny", "runs", 300, 16),
    ("tiny", "all-base", 8, 16),
    ("tiny", "distinct", 3, 24),
    ("wide", "distinct", 20, 16),
    ("wide", "one-adapter", 33, 16),
    ("tiny", "runs", 300, 16, 24),  # runs of 24+ rows through cuBLAS beside the kernels
    ("tiny", "runs", 300, 16, 24, False),  # ... the kernels' deltas added after the matmul
    ("tiny", "distinct", 20, 16, None, True, 7),  # a step narrower than its graph bucket
]
CHILD = """
import json, sys, torch
from tests.gpu.test_lora_kernels import check_against_torch, check_splits_in_order
for shape, kind, rows, max_rank, *more in json.loads(sys.argv[1]):
    check_against_torch("cpu", shape, torch.float32, kind, rows, max_rank, *more)
    print("ok", shape, kind, rows, max_rank, flush=True)
check_splits_in_order("cpu", torch.float32, repeats=1)
print("ok splits in order", flush=True)
from tests.gpu.test_lora_kernels import check_swiglu_tiles
for kind, rows, pad, long in (
    ("distinct", 20, 0, None), ("runs", 90, 0, None), ("distinct", 13, 6, None),
    ("runs", 90, 0, 24), ("runs", 90, 0, 1),  # long runs' u from cuBLAS (1: every run's)
    ("one-run", 40, 0, 1),  # no kernel tile at all
):
    check_swiglu_tiles("cpu", "tiny", torch.float32, kind, rows, 16, graph_pad=pad,
                       long_segment_rows=long)
print("ok swiglu tiles", flush=True)
from tests.gpu.test_lora_epilogue import check_dense_deltas, check_epilogues
for width in (8, 12):
    check_epilogues("cpu", torch.float32, width)
print("ok epilogues", flush=True)
check_dense_deltas("cpu", torch.float32)
print("ok written deltas", flush=True)
"""


def test_kernels_match_the_torch_path_in_the_interpreter() -> None:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(CASES)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert result.stdout.count("ok ") == len(CASES) + 4
