"""Which base projections may add x Wᵀ onto LoRA deltas already written (LoRARuntime.project's
long-run path): a plain matmul of x's dtype, never one with a bias or a tuned kernel."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.backends.cuda_fast_path import TunedLinear
from services.engine.lora.runtime import plain_weight


def test_a_linear_without_bias_is_plain_in_its_dtype_only():
    linear = nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    assert plain_weight(linear, x) is linear.weight
    assert plain_weight(linear, x.to(torch.bfloat16)) is None
    assert plain_weight(linear, torch.randn(3, 6)) is None  # not its input width
    assert plain_weight(nn.Linear(8, 4), x) is None  # a bias


def test_any_other_module_or_callable_is_not():
    assert plain_weight(lambda x: x, torch.randn(2, 8)) is None
    assert plain_weight(nn.Sequential(nn.Linear(8, 4, bias=False)), torch.randn(2, 8)) is None


def test_a_tuned_linear_is_plain_only_at_row_counts_left_to_cublas():
    tuned = TunedLinear(nn.Linear(8, 4, bias=False), "qkv")
    tuned.choices[16] = ("a tuned kernel",)
    assert plain_weight(tuned, torch.randn(2048, 8)) is tuned.weight
    assert plain_weight(tuned, torch.randn(16, 8)) is None
    tuned.active = False  # every row count back on cuBLAS
    assert plain_weight(tuned, torch.randn(16, 8)) is tuned.weight
    assert plain_weight(TunedLinear(nn.Linear(8, 4), "qkv"), torch.randn(2048, 8)) is None
