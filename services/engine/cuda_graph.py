"""CUDA graphs for decode, one per batch-size bucket.

A decode step is hundreds of small kernel launches; replaying a captured graph turns them into
one launch. `step(batch_size)` must read only static input buffers and write static outputs
(its owner keeps those, filling rows past the real batch with padding); it is captured once
per bucket, largest first, all graphs sharing one memory pool. replay(n) runs the smallest
bucket that holds n rows.

A model can be captured in more than one variant: with LoRA bound, "lora" graphs hold the
adapter kernels and the plain ones ("base") do not, so a step without adapter rows replays a
graph that does no LoRA work at all; a variant may cover only the smaller buckets.
`select_variant(bucket)` (set by the owner) picks per replay.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from services.common.errors import InvalidArgumentError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
BASE = "base"


def bucket_for(buckets: Sequence[int], batch_size: int) -> int | None:
    """The smallest of `buckets` (ascending) holding batch_size rows, or None when too large."""
    for size in buckets:
        if size >= batch_size:
            return size
    return None


class DecodeCudaGraphs:
    """Captured decode steps keyed by batch-size bucket."""

    def __init__(self, step: Callable[[int], None], buckets: Sequence[int]) -> None:
        if not buckets or min(buckets) < 1:
            raise InvalidArgumentError("CUDA graph buckets must be positive batch sizes")
        self._step = step
        self.buckets = tuple(sorted(set(int(size) for size in buckets)))
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.select_variant: Callable[[int], str] = lambda bucket: BASE
        self.replays: Counter[str] = Counter()  # per variant

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(sorted({variant for variant, _ in self._graphs}))

    def capture(self, variant: str = BASE, max_size: int | None = None) -> None:
        """Warm up and capture every bucket (up to max_size; largest first, so smaller ones
        reuse its memory) as `variant`, replacing that variant's graphs; others stay."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        pool = self._pool
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        sizes = [size for size in self.buckets if max_size is None or size <= max_size]
        with torch.cuda.stream(side):
            for size in reversed(sizes):
                self._step(size)  # compiles kernels and sets up library handles
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for size in reversed(sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(size)
            self._graphs[variant, size] = graph
        torch.cuda.synchronize()

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest captured bucket holding batch_size rows, or None when too large."""
        return bucket_for(self.buckets, batch_size)

    def has(self, variant: str, bucket: int) -> bool:
        return (variant, bucket) in self._graphs

    def drop(self, variant: str) -> None:
        """Forget `variant`'s graphs (replays then fall back to the base graphs)."""
        for key in [key for key in self._graphs if key[0] == variant]:
            del self._graphs[key]

    def clear(self) -> None:
        """Forget every graph (their memory pools go with them)."""
        self._graphs.clear()

    def replay(self, batch_size: int) -> int:
        """Run the graph of batch_size's bucket in the selected variant; returns the bucket."""
        bucket = self.bucket_for(batch_size)
        variant = self.select_variant(bucket) if bucket is not None else BASE
        graph = None if bucket is None else self._graphs.get((variant, bucket))
        if graph is None:
            raise InvalidArgumentError(f"no captured CUDA graph holds a batch of {batch_size}")
        graph.replay()
        self.replays[variant] += 1
        return bucket
