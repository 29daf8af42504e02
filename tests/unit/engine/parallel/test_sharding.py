"""ShardLayout: each rank's heads, KV heads and MLP rows; shapes that cannot split are refused."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.engine.parallel.sharding import ShardLayout, check_divisible


def layout(world_size: int, rank: int, heads: int = 64, kv_heads: int = 8) -> ShardLayout:
    return ShardLayout(
        world_size=world_size,
        rank=rank,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        intermediate_size=28672,
    )


def test_llama_70b_over_two_ranks_splits_heads_and_mlp_in_halves():
    first, second = layout(2, 0), layout(2, 1)
    assert (first.local_heads, first.local_kv_heads, first.kv_replicas) == (32, 4, 1)
    assert first.head_range() == (0, 32) and second.head_range() == (32, 64)
    assert first.kv_head_range() == (0, 4) and second.kv_head_range() == (4, 8)
    assert first.query_rows() == (0, 4096) and second.query_rows() == (4096, 8192)
    assert first.kv_rows() == (0, 512) and second.kv_rows() == (512, 1024)
    assert first.intermediate_rows() == (0, 14336)
    assert second.intermediate_rows() == (14336, 28672)


def test_every_query_head_keeps_its_own_kv_head():
    # Head h attends with KV head h // (heads / kv_heads): that KV head must be on h's rank.
    for world_size in (1, 2, 4, 8, 16):
        for rank in range(world_size):
            shard = layout(world_size, rank, heads=64, kv_heads=8)
            start, stop = shard.kv_head_range()
            group = 64 // 8
            for head in range(*shard.head_range()):
                assert start <= head // group < stop, (world_size, rank, head)


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head():
    shards = [layout(4, rank, heads=4, kv_heads=2) for rank in range(4)]
    assert [s.local_kv_heads for s in shards] == [1, 1, 1, 1]
    assert [s.kv_replicas for s in shards] == [2, 2, 2, 2]
    assert [s.kv_head_range() for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.head_range() for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "world_size", "words"),
    [
        (9, 3, 1536, 2, "9 attention heads"),  # SmolLM2-135M
        (8, 8, 100, 3, "does not divide the 8 attention heads"),
        (8, 8, 30, 4, "MLP width 30"),
        (12, 6, 48, 4, "6 KV heads"),
        (12, 4, 48, 6, "multiple of the KV head count"),
        (4, 2, 32, 0, ">= 1"),
    ],
)
def test_shapes_that_do_not_split_are_refused(heads, kv_heads, intermediate, world_size, words):
    with pytest.raises(InvalidArgumentError, match=words):
        check_divisible(heads, kv_heads, intermediate, world_size)


def test_rank_outside_the_group_is_refused():
    with pytest.raises(InvalidArgumentError, match="rank 2"):
        layout(2, 2)


def test_the_vocabulary_splits_in_equal_slices_padded_at_the_end():
    assert [layout(2, rank).vocab_rows(128256) for rank in (0, 1)] == [(0, 64128), (64128, 128256)]
    assert layout(4, 0).local_vocab_size(1001) == 251
    assert [layout(4, rank).vocab_rows(1001) for rank in range(4)] == [
        (0, 251),
        (251, 502),
        (502, 753),
        (753, 1001),
    ]
    assert [layout(8, rank).vocab_rows(9) for rank in (3, 4, 7)] == [(6, 8), (8, 9), (9, 9)]
