"""Small all-reduces in one kernel over CUDA symmetric memory (peer GPUs' buffers over NVLink).

A decode step of a tensor-parallel engine sums two small activations per layer (batch x
hidden: 8 KB at batch 1 of an 8B model). NCCL's ring costs tens of microseconds each at that
size; a one-shot all-reduce, where every rank reads every peer's buffer directly and adds, costs
a few. PyTorch's symmetric memory (`torch.distributed._symmetric_memory`) maps each rank's
buffer into its peers' address space; `one_shot_all_reduce_copy_out` copies the local input
into the rank's buffer, meets its peers at a barrier, and writes the sum, in one launch.

Two buffers are used in turn (o_proj's sums in one, down_proj's in the other), so a rank that
runs ahead into the next all-reduce never writes a buffer a slower peer is still reading. Only
peer-to-peer reads: NVLink multicast is never used. Messages over `max_bytes` (prefill) go to
NCCL, whose ring is the faster at that size.

`enable` sets it up only where every rank can, checks one sum (eager and inside a captured CUDA
graph) against the expected value, and otherwise leaves the group on NCCL with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 20  # decode up to 64 rows of an 8192-wide bf16 model
ALIGN_BYTES = 16  # the kernels' vector width
CHECK_ELEMENTS = 4096
ONE_SHOT_OPS = ("one_shot_all_reduce_copy_out", "one_shot_all_reduce_out")


class SymmetricAllReduce:
    """One rank's pair of symmetric buffers and the one-shot sum over them."""

    def __init__(self, group_name: str, device: torch.device, dtype: torch.dtype, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group_name
        self.dtype = dtype
        self.max_bytes = max_bytes
        elements = max_bytes // torch.empty((), dtype=dtype).element_size()
        self.buffers = []
        for _ in range(2):
            buffer = symm_mem.empty(elements, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buffer, group_name)
            if getattr(handle, "multicast_ptr", 0):  # TORCH_SYMM_MEM_DISABLE_MULTICAST ignored
                raise RuntimeError("symmetric memory mapped NVLink multicast, which stays off")
            self.buffers.append(buffer)
        ops = torch.ops.symm_mem
        self.fused = hasattr(ops, "one_shot_all_reduce_copy_out")

    def fits(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` goes through here (same answer on every rank: same shapes)."""
        size = tensor.numel() * tensor.element_size()
        return (
            tensor.dtype == self.dtype
            and tensor.is_contiguous()
            and size <= self.max_bytes
            and size % ALIGN_BYTES == 0
        )

    def __call__(self, tensor: torch.Tensor, turn: int) -> torch.Tensor:
        """The sum of `tensor` over the ranks, in a new tensor (buffer `turn` % 2)."""
        flat = tensor.reshape(-1)
        buffer = self.buffers[turn % 2][: flat.numel()]
        out = torch.empty_like(flat)
        ops = torch.ops.symm_mem
        if self.fused:
            ops.one_shot_all_reduce_copy_out(buffer, flat, "sum", self.group_name, out)
        else:
            buffer.copy_(flat)
            ops.one_shot_all_reduce_out(buffer, "sum", self.group_name, out)
        return out.view(tensor.shape)


def unavailable(device: torch.device, world_size: int) -> str | None:
    """Why this rank cannot use symmetric memory, or None (a local check, no collective)."""
    if device.type != "cuda":
        return f"device {device.type}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"no symmetric memory in this PyTorch ({exc})"
    ops = torch.ops.symm_mem
    if not any(hasattr(ops, name) for name in ONE_SHOT_OPS):
        return "no one-shot all-reduce in this PyTorch"
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if count >= world_size:  # the group's GPUs are visible here: they must reach each other
        for other in range(count):
            if other != index and not torch.cuda.can_device_access_peer(index, other):
                return f"GPU {index} cannot reach GPU {other} peer to peer"
    return None


def use_cuda_backend() -> None:
    """Ask for the CUDA driver's symmetric memory (not NVSHMEM): P2P mappings only."""
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "set_backend"):
        try:
            symm_mem.set_backend("CUDA")
        except (RuntimeError, ValueError) as exc:  # already chosen, or a build without it
            logger.debug("symmetric memory backend left as is: %s", exc)


def check(
    reduce: SymmetricAllReduce, rank: int, world_size: int, device: torch.device
) -> str | None:
    """Sum a known tensor eagerly and from a captured graph; None when both are exact."""
    pattern = torch.arange(CHECK_ELEMENTS, device=device) % 7
    local = (pattern * (rank + 1)).to(reduce.dtype)
    expected = (pattern * sum(range(1, world_size + 1))).to(reduce.dtype)
    if not torch.equal(reduce(local, 0), expected):
        return "eager one-shot sum differs from the expected sum"
    static = local.clone()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        reduce(static, 1)  # warm the op on the capture stream
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = reduce(static, 0)
        second = reduce(first, 1)
    graph.replay()
    torch.cuda.synchronize(device)
    twice = (pattern * sum(range(1, world_size + 1)) * world_size).to(reduce.dtype)
    if not (torch.equal(first, expected) and torch.equal(second, twice)):
        return "one-shot sums replayed from a CUDA graph differ from the expected sums"
    return None


def enable(
    *,
    group_name: str,
    rank: int,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
    agree: Callable[[int], int],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[SymmetricAllReduce | None, str | None]:
    """(the all-reduce, None) where every rank set it up and checked it; else (None, why).

    Collective: every rank of the group calls it at the same point; `agree` is the smallest of
    every rank's value (over the host group), so all ranks take the same decision.
    """
    reason = unavailable(device, world_size)
    if not agree(int(reason is None)):
        return None, reason or "another rank cannot use symmetric memory"
    reduce: SymmetricAllReduce | None = None
    try:
        use_cuda_backend()
        reduce = SymmetricAllReduce(group_name, device, dtype, max_bytes)
        reason = check(reduce, rank, world_size, device)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the group on NCCL
        reason = f"set-up failed: {type(exc).__name__}: {exc}"
    if not agree(int(reason is None)):
        return None, reason or "another rank's check failed"
    return reduce, None
