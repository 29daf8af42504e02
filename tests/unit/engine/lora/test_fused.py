"""FusedDecode on a CPU (float32): widened weights, the active adapter's factors, the pending delta.

The kernels that add the delta run in tests/gpu/test_lora_epilogue.py (and in Triton's
interpreter); here the epilogue a projection leaves is applied with plain torch and must give
the per-segment torch path's output (services/engine/lora/torch_ops.add_lora): rows of the
adapter get their delta, base rows none. The factors are copied in again exactly when the step's
adapter or its slot's contents change.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as functional
from torch import nn

from services.engine.lora.batch import LoRABatch
from services.engine.lora.projections import PROJECTIONS
from services.engine.lora.slots import LoRASlots
from services.engine.lora.torch_ops import add_lora
from tests.lora_adapters import random_weights, tiny_model_config

pytest.importorskip("triton", reason="the epilogue's module imports Triton")

from services.engine.loader.weights import build_model  # noqa: E402
from services.engine.lora.fused import FusedDecode, captured, fusable, widen_for_fold  # noqa: E402
from services.engine.lora.wrap import projection_modules  # noqa: E402

MAX_RANK = 8


class _Projection(nn.Module):
    """A plain projection that runs any weight it is handed (as the fast path's TunedLinear)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None

    def forward_with(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, weight)


def _setup():
    config = tiny_model_config()
    slots = LoRASlots(config, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(7)
    bases = {
        (layer, name): _Projection(
            torch.randn(shape.out_features, shape.in_features, generator=generator)
        )
        for layer in range(slots.num_layers)
        for name, shape in slots.shapes.items()
    }
    fused = FusedDecode(slots, max_rows=16)
    originals = {key: base.weight.detach().clone() for key, base in bases.items()}
    fused.bind((layer, name, base) for (layer, name), base in bases.items())
    return slots, fused, bases, originals


def _applied(epilogue, y: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
    """y plus the delta `epilogue` describes, in plain torch."""
    out = y.clone()
    rank = int(epilogue.rank)
    for row in range(y.shape[0]):
        if not int(epilogue.rows_on[row]) or not rank:
            continue
        for index, (low, high) in enumerate(slices):
            start = index * epilogue.slice_width
            u = epilogue.u[row, start : start + rank]
            out[row, low:high] += u @ epilogue.bt[:rank, low:high]
    return out


def test_a_projection_leaves_the_adapters_delta_for_the_next_kernel() -> None:
    slots, fused, bases, originals = _setup()
    for key, base in bases.items():  # the model's weight: the same values, a view of the wider one
        assert torch.equal(base.weight, originals[key])
        assert fusable(base, *originals[key].shape, torch.float32)
    assert fused.nbytes > 0
    slots.write(0, random_weights(slots, "all", 5, PROJECTIONS, seed=1))
    slots.write(1, random_weights(slots, "qkv-down", 8, ("qkv_proj", "down_proj"), seed=2))
    generator = torch.Generator().manual_seed(3)
    for row_slots in ([0, -1, 0, 0, -1], [-1, 1, 1, -1, -1, 1, 1]):
        batch = LoRABatch.from_row_slots(row_slots)
        assert fused.supports(batch)
        fused.prepare(batch, rows=8)
        assert fused.rows_on[:8].tolist() == [int(s >= 0) for s in row_slots] + [0] * (
            8 - len(row_slots)
        )
        rows = len(row_slots)
        for (layer, name), base in bases.items():
            shape = slots.shapes[name]
            x = torch.randn(rows, shape.in_features, generator=generator)
            y = fused.project(layer, name, x, base)
            assert torch.allclose(y, x @ originals[layer, name].t(), atol=1e-5)
            with pytest.raises(RuntimeError, match="unapplied"):
                fused.project(layer, name, x, base)  # the last delta still awaits its kernel
            assert fused.take(x) is None  # not the projection output
            epilogue = fused.take(y[:, : shape.slice_sizes[0]])  # a column view of it (q)
            assert epilogue is not None and fused.take(y) is None  # taken once
            offsets = shape.slice_offsets
            slices = list(zip(offsets[:-1], offsets[1:], strict=True))
            want = y.clone()
            add_lora(
                want, x, batch, slots.a[layer][name], slots.b[layer][name],
                offsets, slots.ranks[name],
            )  # fmt: skip
            torch.testing.assert_close(_applied(epilogue, y, slices), want, rtol=1e-4, atol=1e-4)


def test_factors_are_copied_in_when_the_adapter_or_its_slot_changes() -> None:
    slots, fused, _, _ = _setup()
    slots.write(0, random_weights(slots, "a", 4, PROJECTIONS, seed=1))
    slots.write(1, random_weights(slots, "b", 6, PROJECTIONS, seed=2))
    fused.activate(0)
    fused.activate(0)
    assert fused.activations == 1
    fused.activate(1)
    assert fused.activations == 2
    slots.write(1, random_weights(slots, "c", 3, ("o_proj",), seed=3))  # new contents, same slot
    fused.activate(1)
    assert fused.activations == 3
    name = "o_proj"
    shape = slots.shapes[name]
    wide = fused._weights[0, name]
    assert torch.equal(wide[shape.out_features :], slots.a_stacks[name][0, 1].reshape(MAX_RANK, -1))
    assert torch.equal(fused._bt[name][0], slots.b_stacks[name][0, 1].t())
    assert int(fused._ranks[name]) == 3 and int(fused._ranks["qkv_proj"]) == 0


def test_a_capture_fails_when_a_delta_is_left_unapplied() -> None:
    slots, fused, bases, _ = _setup()
    base = bases[0, "o_proj"]
    x = torch.zeros(2, slots.shapes["o_proj"].in_features)

    def leaves_one() -> None:
        assert fused.capturing
        fused.project(0, "o_proj", x, base)

    with pytest.raises(RuntimeError, match="end of a step"):
        captured(fused, leaves_one)
    assert not fused.capturing and fused.pending is None

    def takes_it() -> None:
        assert fused.take(fused.project(0, "o_proj", x, base)) is not None

    captured(fused, takes_it)


def test_weights_widened_at_load_are_taken_as_they_are() -> None:
    """widen_for_fold gives every projection weight room below it right after load: same
    values, a view of a zero-tailed buffer, the model's output unchanged; FusedDecode.bind then
    takes those buffers without copying a weight (a copy would leave the old one held by the
    graphs captured before)."""
    config = tiny_model_config()
    model = build_model(config, weights_dir=None, device="cpu", dtype=torch.float32, seed=3)
    before = {
        (layer, name): getattr(parent, child).weight.detach().clone()
        for layer, name, parent, child in projection_modules(model)
    }
    originals = [
        weakref.ref(getattr(parent, child).weight)
        for *_, parent, child in projection_modules(model)
    ]
    wide = widen_for_fold(model, config, MAX_RANK)
    assert set(wide) == set(before)
    gc.collect()
    assert all(ref() is None for ref in originals)  # freed at once: no weight held twice
    assert all(buffer.grad_fn is None for buffer in wide.values())
    slots = LoRASlots(config, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32, device="cpu")
    bases = []
    for layer, name, parent, child in projection_modules(model):
        module, shape = getattr(parent, child), slots.shapes[name]
        buffer = wide[layer, name]
        assert buffer.shape == (shape.out_features + shape.num_slices * MAX_RANK, shape.in_features)
        assert module.weight.data_ptr() == buffer.data_ptr()
        assert torch.equal(module.weight, before[layer, name])
        assert not buffer[shape.out_features :].any()
        module.forward_with = lambda x, weight: functional.linear(x, weight)
        bases.append((layer, name, module))
    fused = FusedDecode(slots, max_rows=16)
    fused.bind(bases, wide)
    for layer, name, module in bases:
        assert fused._weights[layer, name] is wide[layer, name]  # taken, not copied
        assert module.weight.data_ptr() == wide[layer, name].data_ptr()
    fresh = build_model(config, weights_dir=None, device="cpu", dtype=torch.float32, seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for (_, name, parent, child), (*_, fresh_parent, _) in zip(
            projection_modules(model), projection_modules(fresh), strict=True
        ):
            x = torch.randn(3, slots.shapes[name].in_features, generator=generator)
            assert torch.equal(getattr(parent, child)(x), getattr(fresh_parent, child)(x))


def test_bind_copies_a_weight_without_room_below_it_and_keeps_the_original() -> None:
    """Without buffers from the load, bind copies each weight wider and keeps the original:
    graphs captured before bind read it."""
    _slots, fused, bases, originals = _setup()
    assert len(fused._held) == len(bases)
    for key, base in bases.items():
        buffer = fused._weights[key]
        assert buffer.data_ptr() == base.weight.data_ptr()
        assert buffer.shape[0] > originals[key].shape[0]
        assert any(torch.equal(held, originals[key]) for held in fused._held)


def test_no_weight_is_widened_when_a_projection_is_not_plain() -> None:
    """The fold needs every projection: with a bias on one (x Wᵀ + b), none gets the room."""
    config = tiny_model_config()
    model = build_model(config, weights_dir=None, device="cpu", dtype=torch.float32, seed=3)
    *_, parent, child = next(iter(projection_modules(model)))
    module = getattr(parent, child)
    module.bias = nn.Parameter(torch.zeros(module.weight.shape[0]), requires_grad=False)
    weights = {id(getattr(p, c).weight) for *_, p, c in projection_modules(model)}
    assert widen_for_fold(model, config, MAX_RANK) == {}
    assert {id(getattr(p, c).weight) for *_, p, c in projection_modules(model)} == weights
