"""A tensor-parallel sum, the residual add and RMSNorm in one kernel (decode-sized rows).

In a tensor-parallel decode step, o_proj and down_proj each end with a sum of every rank's
partial rows, and the next thing the model does with that sum is `residual += sum;
x = rms_norm(residual) * weight`. Here one program per row stores its partial row straight
into every peer's receive buffer over NVLink (peer-to-peer stores into CUDA symmetric memory),
waits until every peer's row has arrived in its own buffer, sums the rows in rank order (the
same bits on every rank), adds the residual and normalizes: one launch and one one-way trip
over NVLink per sum, instead of an all-reduce (a barrier and a copy) and then a norm kernel.

Arrival is seen in the data itself, with no flags or fences: a receive slot holds -0.0 in every
element while empty, a sent row never holds -0.0 (a zero is sent as +0.0, the same value, and
each rank sums what it sent), so a slot is complete once no element is -0.0; the receiver then
empties it again. Every rank owns `data[turn, sender, row, :]`. Calls alternate between two
turns (o_proj's sums use turn 0, down_proj's turn 1; every forward starts with turn 0 and makes
as many calls of each), so a sender that runs ahead into its next call never writes a slot its
peer has not emptied: reusing a turn's slot of a row needs the call between, of the other turn
and on the same row, which waits for this rank's row, sent only after its previous kernel (the
emptying one) has ended. A program waits only after its own stores are out, and every row's
program is resident at once (the rows are capped at the GPU's SM count), so no rank waits on a
program that cannot run. Only peer-to-peer stores: no NVLink multicast.

The sum is rounded to the model's dtype before the residual add, as an all-reduce followed by
the fused add + norm (kernels/triton/rms_norm.py) rounds it, so both paths give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import pdl_options, pdl_prologue
from services.engine.kernels.triton.rms_norm import norm_warps, store_normed


@triton.jit
def _sum_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    data_ptrs,
    rank,
    turn,
    max_rows,
    hidden_size,
    eps,
    EMPTY: tl.constexpr,
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
    bits_type = tl.int16 if dtype.primitive_bitwidth == 16 else tl.int32
    base = row.to(tl.int64) * hidden_size
    mine = tl.load(x_ptr + base + offsets, mask=mask, other=0.0)
    # -0.0 is the empty mark: a sent zero is +0.0 (the same value), on every rank alike.
    mine = tl.where(mine == 0.0, 0.0, mine).to(dtype)

    # Store this rank's row into slot (turn, rank, row) of every peer's receive buffer.
    sent = ((turn * WORLD + rank) * max_rows + row).to(tl.int64) * hidden_size
    for peer in tl.static_range(WORLD):
        if peer != rank:
            data = tl.load(data_ptrs + peer).to(tl.pointer_type(bits_type))
            tl.store(data + sent + offsets, mine.to(bits_type, bitcast=True), mask=mask)

    # Sum every rank's row in rank order: a peer's once none of its values is still empty,
    # then its slot is emptied again for the next call of this turn.
    own = tl.load(data_ptrs + rank).to(tl.pointer_type(bits_type))
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == rank:
            part = mine
        else:
            slot = own + ((turn * WORLD + peer) * max_rows + row).to(tl.int64) * hidden_size
            bits = tl.load(slot + offsets, mask=mask, other=0, volatile=True)
            while tl.sum((bits == EMPTY).to(tl.int32), axis=0) > 0:
                bits = tl.load(slot + offsets, mask=mask, other=0, volatile=True)
            part = bits.to(dtype, bitcast=True)
            tl.store(slot + offsets, tl.full([BLOCK], EMPTY, bits_type), mask=mask)
        total += part.to(tl.float32)

    hidden = total.to(dtype)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + base + offsets, mask=mask, other=0.0)
        hidden = (hidden.to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(residual_out_ptr + base + offsets, hidden, mask=mask)
    store_normed(out_ptr + base, weight_ptr, hidden.to(tl.float32), offsets, mask, hidden_size, eps)


def empty_mark(dtype: torch.dtype) -> int:
    """The bits of -0.0 in `dtype`, as the signed integer of its width (the empty mark)."""
    return -(1 << 15) if dtype.itemsize == 2 else -(1 << 31)


def sum_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    data_ptrs: torch.Tensor,
    rank: int,
    world_size: int,
    turn: int,
    max_rows: int,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum + residual) * weight, sum + residual), where sum is `x` summed over the
    ranks; every rank calls it with its partial `x` [rows, H], rows <= max_rows.

    `data_ptrs`: an int64 device tensor of every rank's receive buffer ([2, world_size,
    max_rows, H] of x's dtype, every value -0.0 at first), as mapped on this GPU; `turn` 0 or 1
    (see the module's docstring).
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
        rank,
        turn,
        max_rows,
        hidden_size,
        eps,
        EMPTY=empty_mark(x.dtype),
        WORLD=world_size,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps or norm_warps(block),
        **pdl_options(x.device),
    )
    return out, residual_out
