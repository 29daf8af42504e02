"""Set-up of the fused sum + residual add + RMSNorm (kernels/triton/sum_norm.py) for one rank.

Each rank allocates its receive buffer in CUDA symmetric memory (mapped into every peer's
address space by `rendezvous`; peer-to-peer only, no NVLink multicast), marks every slot empty
(-0.0) and gives the kernel a table of every rank's buffer address as this GPU sees it.
`enable` builds it only where every rank can, compiles the kernel before any rank launches it
(a rank that cannot compile must not leave its peers waiting), checks one eager and one
graph-replayed sum against the expected values, and otherwise leaves the sums on the all-reduce
with the reason.
Every step is agreed on by all ranks, so they all take the same decision.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from services.engine.parallel import symmetric

DEFAULT_MAX_ROWS = 64  # every CUDA-graph decode batch up to 64 sequences
TURNS = 2


class FusedSumNorm:
    """One rank's buffers for the fused kernel and the call that runs it."""

    def __init__(
        self,
        group_name: str,
        rank: int,
        world_size: int,
        device: torch.device,
        dtype: torch.dtype,
        hidden_size: int,
        max_rows: int = DEFAULT_MAX_ROWS,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from services.engine.kernels.triton.sum_norm import empty_mark

        self.rank, self.world_size = rank, world_size
        self.device, self.dtype = device, dtype
        self.hidden_size, self.max_rows = hidden_size, max_rows
        slots = TURNS * world_size * max_rows
        self.data = symm_mem.empty(slots * hidden_size, dtype=dtype, device=device)
        bits = torch.int16 if dtype.itemsize == 2 else torch.int32
        # Every slot empty before any peer can store into it: the set-up agrees after this.
        self.data.view(bits).fill_(empty_mark(dtype))
        self.data_ptrs = self._peer_table(symm_mem.rendezvous(self.data, group_name), self.data)
        torch.cuda.synchronize(device)

    def _peer_table(self, handle, local: torch.Tensor) -> torch.Tensor:
        """Every rank's copy of `local` as mapped here, as an int64 device tensor."""
        if getattr(handle, "multicast_ptr", 0):  # TORCH_SYMM_MEM_DISABLE_MULTICAST ignored
            raise RuntimeError("symmetric memory mapped NVLink multicast, which stays off")
        shape = (local.numel(),)
        # The handle's buffers start where the allocation does; `local` may sit further in.
        skew = local.data_ptr() - handle.get_buffer(self.rank, shape, local.dtype).data_ptr()
        addresses = [
            handle.get_buffer(peer, shape, local.dtype).data_ptr() + skew
            for peer in range(self.world_size)
        ]
        return torch.tensor(addresses, dtype=torch.int64, device=self.device)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether the sum of `x` goes through here (the same answer on every rank: it depends
        on the shape and dtype only, which every rank's step shares)."""
        return (
            x.dim() == 2
            and x.dtype == self.dtype
            and x.shape[1] == self.hidden_size
            and 0 < x.shape[0] <= self.max_rows
        )

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        turn: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum + residual) * weight, sum + residual), the sum over the ranks of x."""
        from services.engine.kernels.triton.sum_norm import sum_norm

        return sum_norm(
            x,
            residual,
            weight,
            eps,
            data_ptrs=self.data_ptrs,
            rank=self.rank,
            world_size=self.world_size,
            turn=turn % TURNS,
            max_rows=self.max_rows,
        )

    def compile(self) -> None:
        """Compile the kernel for this rank's shapes without launching it."""
        import triton

        from services.engine.kernels.triton.launch import pdl_options
        from services.engine.kernels.triton.rms_norm import norm_warps
        from services.engine.kernels.triton.sum_norm import _sum_norm_kernel, empty_mark

        x = torch.zeros((1, self.hidden_size), dtype=self.dtype, device=self.device)
        block = triton.next_power_of_2(self.hidden_size)
        for has_residual, turn in itertools.product((False, True), range(TURNS)):
            _sum_norm_kernel.warmup(
                x, x, x[0], x, x, self.data_ptrs,
                self.rank, turn, self.max_rows, self.hidden_size, 1e-5,
                EMPTY=empty_mark(self.dtype), WORLD=self.world_size,
                HAS_RESIDUAL=has_residual, BLOCK=block,
                num_warps=norm_warps(block), grid=(1,),
                **pdl_options(self.device),
            )  # fmt: skip


def resident_rows(device: torch.device, max_rows: int) -> int:
    """`max_rows`, capped so that every row's program is resident at once (one an SM)."""
    return min(max_rows, torch.cuda.get_device_properties(device).multi_processor_count)


def expected(
    partial: torch.Tensor, world_size: int, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused kernel must give when rank r's partial is partial * (r + 1): the sum
    rounded to the dtype, the residual added and rounded, then the norm (float32 inside)."""
    total = (partial.float() * sum(range(1, world_size + 1))).to(partial.dtype)
    summed = (total.float() + residual.float()).to(partial.dtype)
    values = summed.float()
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(partial.dtype), summed


def check(fused: FusedSumNorm) -> str | None:
    """Run the kernel on known rows eagerly and from a captured graph; None when right.

    Calls alternate turn 0 then 1, as a forward's do (the kernel relies on it).
    """
    device, dtype, eps = fused.device, fused.dtype, 1e-5
    generator = torch.Generator(device="cpu").manual_seed(7)  # the same rows on every rank
    shape = (min(4, fused.max_rows), fused.hidden_size)
    base = (torch.randint(-8, 9, shape, generator=generator) / 8).to(device, dtype)
    residual = torch.randn(shape, generator=generator).to(device, dtype)
    weight = torch.rand(shape[1], generator=generator).to(device, dtype)
    local = (base.float() * (fused.rank + 1)).to(dtype)
    want_normed, want_summed = expected(base, fused.world_size, residual, weight, eps)

    def right(result: tuple[torch.Tensor, torch.Tensor]) -> bool:
        normed, summed = result
        close = torch.allclose(normed.float(), want_normed.float(), rtol=1.6e-2, atol=1e-2)
        return torch.equal(summed, want_summed) and close

    eager = [fused(local, residual, weight, eps, 0), fused(local, residual, weight, eps, 1)]
    torch.cuda.synchronize(device)
    if not all(right(result) for result in eager):
        return "eager fused sums differ from the expected sums"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [fused(local, residual, weight, eps, 0), fused(local, residual, weight, eps, 1)]
    for result in captured:
        for tensor in result:
            tensor.zero_()
    graph.replay()
    torch.cuda.synchronize(device)
    if not all(right(result) for result in captured):
        return "fused sums replayed from a CUDA graph differ from the expected sums"
    return None


def enable(
    *,
    group_name: str,
    rank: int,
    world_size: int,
    device: torch.device,
    dtype: torch.dtype,
    hidden_size: int,
    agree: Callable[[int], int],
    max_rows: int = DEFAULT_MAX_ROWS,
) -> tuple[FusedSumNorm | None, str | None]:
    """(the fused sum + norm, None) where every rank set it up and checked it; else (None, why).

    Collective: every rank calls it at the same point; `agree` is the smallest of every
    rank's value (over the host group).
    """
    reason = symmetric.unavailable(device, world_size)
    if not agree(int(reason is None)):
        return None, reason or "another rank cannot use symmetric memory"
    max_rows = agree(resident_rows(device, max_rows))  # every rank lays its slots out alike
    fused: FusedSumNorm | None = None
    try:
        symmetric.use_cuda_backend()
        fused = FusedSumNorm(group_name, rank, world_size, device, dtype, hidden_size, max_rows)
        fused.compile()
    except Exception as exc:  # noqa: BLE001 - any failure leaves the sums on the all-reduce
        reason = f"set-up failed: {type(exc).__name__}: {exc}"
    if not agree(int(reason is None)):  # every rank's slots are empty and its kernel built
        return None, reason or "another rank's set-up failed"
    try:
        reason = check(fused)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001
        reason = f"check failed: {type(exc).__name__}: {exc}"
    if not agree(int(reason is None)):
        return None, reason or "another rank's check failed"
    return fused, None
