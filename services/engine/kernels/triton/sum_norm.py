"""A tensor-parallel sum, the residual add and RMSNorm in one kernel (decode-sized rows).

In a tensor-parallel decode step, o_proj and down_proj each end with a sum of every rank's
partial rows, and the next thing the model does with that sum is `residual += sum;
x = rms_norm(residual) * weight`. Here one program per row pushes its partial row into every
peer's receive buffer over NVLink (peer-to-peer stores into CUDA symmetric memory), raises a
flag there, waits for every peer's flag for that row in its own memory, and sums the rows in
rank order (the same bits on every rank), then adds the residual and normalizes: one launch and
one cross-GPU wait per sum instead of an all-reduce and a norm kernel.

Synchronization: every rank owns `flags[turn, sender, row]` and `data[turn, sender, row, :]`.
A sender's stores are fenced at system scope before its flag is raised (release); the receiver
takes the flag back to 0 with an acquire compare-and-swap and reads the rows uncached. Calls
alternate between two turns (o_proj's sums use turn 0, down_proj's turn 1, every forward starts
with turn 0 and makes as many calls of each), so a sender that runs ahead into its next call
never writes a slot its peer still reads: reusing a turn's slot of a row needs the call between,
of the other turn and on the same row, which waits for the peer. A program spins only after its
own stores and flags are out, and every row's program is resident at once (the rows are capped
below the GPU's SM count), so no rank waits on a program that cannot run. Only peer-to-peer
stores and atomics: no NVLink multicast.

The sum is rounded to the model's dtype before the residual add, as an all-reduce followed by
the fused add + norm (kernels/triton/rms_norm.py) rounds it, so both paths give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import pdl_options, pdl_prologue


@triton.jit
def _fence_system(value):
    """Order this thread's earlier stores (to any GPU) before its later ones, system-wide."""
    return tl.inline_asm_elementwise(
        "fence.acq_rel.sys;\n\tmov.b32 $0, $1;",
        "=r,r",
        [value],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _sum_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    data_ptrs,
    flag_ptrs,
    rank,
    turn,
    max_rows,
    hidden_size,
    eps,
    WORLD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < hidden_size
    dtype = x_ptr.dtype.element_ty
    base = row.to(tl.int64) * hidden_size
    mine = tl.load(x_ptr + base + offsets, mask=mask, other=0.0)

    # Push this rank's row into slot (turn, rank, row) of every peer, then raise its flags.
    sent = (turn * WORLD + rank) * max_rows + row
    for peer in tl.static_range(WORLD):
        if peer != rank:
            data = tl.load(data_ptrs + peer).to(tl.pointer_type(dtype))
            tl.store(data + sent.to(tl.int64) * hidden_size + offsets, mine, mask=mask)
    _fence_system(row)
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flags = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags + sent, 1, sem="release", scope="sys")

    # Sum every rank's row in rank order, each peer's once its flag is up (then lowered).
    own_data = tl.load(data_ptrs + rank).to(tl.pointer_type(dtype))
    own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == rank:
            part = mine
        else:
            slot = (turn * WORLD + peer) * max_rows + row
            seen = tl.atomic_cas(own_flags + slot, 1, 0, sem="acquire", scope="sys")
            while seen != 1:
                seen = tl.atomic_cas(own_flags + slot, 1, 0, sem="acquire", scope="sys")
            tl.debug_barrier()
            part = tl.load(
                own_data + slot.to(tl.int64) * hidden_size + offsets,
                mask=mask,
                other=0.0,
                volatile=True,
            )
        total += part.to(tl.float32)

    hidden = total.to(dtype)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + base + offsets, mask=mask, other=0.0)
        hidden = (hidden.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(residual_out_ptr + base + offsets, hidden, mask=mask)
    values = hidden.to(tl.float32)
    variance = tl.sum(values * values, axis=0) / hidden_size
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    normed = values * tl.rsqrt(variance + eps) * weight
    tl.store(out_ptr + base + offsets, normed.to(dtype), mask=mask)


def sum_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    data_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    rank: int,
    world_size: int,
    turn: int,
    max_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum + residual) * weight, sum + residual), where sum is `x` summed over the
    ranks; every rank calls it with its partial `x` [rows, H], rows <= max_rows.

    `data_ptrs` / `flag_ptrs`: int64 device tensors of every rank's receive buffer
    ([2, world_size, max_rows, H] of x's dtype) and flags ([2, world_size, max_rows] int32), as
    mapped on this GPU; `turn` 0 or 1 (see the module's docstring).
    """
    x = x.contiguous()
    rows, hidden_size = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    if rows == 0:
        return out, residual_out
    if residual is not None:
        residual = residual.contiguous()
    block = triton.next_power_of_2(hidden_size)
    _sum_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out,
        data_ptrs,
        flag_ptrs,
        rank,
        turn,
        max_rows,
        hidden_size,
        eps,
        WORLD=world_size,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl_options(x.device),
    )
    return out, residual_out
