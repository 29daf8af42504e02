"""Where swapped-out KV blocks go in host memory, and how much of it an engine takes.

Plain Python (the scheduler's side of services/engine/kv_swap.py, which does the copies):
`HostBlocks` hands out contiguous extents of host blocks, one per swapped-out sequence, so each
sequence's blocks leave and return in one copy per KV tensor.
"""

from __future__ import annotations

import bisect
import os

GIB = 1024**3
# Default swap space on a GPU with LoRA time-slicing: this many GiB, at most an eighth of RAM.
DEFAULT_SWAP_SPACE_GIB = 16.0


# Where a container's memory limit is read (cgroup v2, then v1); "max" or a huge v1 value: none.
CGROUP_MEMORY_LIMITS = (
    "/sys/fs/cgroup/memory.max",
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",
)


def host_memory_bytes(limit_files: tuple[str, ...] = CGROUP_MEMORY_LIMITS) -> int | None:
    """The memory this process may use: the host's RAM, or its container's limit if lower
    (a pod's limit, which pinned memory counts against); None where neither can be read."""
    try:
        total: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = None
    for path in limit_files:
        try:
            with open(path) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = int(text)
            total = limit if total is None else min(total, limit)
        break
    return total


def default_swap_space_gib(*, device_type: str, time_sliced: bool) -> float:
    """The swap space an engine gets when none is configured: on a GPU whose adapters take
    turns in slots (the only way sequences pause), DEFAULT_SWAP_SPACE_GIB or an eighth of the
    memory the process may use (`host_memory_bytes`) if less; else none (a CPU's KV cache is
    host memory already)."""
    if device_type != "cuda" or not time_sliced:
        return 0.0
    memory = host_memory_bytes()
    if memory is None:
        return 0.0
    return min(DEFAULT_SWAP_SPACE_GIB, memory / 8 / GIB)


class HostBlocks:
    """Allocator of host KV blocks in contiguous extents (first fit, freed extents merged)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("host swap space needs at least one block")
        self.num_blocks = num_blocks
        self._starts: list[int] = [0]  # free extents, sorted by start
        self._lengths: list[int] = [num_blocks]
        self.num_free = num_blocks

    def allocate(self, count: int) -> int | None:
        """The start of `count` free blocks in a row, now taken; None if no extent is that long."""
        if count < 1:
            raise ValueError("an extent holds at least one block")
        for index, length in enumerate(self._lengths):
            if length >= count:
                start = self._starts[index]
                if length == count:
                    del self._starts[index], self._lengths[index]
                else:
                    self._starts[index] += count
                    self._lengths[index] -= count
                self.num_free -= count
                return start
        return None

    def free(self, start: int, count: int) -> None:
        """Give back an extent taken by `allocate`."""
        index = bisect.bisect_left(self._starts, start)
        if index < len(self._starts) and self._starts[index] < start + count:
            raise ValueError(f"host blocks {start}..{start + count - 1} are free already")
        if index and self._starts[index - 1] + self._lengths[index - 1] > start:
            raise ValueError(f"host blocks {start}..{start + count - 1} are free already")
        self.num_free += count
        joins_next = index < len(self._starts) and self._starts[index] == start + count
        joins_prev = index > 0 and self._starts[index - 1] + self._lengths[index - 1] == start
        if joins_prev and joins_next:
            self._lengths[index - 1] += count + self._lengths[index]
            del self._starts[index], self._lengths[index]
        elif joins_prev:
            self._lengths[index - 1] += count
        elif joins_next:
            self._starts[index] = start
            self._lengths[index] += count
        else:
            self._starts.insert(index, start)
            self._lengths.insert(index, count)

    @property
    def largest_extent(self) -> int:
        return max(self._lengths, default=0)
