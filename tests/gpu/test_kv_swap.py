"""KV blocks to pinned host memory and back on a GPU: the copies are issued without waiting,
in order with the work around them on the stream, and return every byte."""

from __future__ import annotations

import pytest
import torch

from services.engine.forward_batch import ScheduledBatch
from services.engine.kv_swap import KVSwapper
from services.engine.scheduler import SchedulerOutput


@pytest.mark.parametrize("stacked", [True, False], ids=["one-tensor", "per-layer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_swapped_out_and_overwritten_come_back_exactly(dtype, stacked) -> None:
    shape = (64, 16, 8, 128)  # blocks, block size, KV heads, head dim
    whole = torch.randn((4, 2, *shape), device="cuda").to(dtype)  # layers, keys and values
    layers = [(whole[layer, 0], whole[layer, 1]) for layer in range(4)]
    if not stacked:
        layers = [(key.clone(), value.clone()) for key, value in layers]
    original = [(key.clone(), value.clone()) for key, value in layers]
    swapper = KVSwapper(layers, num_host_blocks=32, stacked=whole if stacked else None)
    assert all(host.is_pinned() for host in swapper._host)
    out_blocks, in_blocks = [40, 3, 17, 9, 60], [1, 2, 50, 51, 52]
    swapper.apply(SchedulerOutput(batch=ScheduledBatch(), swap_out=[(out_blocks, 7)]))
    for key, value in layers:  # the next step reuses the freed blocks at once, same stream
        key.view(torch.uint8)[out_blocks] = 0
        value.view(torch.uint8)[out_blocks] = 0
    swapper.apply(SchedulerOutput(batch=ScheduledBatch(), swap_in=[(7, in_blocks)]))
    torch.cuda.synchronize()
    for (key, value), (key0, value0) in zip(layers, original, strict=True):
        assert torch.equal(key.view(torch.uint8)[in_blocks], key0.view(torch.uint8)[out_blocks])
        assert torch.equal(value.view(torch.uint8)[in_blocks], value0.view(torch.uint8)[out_blocks])
