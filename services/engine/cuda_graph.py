"""CUDA graphs for decode, one per batch-size bucket.

A decode step is hundreds of small kernel launches; replaying a captured graph turns them into
one launch. `step(batch_size)` must read only static input buffers and write static outputs
(its owner keeps those, filling rows past the real batch with padding); it is captured once
per bucket, largest first, all graphs sharing one memory pool. replay(n) runs the smallest
bucket that holds n rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from services.common.errors import InvalidArgumentError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeCudaGraphs:
    """Captured decode steps keyed by batch-size bucket."""

    def __init__(self, step: Callable[[int], None], buckets: Sequence[int]) -> None:
        if not buckets or min(buckets) < 1:
            raise InvalidArgumentError("CUDA graph buckets must be positive batch sizes")
        self._step = step
        self.buckets = tuple(sorted(set(int(size) for size in buckets)))
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def capture(self) -> None:
        """Warm up and capture every bucket (largest first, so smaller ones reuse its memory)."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in reversed(self.buckets):
                self._step(size)  # compiles kernels and sets up library handles
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest captured bucket holding batch_size rows, or None when too large."""
        for size in self.buckets:
            if size >= batch_size:
                return size
        return None

    def replay(self, batch_size: int) -> int:
        """Run the graph of batch_size's bucket; returns the bucket size."""
        bucket = self.bucket_for(batch_size)
        if bucket is None or bucket not in self._graphs:
            raise InvalidArgumentError(f"no captured CUDA graph holds a batch of {batch_size}")
        self._graphs[bucket].replay()
        return bucket
