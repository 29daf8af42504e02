"""DecodeCudaGraphs' bucket policy (CPU; capture and replay run in tests/gpu)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.engine.cuda_graph import DecodeCudaGraphs


def test_smallest_bucket_holding_the_batch_is_chosen() -> None:
    graphs = DecodeCudaGraphs(lambda size: None, (8, 1, 4, 2, 4))
    assert graphs.buckets == (1, 2, 4, 8)
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert graphs.bucket_for(9) is None
    assert graphs.max_batch_size == 8


def test_bad_buckets_and_uncaptured_replay_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        DecodeCudaGraphs(lambda size: None, ())
    with pytest.raises(InvalidArgumentError):
        DecodeCudaGraphs(lambda size: None, (0, 4))
    graphs = DecodeCudaGraphs(lambda size: None, (1, 2))
    with pytest.raises(InvalidArgumentError):
        graphs.replay(3)
    with pytest.raises(InvalidArgumentError):
        graphs.replay(1)  # not captured yet
