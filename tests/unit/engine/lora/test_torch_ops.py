"""The CPU LoRA math (segment loop, slot-grouped, native kernel) against a plain per-row loop."""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels.cpu import cpu_native
from services.engine.lora.batch import LoRABatch
from services.engine.lora.projections import PROJECTIONS
from services.engine.lora.runtime import LoRARuntime
from services.engine.lora.slots import LoRASlots
from services.engine.lora.torch_ops import add_lora, add_lora_grouped, write_lora
from services.engine.lora.weights import AdapterWeights, stack_layers
from tests.lora_adapters import random_weights, tiny_model_config

CONFIG = tiny_model_config()


def per_row_reference(
    x: torch.Tensor, row_slots: list[int], weights: dict[int, AdapterWeights], layer: int, proj: str
) -> torch.Tensor:
    """Row by row, slice by slice, straight from each adapter's own (unpadded) factors."""
    shape = SLOTS.shapes[proj]
    out = torch.zeros(x.shape[0], shape.out_features, dtype=torch.float64)
    for row, slot in enumerate(row_slots):
        if slot < 0 or proj not in weights[slot].layers[layer]:
            continue
        factors = weights[slot].layers[layer][proj]
        for index in range(shape.num_slices):
            low, high = shape.slice_offsets[index], shape.slice_offsets[index + 1]
            shrunk = factors.a[index].double() @ x[row].double()
            out[row, low:high] = factors.b[low:high].double() @ shrunk
    return out


SLOTS = LoRASlots(CONFIG, max_loras=3, max_rank=8, dtype=torch.float32, device="cpu")


def runtime_for(native: bool, row_slots: list[int]) -> LoRARuntime:
    """The CPU runtime over SLOTS with this step's rows; with the native kernels (checked to
    be used) or the torch ops."""
    runtime = LoRARuntime(SLOTS)
    if native:
        runtime.cpu_kernels = cpu_native.cpu_kernels()
        assert runtime.cpu_kernels is not None, "the native CPU kernels did not build"
    runtime.set_batch(LoRABatch.from_row_slots(row_slots))
    assert (runtime._native_rows is not None) == native
    return runtime


@pytest.mark.parametrize("path", ["loop", "grouped", "native", "write"])
@pytest.mark.parametrize("projection", PROJECTIONS)
def test_mixed_segments_match_the_per_row_loop(projection: str, path: str) -> None:
    weights = {
        0: random_weights(SLOTS, "r8-all", 8, PROJECTIONS, 1),
        1: random_weights(SLOTS, "r2-attn", 2, ("qkv_proj", "o_proj"), 2),
        2: random_weights(SLOTS, "r5-mlp", 5, ("gate_up_proj", "down_proj"), 3),
    }
    for slot, adapter in weights.items():
        SLOTS.write(slot, adapter)
    row_slots = [1, 1, -1, 0, 2, 2, 2, -1, 0, 1, -1, -1, 2]
    shape = SLOTS.shapes[projection]
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(len(row_slots), shape.in_features, generator=generator)
    base = torch.randn(len(row_slots), shape.out_features, generator=generator)
    batch = LoRABatch.from_row_slots(row_slots)
    rows, padded_index, group_size = batch.padded_groups()
    low = min(batch.slots)
    for layer in range(CONFIG.num_layers):
        y = base.clone()
        a, b = SLOTS.a[layer][projection], SLOTS.b[layer][projection]
        if path == "native":  # adapters 1 and 2 leave some projections alone: rank 0 there
            runtime = runtime_for(True, row_slots)
            runtime.apply(layer, projection, x, y)
        elif path == "grouped":
            add_lora_grouped(
                y,
                x,
                torch.tensor(rows),
                torch.tensor(padded_index),
                group_size,
                a[low:],
                b[low:],
                shape.slice_offsets,
            )
        elif path == "write":  # the adapter rows' deltas written over what y held
            write_lora(y, x, batch, a, b, shape.slice_offsets, SLOTS.ranks[projection])
        else:
            add_lora(y, x, batch, a, b, shape.slice_offsets, SLOTS.ranks[projection])
        expected = per_row_reference(x, row_slots, weights, layer, projection)
        if path == "write":
            adapter_rows = [row for row, slot in enumerate(row_slots) if slot >= 0]
            expected[adapter_rows] -= base.double()[adapter_rows]
        expected += base.double()
        torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-5)
        base_rows = [row for row, slot in enumerate(row_slots) if slot < 0]
        assert torch.equal(y[base_rows], base[base_rows])  # base rows untouched, bit for bit


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "stacked"])
def test_rewriting_a_slot_leaves_nothing_of_the_previous_adapter(stacked: bool) -> None:
    slots = LoRASlots(CONFIG, max_loras=1, max_rank=8, dtype=torch.float32, device="cpu")
    everything = random_weights(slots, "everything", 8, PROJECTIONS, 1)
    small = random_weights(slots, "small", 2, ("o_proj",), 2)
    if stacked:  # the engine's host cache on a GPU: one copy per projection and factor
        everything, small = (stack_layers(w, pin=False) for w in (everything, small))
        assert small.stacked is not None and set(small.stacked) == {"o_proj"}
        assert small.layers[1]["o_proj"].a.data_ptr() == small.stacked["o_proj"].a[1].data_ptr()
    slots.write(0, everything)
    assert slots.ranks["down_proj"] == [8]
    slots.write(0, small)
    assert slots.names == ["small"]
    assert slots.ranks["o_proj"] == [2] and slots.ranks["qkv_proj"] == [0]
    assert slots.rank_tensors["o_proj"].tolist() == [2]
    assert slots.rank_tensors["qkv_proj"].tolist() == [0]
    for layer in range(CONFIG.num_layers):
        assert slots.a[layer]["qkv_proj"].abs().sum() == 0
        assert slots.b[layer]["down_proj"].abs().sum() == 0
        assert slots.a[layer]["o_proj"][0, :, 2:].abs().sum() == 0  # rank padding
        assert torch.equal(slots.a[layer]["o_proj"][0, :, :2], small.layers[layer]["o_proj"].a)
        # The CPU's transposed copy of B follows every write and zeroing.
        assert slots.bt[layer]["down_proj"].abs().sum() == 0
        assert slots.bt[layer]["o_proj"][0, 2:].abs().sum() == 0
        assert torch.equal(slots.bt[layer]["o_proj"][0, :2], small.layers[layer]["o_proj"].b.t())
        assert torch.equal(slots.bt[layer]["o_proj"], slots.b[layer]["o_proj"].transpose(1, 2))
    with pytest.raises(ValueError, match="over the slot rank"):
        slots.write(0, random_weights(slots, "big", 9, ("o_proj",), 3))
    with pytest.raises(IndexError):
        slots.write(1, small)


@pytest.mark.parametrize(
    "row_slots",
    [
        [0, 1, 2, 0, 1, 2, -1, 2],  # decode of several adapters: one batched matmul
        [2] * 5 + [-1] * 3 + [1] * 6,  # prefill-like runs: the segment loop
    ],
)
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_the_runtime_gives_the_same_result_either_way(row_slots: list[int], native: bool) -> None:
    weights = {
        slot: random_weights(SLOTS, f"a{slot}", rank, PROJECTIONS, slot)
        for slot, rank in ((0, 3), (1, 8), (2, 5))
    }
    for slot, adapter in weights.items():
        SLOTS.write(slot, adapter)
    runtime = runtime_for(native, row_slots)
    generator = torch.Generator().manual_seed(11)
    for projection in PROJECTIONS:
        shape = SLOTS.shapes[projection]
        x = torch.randn(len(row_slots), shape.in_features, generator=generator)
        y = torch.zeros(len(row_slots), shape.out_features)
        runtime.apply(1, projection, x, y)
        expected = per_row_reference(x, row_slots, weights, 1, projection)
        torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("row_slots", [[0, 1, 2, 0, 1, 2, -1, 2], [2] * 5 + [-1] * 3 + [1] * 6])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_a_bfloat16_model_with_float32_slots_rounds_only_at_the_end(
    row_slots: list[int], native: bool
) -> None:
    weights = {
        slot: random_weights(SLOTS, f"a{slot}", rank, PROJECTIONS, slot)
        for slot, rank in ((0, 3), (1, 8), (2, 5))
    }
    for slot, adapter in weights.items():
        SLOTS.write(slot, adapter)
    runtime = runtime_for(native, row_slots)
    generator = torch.Generator().manual_seed(12)
    for projection in PROJECTIONS:
        shape = SLOTS.shapes[projection]
        x = torch.randn(len(row_slots), shape.in_features, generator=generator).bfloat16()
        base = torch.randn(len(row_slots), shape.out_features, generator=generator).bfloat16()
        y = base.clone()
        runtime.apply(0, projection, x, y)
        assert y.dtype == torch.bfloat16
        delta = per_row_reference(x.float(), row_slots, weights, 0, projection)
        expected = base.double() + delta
        # The delta is computed in float32; at most it and the sum are each rounded to bfloat16
        # once (half a unit in the last place each: at most 2^-8 of the value).
        bound = (expected.abs() + delta.abs()) * 2**-8 + 1e-6
        assert ((y.double() - expected).abs() <= bound).all()
        base_rows = [row for row, slot in enumerate(row_slots) if slot < 0]
        assert torch.equal(y[base_rows], base[base_rows])
