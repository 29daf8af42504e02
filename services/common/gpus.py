"""Which NVIDIA GPUs this machine shows, without importing torch or initializing CUDA.

`sluice up --no-ray` starts one engine process per GPU and pins each to its own with
CUDA_VISIBLE_DEVICES (Ray does the same for its actors with num_gpus=1). The launcher must not
initialize CUDA itself (a forked or pinned child would inherit nothing useful from it), so the
GPUs come from CUDA_VISIBLE_DEVICES when it is set, else from `nvidia-smi`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping

NVIDIA_SMI_TIMEOUT_S = 10.0


def _query_nvidia_smi() -> str:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return ""
    try:
        result = subprocess.run(
            [binary, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout if result.returncode == 0 else ""


def visible_gpus(
    environ: Mapping[str, str] | None = None, query: Callable[[], str] = _query_nvidia_smi
) -> list[str]:
    """The GPU ids a child may be pinned to (CUDA_VISIBLE_DEVICES entries, else nvidia-smi's
    indices); [] without a GPU."""
    env = os.environ if environ is None else environ
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [item.strip() for item in listed.split(",") if item.strip()]
        # CUDA stops at the first invalid entry ("-1" hides every GPU).
        valid = []
        for item in ids:
            if item.startswith("-"):
                break
            valid.append(item)
        return valid
    return [line.strip() for line in query().splitlines() if line.strip()]
