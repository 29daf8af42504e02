"""Row-parallel sums left to the norms that read them, and the fused sum + norm's set-up
decision, on CPU (the kernel runs on GPUs: tests/gpu/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from services.common.protocol.dummy_shapes import dummy_config
from services.engine.layers.norm import RMSNorm
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaForCausalLM
from services.engine.parallel import sum_norm
from services.engine.parallel.weights import RowParallel, defer_row_sums, wrap_row_parallel
from tests.unit.engine.parallel.test_symmetric import (
    lone_rank,  # noqa: F401 - fixture
    on_two_ranks,
)


def tiny_model() -> LlamaForCausalLM:
    config = ModelConfig.from_dict({**dummy_config("tiny"), "num_hidden_layers": 3}, name="tiny")
    return LlamaForCausalLM(config)


class Recorder:
    """An InputSum that says which turn bound it and doubles what it sums."""

    def __init__(self, turn: int, fused: bool = False) -> None:
        self.turn, self.fused = turn, fused
        self.calls: list[str] = []

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("sum")
        return x * 2

    def sum_norm(self, x, residual, weight, eps):
        self.calls.append("sum_norm")
        return (torch.full_like(x, -1.0), torch.full_like(x, -2.0)) if self.fused else None


def test_each_sum_goes_to_the_norm_that_reads_it():
    model = tiny_model()
    wrap_row_parallel(model, lambda tensor, turn: tensor)
    assert defer_row_sums(model, Recorder) == 6
    layers = model.model.layers
    assert layers[0].input_layernorm.input_sum is None  # it reads the embeddings
    for index, layer in enumerate(layers):
        assert layer.self_attn.o_proj.deferred and layer.mlp.down_proj.deferred
        assert layer.post_attention_layernorm.input_sum.turn == 0  # o_proj's sum
        following = layers[index + 1].input_layernorm if index + 1 < 3 else model.model.norm
        assert following.input_sum.turn == 1  # down_proj's sum


def test_a_model_without_row_parallel_projections_keeps_its_norms():
    model = tiny_model()
    assert defer_row_sums(model, Recorder) == 0
    assert all(
        module.input_sum is None for module in model.modules() if isinstance(module, RMSNorm)
    )


def test_a_deferred_projection_returns_its_partial_product():
    sums = []
    projection = RowParallel(torch.nn.Linear(4, 4), lambda t, turn: sums.append(turn) or t * 3)
    x = torch.randn(2, 4)
    partial = projection.inner(x)
    assert torch.allclose(projection(x), partial * 3) and sums == [0]
    projection.deferred = True
    assert torch.equal(projection(x), partial) and sums == [0]


def test_a_norm_finishes_the_sum_fused_or_else_sums_then_normalizes():
    norm = RMSNorm(8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    norm.input_sum = Recorder(0, fused=True)
    normed, summed = norm(x, residual)
    assert torch.equal(normed, torch.full_like(x, -1.0)) and torch.equal(
        summed, -2 * x.new_ones(3, 8)
    )
    norm.input_sum = Recorder(0)
    normed, summed = norm(x, residual)
    assert norm.input_sum.calls == ["sum_norm", "sum"]
    reference = RMSNorm(8)
    want_normed, want_summed = reference(x * 2, residual)
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)


def test_the_expected_values_are_the_norm_of_the_rounded_sum():
    partial = torch.randn(2, 16).to(torch.bfloat16)
    residual = torch.randn(2, 16).to(torch.bfloat16)
    weight = torch.rand(16).to(torch.bfloat16)
    normed, summed = sum_norm.expected(partial, 2, residual, weight, 1e-5)
    total = (partial.float() * 3).to(torch.bfloat16)  # ranks' parts: partial x 1 and x 2
    assert torch.equal(summed, (total.float() + residual.float()).to(torch.bfloat16))
    values = summed.float()
    want = values / values.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * weight.float()
    assert torch.allclose(normed.float(), want, rtol=1e-2)


# ---- set-up: every rank takes the same decision ---------------------------------------------
def enable_on_two_ranks(monkeypatch) -> list:
    monkeypatch.setattr(sum_norm.symmetric, "use_cuda_backend", lambda: None)
    monkeypatch.setattr(sum_norm, "resident_rows", lambda device, rows: rows - device.index)
    return on_two_ranks(
        lambda rank, agree: sum_norm.enable(
            group_name="0",
            rank=rank,
            world_size=2,
            device=torch.device("cuda", rank),
            dtype=torch.bfloat16,
            hidden_size=16,
            agree=agree,
        )
    )


class Built:
    """Stands for FusedSumNorm: records its rows; rank `failing` fails to set up."""

    failing = -1
    compiled: list[int] = []

    def __init__(self, group_name, rank, world_size, device, dtype, hidden_size, max_rows):
        if rank == self.failing:
            raise RuntimeError("rendezvous failed")
        self.rank, self.max_rows = rank, max_rows

    def compile(self) -> None:
        Built.compiled.append(self.rank)


def test_one_rank_without_symmetric_memory_keeps_every_rank_unfused(monkeypatch):
    monkeypatch.setattr(
        sum_norm.symmetric, "unavailable", lambda d, n: "no peer" if d.index == 1 else None
    )
    monkeypatch.setattr(sum_norm, "FusedSumNorm", lambda *a: pytest.fail("set up anyway"))
    results = enable_on_two_ranks(monkeypatch)
    assert results == [(None, "another rank cannot use symmetric memory"), (None, "no peer")]


def test_a_rank_that_fails_to_set_up_launches_nothing_anywhere(monkeypatch):
    monkeypatch.setattr(sum_norm.symmetric, "unavailable", lambda d, n: None)
    monkeypatch.setattr(Built, "failing", 1)
    monkeypatch.setattr(Built, "compiled", [])
    monkeypatch.setattr(sum_norm, "FusedSumNorm", Built)
    monkeypatch.setattr(sum_norm, "check", lambda fused: pytest.fail("checked anyway"))
    results = enable_on_two_ranks(monkeypatch)
    assert results[0] == (None, "another rank's set-up failed")
    assert results[1][0] is None and "RuntimeError: rendezvous failed" in results[1][1]
    assert Built.compiled == [0]


def test_a_failed_check_on_one_rank_is_agreed_on_and_rows_are_the_smallest(monkeypatch):
    monkeypatch.setattr(sum_norm.symmetric, "unavailable", lambda d, n: None)
    monkeypatch.setattr(sum_norm, "FusedSumNorm", Built)
    monkeypatch.setattr(sum_norm, "check", lambda fused: "differs" if fused.rank == 0 else None)
    results = enable_on_two_ranks(monkeypatch)
    assert results == [(None, "differs"), (None, "another rank's check failed")]
    monkeypatch.setattr(sum_norm, "check", lambda fused: None)
    results = enable_on_two_ranks(monkeypatch)
    assert [fused.max_rows for fused, reason in results] == [63, 63]  # GPU 1 holds fewer


# ---- routing on a rank ----------------------------------------------------------------------
class FakeFused:
    max_rows = 4

    def __init__(self) -> None:
        self.turns: list[int] = []

    def fits(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.max_rows

    def __call__(self, x, residual, weight, eps, turn):
        self.turns.append(turn)
        return x, x


def test_decode_sized_sums_are_fused_and_larger_ones_are_not(lone_rank):  # noqa: F811
    rank, _ = lone_rank
    rank.fused = FakeFused()
    small, large = torch.ones(4, 8), torch.ones(5, 8)
    weight = torch.ones(8)
    assert rank.fused_sum_norm(small, None, weight, 1e-5, 1) == (small, small)
    assert rank.fused_sum_norm(large, None, weight, 1e-5, 0) is None
    assert rank.fused.turns == [1]
    assert "sums of up to 4 rows fused with the residual add and RMSNorm" in rank.all_reduce_path


def test_turned_off_no_sum_is_fused(lone_rank):  # noqa: F811
    rank, _ = lone_rank
    rank.want_fused_sum_norm = False
    rank.enable_fused_sum_norm(torch.bfloat16, 16)
    assert rank.fused is None and rank.fused_off_reason == "turned off"
    assert rank.fused_sum_norm(torch.ones(1, 16), None, torch.ones(16), 1e-5, 0) is None
