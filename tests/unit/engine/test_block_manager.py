"""BlockManager: allocation, ref counts, prefix caching by adapter, LRU eviction, invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.protocol.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence

_ids = iter(range(10**9))


def make_seq(tokens: list[int], adapter: str | None = None) -> Sequence:
    return Sequence(next(_ids), "r", tokens, SamplingParams(max_tokens=4), adapter=adapter)


def compute_all(manager: BlockManager, seq: Sequence) -> None:
    """Allocate and mark every token of `seq` computed, as a finished prefill would."""
    assert manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.register_computed_blocks(seq)


def check_invariants(manager: BlockManager, live: list[Sequence]) -> None:
    used = [b for b in manager.blocks if b.ref_count > 0]
    assert all(b.ref_count >= 0 for b in manager.blocks)
    free = list(manager.free_block_ids)
    evictable = list(manager.evictable)
    assert len(free) + len(evictable) + len(used) == manager.num_blocks
    places = free + evictable + [b.block_id for b in used]
    assert len(set(places)) == manager.num_blocks, "a block is in two places"
    assert all(manager.blocks[i].ref_count == 0 for i in free + evictable)
    assert all(manager.blocks[i].block_hash is not None for i in evictable)
    references: dict[int, int] = {}
    for seq in live:
        for block_id in seq.block_table:
            references[block_id] = references.get(block_id, 0) + 1
    assert references == {b.block_id: b.ref_count for b in used}
    for block_hash, block_id in manager.cached.items():
        assert manager.blocks[block_id].block_hash == block_hash


def test_allocate_and_free_round_trip():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert manager.num_new_blocks(seq, 10) == 3
    assert manager.allocate(seq, 10)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    seq.num_computed_tokens = 10
    assert manager.may_append(seq)
    assert manager.append_slot(seq)  # slot 11 still in block 3
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    assert manager.append_slot(seq)  # slot 13 needs a new block
    assert len(seq.block_table) == 4
    manager.free(seq)
    assert manager.num_free_blocks == 8 and seq.block_table == []


def test_allocate_is_all_or_nothing():
    manager = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(list(range(20)))
    assert not manager.can_allocate(5)
    assert not manager.allocate(seq, 20)
    assert seq.block_table == [] and manager.num_free_blocks == 3


def test_prefix_blocks_shared_with_ref_counts():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(1, 14)))  # 3 full blocks + 1 token
    compute_all(manager, first)
    second = make_seq(list(range(1, 14)) + [99, 98])
    assert manager.match_prefix(second) == 12
    assert second.block_table == first.block_table[:3]
    assert all(manager.blocks[b].ref_count == 2 for b in second.block_table)
    check_invariants(manager, [first, second])
    manager.free(first)
    assert all(manager.blocks[b].ref_count == 1 for b in second.block_table)
    manager.free(second)
    check_invariants(manager, [])
    assert manager.num_free_blocks == 16


def test_full_match_leaves_one_token_to_compute():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(1, 9)))  # exactly 2 blocks
    compute_all(manager, first)
    manager.free(first)
    again = make_seq(list(range(1, 9)))
    assert manager.match_prefix(again) == 4  # the last block is recomputed for its logits


def test_adapters_never_share_blocks():
    manager = BlockManager(num_blocks=16, block_size=4)
    base = make_seq(list(range(1, 10)))
    compute_all(manager, base)
    other = make_seq(list(range(1, 10)), adapter="lora-a")
    assert manager.match_prefix(other) == 0
    compute_all(manager, other)
    same_adapter = make_seq(list(range(1, 10)), adapter="lora-a")
    assert manager.match_prefix(same_adapter) == 8
    assert set(same_adapter.block_table) <= set(other.block_table)
    assert not set(same_adapter.block_table) & set(base.block_table)


def test_cached_blocks_survive_free_until_space_is_needed():
    manager = BlockManager(num_blocks=4, block_size=2)
    old = make_seq([1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    compute_all(manager, old)
    manager.free(old)
    assert len(manager.evictable) == 2 and manager.num_free_blocks == 4
    newer = make_seq([7, 8, 9])
    compute_all(manager, newer)  # takes empty blocks first, keeps the cached ones
    manager.free(newer)
    again = make_seq([1, 2, 3, 4, 6])
    assert manager.match_prefix(again) == 4
    assert manager.num_free_blocks == 2
    big = make_seq(list(range(20, 28)))
    assert not manager.allocate(big, 8)  # 4 blocks needed, 2 held by the match
    manager.free(again)
    assert manager.allocate(big, 8)  # now evicts every cached block
    assert not manager.cached and manager.num_free_blocks == 0


def test_eviction_order_is_least_recently_used():
    manager = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 0])
    compute_all(manager, a)
    manager.free(a)  # block [1,2] cached, evictable
    b = make_seq([3, 4, 0])
    compute_all(manager, b)
    manager.free(b)  # block [3,4] cached, newer
    filler = make_seq([50, 51, 52])
    assert manager.allocate(filler, 3)  # needs 2 blocks: the empty one and the LRU one ([1,2])
    assert manager.match_prefix(make_seq([1, 2, 0])) == 0
    assert manager.match_prefix(make_seq([3, 4, 0])) == 2


def test_prefix_caching_disabled_never_matches():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3, 4, 5])
    compute_all(manager, seq)
    manager.free(seq)
    assert manager.match_prefix(make_seq([1, 2, 3, 4, 5])) == 0
    assert not manager.evictable


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "grow", "free", "compute"]),
            st.lists(st.integers(1, 4), min_size=1, max_size=12),
            st.sampled_from([None, "x"]),
            st.integers(0, 50),
        ),
        max_size=40,
    )
)
def test_invariants_hold_under_random_operations(operations):
    manager = BlockManager(num_blocks=10, block_size=2)
    live: list[Sequence] = []
    for action, tokens, adapter, pick in operations:
        if action == "add":
            seq = make_seq(tokens, adapter)
            cached = manager.match_prefix(seq)
            if manager.allocate(seq, seq.num_tokens):
                seq.num_computed_tokens = cached
                live.append(seq)
            else:
                manager.free(seq)
        elif live:
            seq = live[pick % len(live)]
            if action == "grow":
                seq.token_ids.extend(tokens)
                manager.allocate(seq, seq.num_tokens)
            elif action == "compute":
                seq.num_computed_tokens = min(seq.num_tokens, len(seq.block_table) * 2)
                manager.register_computed_blocks(seq)
            else:
                manager.free(seq)
                live.remove(seq)
        check_invariants(manager, live)
    for seq in live:
        manager.free(seq)
    check_invariants(manager, [])
    assert manager.num_free_blocks == manager.num_blocks
