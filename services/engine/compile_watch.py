"""Triton kernels compiled after the warm-up: each one is a stall on a request's step.

The warm-up (services/engine/warmup.py) runs every step shape an engine can take so that no
request waits for a kernel to compile. A variant it missed (a new specialisation of an integer
argument, a shape it did not plan) compiles on a serving step instead: tens of milliseconds
from Triton's disk cache, seconds without one. `arm()` hooks Triton's JIT cache-miss callback
once per process (chaining a hook that was there); from then on every miss is logged as a
warning naming the kernel and its signature, and counted in
`sluice_engine_kernel_compiles_after_warmup_total`, so a slow first request says why; the
latest are kept for benchmarks (`late_compiles`). Where Triton is not installed it does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from services.engine.metrics import ENGINE_LATE_KERNEL_COMPILES

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_armed = False
# The latest late compiles: (time.monotonic(), description), oldest first (at most KEEP).
KEEP = 100
_late: list[tuple[float, str]] = []


def arm() -> bool:
    """Watch Triton compiles from now on; False where Triton is missing. Idempotent."""
    global _armed
    try:
        from triton import knobs
    except ImportError:
        return False
    with _lock:
        if _armed:
            return True
        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = _chained(previous)
        _armed = True
    return True


def _chained(previous: Any):
    def hook(**kwargs: Any) -> Any:
        note_compile(describe(kwargs))
        return previous(**kwargs) if previous is not None else False

    return hook


def describe(kwargs: dict[str, Any]) -> str:
    """The kernel's name and what its variant is specialised on (constants, argument
    attributes such as divisibility by 16), from the keywords Triton passes the hook."""
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or str(kwargs.get("repr", "a Triton kernel")).split("[")[0]
    compile_args = kwargs.get("compile")
    if not isinstance(compile_args, dict):
        return name
    constants = compile_args.get("constants")
    configs = compile_args.get("configs")
    return f"{name} (constants {constants}; argument attributes {configs})"


def late_compiles() -> list[tuple[float, str]]:
    """The latest kernel variants compiled after the warm-up: (time.monotonic(), what)."""
    with _lock:
        return list(_late)


def note_compile(signature: str) -> None:
    """Log, count and keep one kernel variant compiled while serving."""
    ENGINE_LATE_KERNEL_COMPILES.inc()
    with _lock:
        _late.append((time.monotonic(), signature))
        del _late[:-KEEP]
    logger.warning(
        "compiling a kernel variant the warm-up did not cover (a request's step waits): %s",
        signature[:600],
    )
