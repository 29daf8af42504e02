"""Paged KV cache bookkeeping: which physical block holds which tokens, shared how many times.

Plain Python, no tensors (the KV tensors live in the model runner). Blocks are fixed-size and
reference-counted. With prefix caching, each full block that has been computed is registered
under a chain hash of (parent hash, adapter id, its tokens): two sequences with the same adapter
and the same leading tokens share those blocks, and different adapters never do (their KV
differs). The adapter id is the adapter's name and file checksum (`Sequence.adapter_id`), so a
name registered again with new files never reuses the old files' blocks.
A cached block whose last user leaves is kept (ref count 0, "evictable") in LRU order and reused
by a later request with the same prefix, or evicted when free blocks run out.

Every block is in exactly one place: the free list (no content), the evictable LRU (cached
content, ref 0), or in use (ref >= 1).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from services.common.errors import FailedPreconditionError
from services.engine.sequence import Sequence


@dataclass
class Block:
    """One physical KV block."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens under block_hash (guards against collisions)
    adapter: str | None = None


def hash_block(parent_hash: int | None, adapter: str | None, token_ids: tuple[int, ...]) -> int:
    """Chain hash of a full block: depends on every token before it and on the adapter."""
    return hash((parent_hash, adapter, token_ids))


class BlockManager:
    """Allocates KV blocks to sequences, with ref counts and an LRU prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise FailedPreconditionError(
                f"the KV cache needs at least one block (num_blocks={num_blocks}, "
                f"block_size={block_size})"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up in the cache
        self.prefix_cache_hits = 0  # of which found

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty ones and evictable cached ones)."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must get so its block table covers `num_tokens` token slots."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    # ---- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks holding `seq`'s leading tokens; return how many tokens they hold.

        Called once when a sequence with no blocks is admitted. At least one token is always left
        to compute, because the step that computes it produces the logits to sample from.
        """
        if seq.block_table:
            raise FailedPreconditionError("match_prefix on a sequence that already has blocks")
        tokens = seq.token_ids
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (len(tokens) - 1) // self.block_size
        parent: int | None = None
        for index in range(max_blocks):
            chunk = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            block_hash = hash_block(parent, seq.adapter_id, chunk)
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.adapter != seq.adapter_id:
                break  # hash collision: treat as a miss
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            parent = block_hash
        seq.num_hashed_blocks = len(seq.block_table)
        seq.last_block_hash = parent
        return len(seq.block_table) * self.block_size

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one admitted request's prompt tokens looked up and found in the cache."""
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s newly full and computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        tokens = seq.token_ids
        for index in range(seq.num_hashed_blocks, num_full):
            chunk = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            block_hash = hash_block(seq.last_block_hash, seq.adapter_id, chunk)
            block = self.blocks[seq.block_table[index]]
            if block_hash not in self.cached and block.block_hash is None:
                block.block_hash = block_hash
                block.token_ids = chunk
                block.adapter = seq.adapter_id
                self.cached[block_hash] = block.block_id
            seq.last_block_hash = block_hash
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    # ---- allocation -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to cover `num_tokens` slots; all or nothing."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def may_append(self, seq: Sequence) -> bool:
        """Whether one more token slot (a decode step) can be given to `seq`."""
        return self.can_allocate(self.num_new_blocks(seq, seq.num_computed_tokens + 1))

    def append_slot(self, seq: Sequence) -> bool:
        """Give `seq` the slot for its next token (a new block at a block boundary)."""
        return self.allocate(seq, seq.num_computed_tokens + 1)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; cached blocks are kept as evictable, newest last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise FailedPreconditionError(f"block {block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.last_block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (blocks in use keep working, uncached)."""
        for block in self.blocks:
            if block.block_hash is not None:
                self.cached.pop(block.block_hash, None)
                block.block_hash = None
                block.token_ids = ()
        self.free_block_ids.extend(self.evictable)
        self.evictable.clear()

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
            block.adapter = None
        self.blocks[block_id].ref_count = 1
        return block_id
