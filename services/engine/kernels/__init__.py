"""The engine's hand-written kernels, by device.

triton/ holds the Triton kernels of the CUDA fast path (one kernel per module); cpu/ holds the
native C++ kernels of the CPU path and their ctypes builder; reference.py holds plain-PyTorch
versions of the Triton kernels, the readable statement of what each computes, which the tests
compare against. Triton is imported only by the kernel modules, so this package imports on
machines without it.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """True when Triton can be imported (it is not a dependency of the CPU path)."""
    return importlib.util.find_spec("triton") is not None
