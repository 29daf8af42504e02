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
from services.engine.kernels.triton.launch import pdl_options, pdl_prologue

CONFIGS = ((16, 512, 4, 4), (32, 256, 4, 4), (16, 256, 4, 6), (64, 128, 4, 4))
# One-row configurations of the vector kernel: BLOCK_N below 16 (no tensor-core dot) gives
# narrow matrices (N = 4096) enough programs to keep the memory system busy without split-K.
VECTOR_CONFIGS = (
    (4, 1024, 4, 4), (8, 512, 4, 4), (8, 1024, 4, 3), (2, 2048, 4, 3), (4, 512, 4, 4),
    (2, 1024, 2, 4), (8, 256, 2, 6), (4, 1024, 8, 3), (8, 512, 8, 4),
)  # fmt: skip
# One-row configurations of the row-accumulator GEMV (`_gemv_rows_kernel`), marked by a fifth
# element: it keeps a [BLOCK_N, BLOCK_K] float32 accumulator and reduces across K once at the
# end (the vector kernel reduces every iteration, a cross-warp exchange per tile), and reads
# whole 16-byte vectors without masks when K divides evenly (rows past N are clamped to the
# last one and never stored). Small BLOCK_N gives N = 4096 thousands of programs.
GEMV_CONFIGS = (
    (1, 1024, 4, 3, "rows"), (2, 1024, 4, 3, "rows"), (2, 2048, 8, 3, "rows"),
    (4, 1024, 4, 3, "rows"), (4, 512, 4, 4, "rows"), (4, 2048, 8, 2, "rows"),
    (8, 512, 4, 3, "rows"), (8, 1024, 8, 3, "rows"), (2, 512, 2, 4, "rows"),
    (1, 2048, 4, 2, "rows"), (16, 256, 4, 4, "rows"), (4, 1024, 4, 1, "rows"),
)  # fmt: skip


@triton.jit
def _skinny_vector_kernel(
    x_ptr, weight_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
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
def _gemv_rows_kernel(
    x_ptr, weight_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(USE_PDL)
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(columns, n - 1)  # clamped: every load in bounds, no mask on N
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    weight_tile = weight_ptr + rows.to(tl.int64)[:, None] * k + inner[None, :]
    for start in range(0, k, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + start + inner, eviction_policy="evict_last")
            weight = tl.load(weight_tile + start, eviction_policy="evict_first")
        else:
            inner_mask = start + inner < k
            x = tl.load(x_ptr + start + inner, mask=inner_mask, other=0.0)
            weight = tl.load(weight_tile + start, mask=inner_mask[None, :], other=0.0)
        acc += weight.to(tl.float32) * x.to(tl.float32)[None, :]
    total = tl.sum(acc, axis=1)
    tl.store(out_ptr + columns, total.to(out_ptr.dtype.element_ty), mask=columns < n)


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
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
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
    x: torch.Tensor, weight: torch.Tensor, config: tuple = CONFIGS[0]
) -> torch.Tensor:
    """x [M, K] (M <= 16) times weight [N, K] transposed -> [M, N] in x's dtype. config: one
    of CONFIGS (any M), VECTOR_CONFIGS or GEMV_CONFIGS (M = 1)."""
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_n, block_k, warps, stages = config[:4]
    pdl = pdl_options(out.device)
    if len(config) > 4:
        if rows != 1:
            raise InvalidArgumentError("GEMV configurations take one row")
        if not weight.is_contiguous():
            raise InvalidArgumentError("the GEMV kernel needs a contiguous weight")
        _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
            x, weight, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages, **pdl,
        )  # fmt: skip
        return out
    if block_n < 16:
        if rows != 1:
            raise InvalidArgumentError("vector configurations (BLOCK_N < 16) take one row")
        _skinny_vector_kernel[(triton.cdiv(n, block_n),)](
            x, weight, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, num_stages=stages, **pdl,
        )  # fmt: skip
        return out
    _skinny_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, rows, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, **pdl,
    )  # fmt: skip
    return out


def candidates(rows: int) -> tuple[tuple, ...]:
    """Every configuration that can multiply `rows` rows."""
    return CONFIGS + (VECTOR_CONFIGS + GEMV_CONFIGS if rows == 1 else ())


def time_in_graph(run) -> float:
    """Median milliseconds of `run` replayed as one captured CUDA graph, as decode steps run.

    Timing eager launches instead would charge each Triton launch its Python overhead (tens of
    microseconds, longer than a 4096 x 4096 GEMV takes) and so favour cuBLAS unfairly.
    """
    import triton.testing

    run()  # compiles the kernel and creates library handles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    elapsed = triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median")
    del graph
    return elapsed


def pick_fastest(weights: list[torch.Tensor], rows: int) -> tuple | None:
    """The fastest configuration for `rows` rows times each of `weights` in turn (as a decode
    step streams every layer's matrix once, so L2 cannot flatter either side), or None when
    cuBLAS wins. All weights share one shape; each candidate is timed in a CUDA graph."""
    x = torch.randn(rows, weights[0].shape[1], device=weights[0].device, dtype=weights[0].dtype)

    def timed(multiply) -> float:
        def run() -> None:
            for weight in weights:
                multiply(weight)

        return time_in_graph(run)

    best_time = timed(lambda weight: torch.nn.functional.linear(x, weight))
    best = None
    for config in candidates(rows):
        if len(config) > 4 and not weights[0].is_contiguous():
            continue
        elapsed = timed(lambda weight, config=config: skinny_matmul(x, weight, config))
        if elapsed < best_time * 0.97:
            best_time, best = elapsed, config
    return best
