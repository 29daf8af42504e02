"""CachedLaunch: a Triton kernel launched without its JIT dispatch after the first time.

Outside CUDA graphs (prefill and mixed steps) every kernel is launched from Python: the norms,
rotary + KV store, attention and SwiGLU once or twice a layer, the LoRA kernels hundreds of
times a step. Triton's own launch path (bind the arguments, specialize each one, build the
cache key, look the kernel up) costs more host time than a small kernel takes on the GPU, and
a step with prompt rows is then bound by its launches. `CachedLaunch`
goes through `kernel[grid](...)` once per specialization and keeps the compiled kernel; later
launches with the same specialization call its launcher directly.

The specialization key is at least as fine as Triton's for the argument kinds these kernels
take: a tensor's dtype and whether its address is 16-byte aligned; an int's being 1, a
multiple of 16, or outside int32; every constexpr and launch option by value. So a direct
launch always runs the kernel Triton itself would pick. Whenever a launch hook is set (a
profiler) or the launcher is missing, launches take Triton's full path.

Programmatic dependent launch (Hopper and later; `pdl_options`): every Sluice kernel opens
with `pdl_prologue`, which waits until the kernel before it in the stream has finished and its
writes are visible (`griddepcontrol.wait`), then lets the next one launch. Launched with PDL, a
kernel's launch and block scheduling overlap the tail of the one before, instead of starting
after it: a decode step is a chain of ~10 small kernels a layer, whose gaps add up. The LoRA
kernels open differently: they let the next kernel launch first, read what no kernel of the step
writes (its tile layout, copied in before the step's first kernel, and the adapters' weights)
before their wait, and wait before their first read of a kernel's output, before any write, and
once more before they end (a program with no work too). Every kernel thus ends after the one
before it, a kernel's wait covers all earlier ones, and the order of every read and write of a
kernel's output is the stream's. `SLUICE_PDL=0` turns it off.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime import driver

from services.common.config import bool_setting

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# False: every launch takes Triton's full path (benchmarks.lora_launch_bench compares both).
DIRECT_LAUNCH = True


def _arg_key(value: Any) -> Any:
    """A positional argument's part of the specialization key: a tensor's dtype and address
    mod 16, an int's being 1, its residue mod 16 and whether it fits int32 (finer than
    Triton's own key, never coarser), anything else by type and value. `CachedLaunch` builds
    the first two inline for plain tensors and ints (the same tuples, without the call)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() & 15)
    if isinstance(value, bool) or not isinstance(value, int):
        return (type(value), value)
    return (value == 1, value & 15, INT32_MIN <= value <= INT32_MAX)


_Tensor = torch.Tensor


class CachedLaunch:
    """`launch(grid, *args, **constexprs_and_options)` for one `@triton.jit` function whose
    runtime arguments are passed positionally and whose constexprs (and `num_warps`) by name.

    Its own host work per launch is kept small (an eager step launches hundreds): a plain
    tensor's part of the key is built inline, and each specialization keeps its launcher's
    pieces and the names of the constexprs it passes after the positional arguments."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._names = tuple(kernel.arg_names)
        # key -> (run, function, packed metadata, names of the named values it passes)
        self._compiled: dict[tuple[Any, ...], tuple[Any, Any, Any, tuple[str, ...]]] = {}
        self._current_stream: Any = None  # the driver's get_current_stream, once looked up
        self.direct_launches = 0  # launches that skipped the JIT dispatch (for tests)

    def __call__(self, grid: tuple[int, ...], *args: Any, **named: Any) -> None:
        """Launch on the current stream. Pass the constexprs in one order at each call site
        (they are part of the key as given)."""
        first = args[0]
        device = first.get_device() if isinstance(first, _Tensor) else -1
        # _arg_key's tuples, plain tensors' and ints' built inline
        key = (
            tuple([
                (arg.dtype, arg.data_ptr() & 15) if type(arg) is _Tensor
                else (arg == 1, arg & 15, INT32_MIN <= arg <= INT32_MAX) if type(arg) is int
                else _arg_key(arg)
                for arg in args
            ]),
            tuple(named.items()),
            device,
        )  # fmt: skip
        entry = self._compiled.get(key)
        if entry is None or not DIRECT_LAUNCH or _hooks_set():
            compiled = self.kernel[grid](*args, **named)
            if compiled is not None and hasattr(compiled, "run"):  # None: the interpreter
                tail = self._names[len(args) :]
                self._compiled[key] = (
                    compiled.run, compiled.function, compiled.packed_metadata, tail
                )  # fmt: skip
            return
        run, function, metadata, tail = entry
        current_stream = self._current_stream
        if current_stream is None:
            current_stream = self._current_stream = driver.active.get_current_stream
        run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            current_stream(device),
            function,
            metadata,
            None,
            None,
            None,
            *args,
            *[named[name] for name in tail],
        )
        self.direct_launches += 1


def _hooks_set() -> bool:
    """Whether a launch hook (a profiler's) is set: launches then take Triton's own path."""
    runtime = knobs.runtime
    return _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: an empty chain of hooks (Triton's default) is not."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """The first statement of every kernel: with PDL, wait for the kernel before this one
    (its writes visible), then allow the next one to launch."""
    pdl_wait(USE_PDL)
    pdl_launch_next(USE_PDL)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """With PDL, wait until the kernel before this one has ended and its writes are visible
    (again later in a kernel: returns at once)."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_launch_next(USE_PDL: tl.constexpr):
    """With PDL, let the next kernel launch (it still waits for this one to end)."""
    if USE_PDL:
        gdc_launch_dependents()


def pdl_options(device: torch.device) -> dict[str, bool]:
    """A kernel launch's `USE_PDL` constexpr (and Triton's `launch_pdl` option) on `device`."""
    if device.type == "cuda" and _pdl_supported(device.index):
        return _PDL_ON
    return _PDL_OFF


_PDL_ON = {"USE_PDL": True, "launch_pdl": True}
_PDL_OFF = {"USE_PDL": False}


@functools.cache
def _pdl_supported(index: int | None) -> bool:
    """Hopper or later, unless SLUICE_PDL=0 (asked once per device)."""
    if not bool_setting("pdl", True):
        return False
    index = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_capability(index) >= (9, 0)
