"""The one-shot all-reduce's set-up decision and routing, on CPU (the kernels run on GPUs:
tests/gpu/test_tensor_parallel.py): every rank takes the same decision, any failure leaves
the group on its collective library, and only sums that fit go through the buffers."""

from __future__ import annotations

import threading

import pytest
import torch

from services.engine.parallel import symmetric
from services.engine.parallel.channel import StepChannel
from services.engine.parallel.group import TensorParallelRank
from tests.unit.engine.parallel.test_tensor_parallel_cpu import ThreadGroup


def on_two_ranks(call) -> list:
    """`call(rank, agree)` on two threads agreeing through a shared minimum; each rank's result."""
    barrier, shared = threading.Barrier(2), {}
    groups = [ThreadGroup(rank, 2, shared, barrier) for rank in (0, 1)]
    results: list = [None, None]

    def run(rank: int) -> None:
        results[rank] = call(rank, groups[rank].min_int)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def enable_on_two_ranks() -> list[tuple[object, str | None]]:
    """symmetric.enable on two ranks (threads); each rank's result."""
    return on_two_ranks(
        lambda rank, agree: symmetric.enable(
            group_name="0",
            rank=rank,
            world_size=2,
            device=torch.device("cuda", rank),
            dtype=torch.bfloat16,
            agree=agree,
        )
    )


def test_a_cpu_device_has_no_symmetric_memory():
    assert symmetric.unavailable(torch.device("cpu"), 2) == "device cpu"


def test_one_rank_that_cannot_keeps_every_rank_on_the_library(monkeypatch):
    monkeypatch.setattr(
        symmetric, "unavailable", lambda device, size: "no peer" if device.index == 1 else None
    )
    built = []
    monkeypatch.setattr(symmetric, "SymmetricAllReduce", lambda *a: built.append(a))
    results = enable_on_two_ranks()
    assert results[0] == (None, "another rank cannot use symmetric memory")
    assert results[1] == (None, "no peer")
    assert built == []  # nobody entered the collective set-up


def test_a_failed_set_up_or_check_on_one_rank_is_agreed_on(monkeypatch):
    monkeypatch.setattr(symmetric, "unavailable", lambda device, size: None)
    monkeypatch.setattr(symmetric, "use_cuda_backend", lambda: None)

    class Buffers:
        def __init__(self, group_name, device, dtype, max_bytes):
            if device.index == 0:
                raise RuntimeError("rendezvous failed")

    monkeypatch.setattr(symmetric, "SymmetricAllReduce", Buffers)
    monkeypatch.setattr(symmetric, "check", lambda *a: None)
    results = enable_on_two_ranks()
    assert results[0][0] is None and "RuntimeError: rendezvous failed" in results[0][1]
    assert results[1] == (None, "another rank's check failed")


def test_every_rank_checked_gets_the_all_reduce(monkeypatch):
    monkeypatch.setattr(symmetric, "unavailable", lambda device, size: None)
    monkeypatch.setattr(symmetric, "use_cuda_backend", lambda: None)
    monkeypatch.setattr(symmetric, "SymmetricAllReduce", lambda *a: "buffers")
    monkeypatch.setattr(symmetric, "check", lambda *a: None)
    assert enable_on_two_ranks() == [("buffers", None), ("buffers", None)]


class FakeBuffers:
    """What TensorParallelRank.all_reduce asks of the one-shot path: fits, then the sum."""

    max_bytes = 64

    def __init__(self) -> None:
        self.turns: list[int] = []

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= self.max_bytes

    def __call__(self, tensor: torch.Tensor, turn: int) -> torch.Tensor:
        self.turns.append(turn)
        return tensor * 2


@pytest.fixture
def lone_rank():
    writer = StepChannel.create(readers=1)
    writer.unlink()
    sums = []

    class Group(ThreadGroup):
        def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
            sums.append(tensor.numel())
            return tensor

    rank = TensorParallelRank(Group(0, 1, {}, threading.Barrier(1)), writer)
    yield rank, sums
    writer.close()


def test_small_sums_take_the_buffers_in_turn_and_large_ones_the_library(lone_rank):
    rank, library_sums = lone_rank
    buffers = FakeBuffers()
    rank.custom = buffers
    small = torch.ones(4)
    assert torch.equal(rank.all_reduce(small, 0), small * 2)
    assert torch.equal(rank.all_reduce(small, 1), small * 2)
    large = torch.ones(64)
    assert rank.all_reduce(large, 0) is large
    assert buffers.turns == [0, 1] and library_sums == [64]
    assert "one-shot all-reduce" in rank.all_reduce_path


def test_turned_off_the_sums_stay_on_the_library(lone_rank):
    rank, _ = lone_rank
    rank.want_custom_all_reduce = False
    rank.enable_custom_all_reduce(torch.bfloat16)
    assert rank.custom is None and rank.custom_off_reason == "turned off"
    assert rank.all_reduce_path == "gloo all-reduce"
