"""Skinny matmul for decode at small batch: y[M, N] = x[M, K] @ W[N, K]^T with M <= 16.

At batch 1 a decode step is a chain of matrix-vector products that must stream every weight
once; the whole step is bounded by memory bandwidth. Each program owns BLOCK_N output columns
(rows of W) over the full K, so no split-K reduction kernel is needed, and several W tiles are
kept in flight (num_stages) to cover memory latency. x is padded to 16 rows for the tensor-core
dot; compute is free here. The model picks, per weight shape, whichever of this kernel's
configurations and cuBLAS measures fastest (`pick_fastest`), so it is never slower than cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.common.errors import InvalidArgumentError

CONFIGS = ((16, 512, 4, 4), (32, 256, 4, 4), (16, 256, 4, 6), (64, 128, 4, 4))
# One-row configurations of the vector kernel: BLOCK_N below 16 (no tensor-core dot) gives
# narrow matrices (N = 4096) enough programs to keep the memory system busy without split-K.
VECTOR_CONFIGS = (
    (4, 1024, 4, 4), (8, 512, 4, 4), (8, 1024, 4, 3), (2, 2048, 4, 3), (4, 512, 4, 4),
    (2, 1024, 2, 4), (8, 256, 2, 6), (4, 1024, 8, 3), (8, 512, 8, 4),
)  # fmt: skip


@triton.jit
def _skinny_vector_kernel(
    x_ptr, weight_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_mask = columns < n
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    weight_rows = weight_ptr + columns.to(tl.int64)[:, None] * k
    for start in range(0, k, BLOCK_K):
        inner_mask = start + inner < k
        x = tl.load(x_ptr + start + inner, mask=inner_mask, other=0.0).to(tl.float32)
        weight = tl.load(
            weight_rows + start + inner[None, :],
            mask=column_mask[:, None] & inner_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(weight.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + columns, acc.to(out_ptr.dtype.element_ty), mask=column_mask)


@triton.jit
def _skinny_matmul_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    rows,
    n,
    k,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    column_block = tl.program_id(0)
    row_offsets = tl.arange(0, 16)
    row_mask = row_offsets < rows
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    column_mask = columns < n
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    weight_rows = weight_ptr + columns.to(tl.int64)[:, None] * k
    for start in range(0, k, BLOCK_K):
        inner_mask = start + inner < k
        x = tl.load(
            x_ptr + row_offsets[:, None] * k + start + inner[None, :],
            mask=row_mask[:, None] & inner_mask[None, :],
            other=0.0,
        )
        weight = tl.load(
            weight_rows + start + inner[None, :],
            mask=column_mask[:, None] & inner_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(x, tl.trans(weight), acc)
    tl.store(
        out_ptr + row_offsets[:, None] * n + columns[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & column_mask[None, :],
    )


def skinny_matmul(
    x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] = CONFIGS[0]
) -> torch.Tensor:
    """x [M, K] (M <= 16) times weight [N, K] transposed -> [M, N] in x's dtype."""
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_n, block_k, warps, stages = config
    if block_n < 16:
        if rows != 1:
            raise InvalidArgumentError("vector configurations (BLOCK_N < 16) take one row")
        _skinny_vector_kernel[(triton.cdiv(n, block_n),)](
            x, weight, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out
    _skinny_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, rows, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def pick_fastest(weights: list[torch.Tensor], rows: int) -> tuple[int, int, int, int] | None:
    """The fastest configuration for `rows` rows times each of `weights` in turn (as a decode
    step streams every layer's matrix once, so L2 cannot flatter either side), or None when
    cuBLAS wins. All weights share one shape."""
    import triton.testing

    x = torch.randn(rows, weights[0].shape[1], device=weights[0].device, dtype=weights[0].dtype)

    def timed(multiply) -> float:
        def run() -> None:
            for weight in weights:
                multiply(weight)

        return triton.testing.do_bench(run, warmup=5, rep=40, return_mode="median")

    best_time = timed(lambda weight: torch.nn.functional.linear(x, weight))
    best = None
    for config in CONFIGS + (VECTOR_CONFIGS if rows == 1 else ()):
        elapsed = timed(lambda weight, config=config: skinny_matmul(x, weight, config))
        if elapsed < best_time * 0.97:
            best_time, best = elapsed, config
    return best
