"""One adapter's LoRA delta added inside the kernel that reads a projection's output.

In a decode step whose adapter rows all use one adapter, its shrink runs inside the base
matmul: the projection's weight carries that adapter's A as extra output rows, so `x [W; A]ᵀ`
gives each row its projection output y and, in the columns after it, u = x Aᵀ
(services/engine/lora/fused.py). The expand, `y += u Bᵀ`, then needs no launch of its own:
whatever kernel reads y next (the residual add + RMSNorm, SwiGLU, the rotary + KV-cache store)
adds each element's `Σₖ u[k] Bᵀ[k, column]` as it loads it. `LoRAEpilogue` names what such a
kernel reads: u (a column view of the wider matmul's output), Bᵀ ([rank, out], the adapter's
scale folded in), whether each row is the adapter's (a row of the base model adds nothing) and
the adapter's rank in this projection (0 where it leaves the projection alone). Those two are
separate loads, not one through the other, so no load of a kernel waits on another's result
before the tile loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

CHUNK = tl.constexpr(8)  # ranks whose loads lora_delta issues at once


@dataclass(frozen=True)
class LoRAEpilogue:
    """What a consumer kernel reads to add one adapter's deltas to a projection's output."""

    u: torch.Tensor  # [rows, slices * slice_width] view: each slice's x Aᵀ (unit column stride)
    bt: torch.Tensor  # [slice_width, out] contiguous: Bᵀ of the whole projection output
    rows_on: torch.Tensor  # int32 [>= rows]: 1 for a row of the adapter, 0 otherwise
    rank: torch.Tensor  # int32 [1]: the adapter's rank in this projection
    slice_width: int  # u columns per slice (the slots' largest rank)

    def kernel_args(self) -> tuple:
        """(u, u row stride, Bᵀ, rows on, rank) as the kernels take them (the slice width
        goes as the constexpr SLICE_WIDTH)."""
        return (self.u, self.u.stride(0), self.bt, self.rows_on, self.rank)


@dataclass(frozen=True)
class LoRATiles:
    """The deltas of a step of any adapter mix, for a consumer kernel to add as it loads the
    projection output: each tile of rows (one slot; the base model's rows in tiles of a slot of
    rank 0) takes its rows' u (lora_shrink's, float32) times its slot's B. The layout is the
    LoRA runtime's (services/engine/lora/runtime.py; lora_expand reads the same)."""

    u: torch.Tensor  # float32 [rows, slices * max_rank]: each row's x Aᵀ per slice
    b: torch.Tensor  # [slots, out, max_rank], last dim contiguous: every slot's B
    tiles: torch.Tensor  # int32 [1 + 3 * capacity]: count, then the tiles' slots, starts, rows
    row_indices: torch.Tensor  # int32: each tile's rows, from its start
    slot_ranks: torch.Tensor  # int32 [slots]: each slot's rank in this projection
    tile_rows: int  # rows a tile holds at most
    tile_bound: int  # tiles the step may have (the grid covers this many)


@dataclass(frozen=True)
class LoRADeltas:
    """Every row's adapter delta of a projection output, already written (by the LoRA kernels
    on a side stream, beside the base matmul: services/engine/lora/runtime.py): a consumer
    kernel adds `delta[row, column]` to each element of the output as it loads it. A row of
    the base model has a delta of zeros."""

    delta: torch.Tensor  # [>= rows, out], unit column stride, the output's dtype


Epilogue = LoRAEpilogue | LoRATiles | LoRADeltas


class EpilogueSource(Protocol):
    """Where a consumer kernel's caller finds the delta awaiting its input, if any."""

    def take(self, x: torch.Tensor) -> Epilogue | None:
        """The epilogue of the projection output `x` starts at; None when none awaits it."""
        ...


def epilogue_args(tensor: torch.Tensor, lora: LoRAEpilogue | None) -> tuple[tuple, dict]:
    """(positional, keyword) kernel arguments of `lora`, or placeholders never read when a
    kernel runs without one (`tensor` any tensor of the call)."""
    if lora is None:
        return (tensor, 0, tensor, tensor, tensor), {"HAS_LORA": False, "SLICE_WIDTH": CHUNK}
    return lora.kernel_args(), {"HAS_LORA": True, "SLICE_WIDTH": lora.slice_width}


def split_deltas(lora: Epilogue | None) -> tuple[Epilogue | None, LoRADeltas | None]:
    """(lora, None), or (None, the deltas) where `lora` is written deltas: a consumer kernel
    takes those through `delta_args`, beside whatever else it takes."""
    if isinstance(lora, LoRADeltas):
        return None, lora
    return lora, None


def delta_args(
    tensor: torch.Tensor, deltas: LoRADeltas | None, rows: int, width: int
) -> tuple[tuple, dict]:
    """(positional, keyword) kernel arguments of `deltas` (delta, its row stride) for a consumer
    of `rows` rows of a `width`-column output (raises ValueError where the delta does not cover
    them), or placeholders never read when a kernel runs without them (`tensor` any tensor of
    the call)."""
    if deltas is None:
        return (tensor, 0), {"HAS_DELTA": False}
    delta = deltas.delta
    if delta.dim() != 2 or delta.shape[0] < rows or delta.shape[1] != width:
        raise ValueError(f"delta {tuple(delta.shape)} does not cover {rows} rows of {width}")
    if delta.stride(1) != 1:
        raise ValueError("delta needs a unit column stride")
    return (delta, delta.stride(0)), {"HAS_DELTA": True}


@triton.jit
def row_rank(rows_on_ptr, rank_ptr, row):
    """The rank of `row`'s delta in this projection (0: nothing to add)."""
    return tl.load(rows_on_ptr + row) * tl.load(rank_ptr)


@triton.jit
def lora_delta(u_ptr, bt_ptr, bt_stride, columns, mask, rank, SLICE_WIDTH: tl.constexpr):
    """Σ_{k < rank} u[k] · Bᵀ[k, columns], float32, in the shape of `columns` (u_ptr at the
    row's slice of u; masked lanes 0). Ranks go CHUNK at a time, their loads issued together;
    chunks at or past `rank` (<= SLICE_WIDTH) are skipped."""
    delta = tl.zeros_like(columns).to(tl.float32)
    for start in range(0, SLICE_WIDTH, CHUNK):
        if start < rank:
            for step in tl.static_range(CHUNK):
                k = start + step
                live = k < rank
                weight = tl.load(u_ptr + k, mask=live, other=0.0).to(tl.float32)
                factor = tl.load(bt_ptr + k * bt_stride + columns, mask=mask & live, other=0.0)
                delta += weight * factor.to(tl.float32)
    return delta


@triton.jit
def block_ranks(rows_on_ptr, rank_ptr, rows, row_mask):
    """(each of `rows`' rank in this projection (0 past row_mask), the adapter's rank)."""
    rank = tl.load(rank_ptr)
    return tl.load(rows_on_ptr + rows, mask=row_mask, other=0) * rank, rank


@triton.jit
def lora_block_delta(
    u_ptr,
    u_stride,
    rows,
    row_mask,
    ranks,
    top,
    bt_ptr,
    bt_stride,
    columns,
    column_mask,
    SLICE_WIDTH: tl.constexpr,
    R_P: tl.constexpr,
    IEEE: tl.constexpr,
):
    """[rows, columns] float32: row i's Σ_{k < ranks[i]} u[rows[i], k] Bᵀ[k, columns[j]], one
    tensor-core product for a block of rows (Bᵀ read once for all of them, up to `top`, the
    block's largest rank; u_ptr at the slice of u). IEEE: full float32 products (no TF32)."""
    ks = tl.arange(0, R_P)
    u = tl.load(
        u_ptr + rows[:, None].to(tl.int64) * u_stride + ks[None, :],
        mask=row_mask[:, None] & (ks[None, :] < SLICE_WIDTH),
        other=0.0,
    )
    u = tl.where(ks[None, :] < ranks[:, None], u, 0.0)  # masked after: no wait on the ranks
    bt = tl.load(
        bt_ptr + ks[:, None] * bt_stride + columns[None, :],
        mask=(ks[:, None] < top) & column_mask[None, :],
        other=0.0,
    )
    if IEEE:
        return tl.dot(u, bt, input_precision="ieee")
    return tl.dot(u, bt)


def block_options(lora: LoRAEpilogue) -> dict:
    """The constexprs of a kernel that adds `lora` with lora_block_delta."""
    return {
        "SLICE_WIDTH": lora.slice_width,
        "R_P": max(16, triton.next_power_of_2(lora.slice_width)),
        "IEEE": lora.u.dtype == torch.float32,
    }


def check(epilogue: LoRAEpilogue, rows: int, width: int, slices: int) -> None:
    """Shapes a consumer of `rows` rows of a `width`-column projection output of `slices`
    slices needs (raises ValueError otherwise)."""
    u, bt = epilogue.u, epilogue.bt
    if u.shape[0] < rows or u.stride(1) != 1 or u.shape[1] < slices * epilogue.slice_width:
        raise ValueError(f"u {tuple(u.shape)} does not hold {slices} slices for {rows} rows")
    if bt.shape != (epilogue.slice_width, width) or not bt.is_contiguous():
        raise ValueError(f"Bᵀ {tuple(bt.shape)} is not a contiguous [rank, {width}] matrix")
    if epilogue.rows_on.shape[0] < rows or epilogue.rank.numel() != 1:
        raise ValueError("rows_on holds fewer rows than the kernel reads, or rank is not one")
