"""The arithmetic of tensor parallelism: which heads, rows and columns each rank holds.

Megatron-style split of a Llama block over N ranks: the fused q/k/v and gate/up projections are
column-parallel (each rank computes its own heads and its own slice of the intermediate
size), o_proj and down_proj are row-parallel (each rank multiplies its slice of the input
columns; one all-reduce sums the partial outputs). The LM head is vocabulary-parallel: each
rank holds an equal slice of the vocabulary's rows (the vocabulary padded to a multiple of
the ranks), computes those logits, and one all-gather joins them. Embedding and norms are
replicated. The paged KV cache follows the KV heads: each rank caches only its own.

Grouped-query attention with fewer KV heads than ranks replicates each KV head over
N / num_kv_heads ranks (all query heads of a rank share one KV head); counts that do not divide
are refused with a clear error. Plain Python: no torch, unit-tested in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import InvalidArgumentError


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a model's attention heads and MLP width."""

    world_size: int
    rank: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    def __post_init__(self) -> None:
        check_divisible(self.num_heads, self.num_kv_heads, self.intermediate_size, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"rank {self.rank} outside 0..{self.world_size - 1}")

    @property
    def local_heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        """KV heads on this rank (1 when KV heads are replicated)."""
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless there are fewer KV heads than ranks)."""
        return max(1, self.world_size // self.num_kv_heads)

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.world_size

    def head_range(self) -> tuple[int, int]:
        """[start, stop) of this rank's query heads."""
        start = self.rank * self.local_heads
        return start, start + self.local_heads

    def kv_head_range(self) -> tuple[int, int]:
        """[start, stop) of this rank's KV heads: the ones its query heads attend with."""
        start = (self.rank // self.kv_replicas) * self.local_kv_heads
        return start, start + self.local_kv_heads

    def query_rows(self) -> tuple[int, int]:
        """[start, stop) rows of q_proj (and columns of o_proj) on this rank."""
        start, stop = self.head_range()
        return start * self.head_dim, stop * self.head_dim

    def kv_rows(self) -> tuple[int, int]:
        """[start, stop) rows of k_proj and of v_proj on this rank."""
        start, stop = self.kv_head_range()
        return start * self.head_dim, stop * self.head_dim

    def intermediate_rows(self) -> tuple[int, int]:
        """[start, stop) rows of gate_proj and up_proj (and columns of down_proj)."""
        start = self.rank * self.local_intermediate_size
        return start, start + self.local_intermediate_size

    def local_vocab_size(self, vocab_size: int) -> int:
        """LM head rows on every rank: the vocabulary padded to a multiple of the ranks, split."""
        return -(-vocab_size // self.world_size)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """[start, stop) of this rank's LM head rows within the real vocabulary (the last
        ranks' slices may be short or empty: their padding rows produce no token)."""
        width = self.local_vocab_size(vocab_size)
        start = min(self.rank * width, vocab_size)
        return start, min(start + width, vocab_size)


def check_divisible(
    num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int
) -> None:
    """Refuse a tensor-parallel size the model's shape cannot be split by."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"tensor_parallel_size must be an integer >= 1: {world_size!r}")
    if num_heads % world_size:
        raise InvalidArgumentError(
            f"tensor_parallel_size {world_size} does not divide the {num_heads} attention heads"
        )
    if intermediate_size % world_size:
        raise InvalidArgumentError(
            f"tensor_parallel_size {world_size} does not divide the MLP width {intermediate_size}"
        )
    if num_kv_heads >= world_size and num_kv_heads % world_size:
        raise InvalidArgumentError(
            f"tensor_parallel_size {world_size} does not divide the {num_kv_heads} KV heads"
        )
    if num_kv_heads < world_size and world_size % num_kv_heads:
        raise InvalidArgumentError(
            f"{num_kv_heads} KV heads cannot be replicated evenly over {world_size} ranks "
            "(the tensor-parallel size must be a multiple of the KV head count)"
        )
