"""The LoRA shrink/expand Triton kernels against the per-segment torch path, and in a CUDA graph.

Mixed adapters of different ranks (rank-padded slots), base rows between them, fused q|k|v
(GQA widths) and gate|up slices, decode- and prefill-sized batches, split K; base rows must stay
bit-for-bit untouched. A captured graph replayed after `set_batch` with another adapter mix
must compute that mix (slot indices are graph inputs). y starts random, so a row the kernels
skip or write twice shows; the float32 reference uses the same (rounded) weights.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.lora.batch import LoRABatch
from services.engine.lora.projections import PROJECTIONS
from services.engine.lora.runtime import LoRARuntime
from services.engine.lora.slots import LoRASlots
from services.engine.lora.weights import stack_layers
from tests.lora_adapters import random_weights, tiny_model_config

DEVICE = "cuda"
MAX_ROWS = 512
SHAPES = {
    "tiny": {},  # hidden 64, 4 heads / 2 KV heads of 16, intermediate 96
    "wide": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
    },
}


def _filled_slots(config, max_loras: int, max_rank: int, dtype, device) -> list[LoRASlots]:
    """The same adapters in slots of `dtype` and (the reference) of float32."""
    pair = [
        LoRASlots(config, max_loras=max_loras, max_rank=max_rank, dtype=kind, device=device)
        for kind in (dtype, torch.float32)
    ]
    for slot in range(max_loras):
        rank = [max_rank, 1, max_rank // 2, 3][slot % 4]
        projections = PROJECTIONS if slot % 3 != 1 else ("qkv_proj", "down_proj")
        adapter = random_weights(pair[0], f"a{slot}", rank, projections, seed=slot, scaled=True)
        for slots in pair:
            slots.write(slot, adapter)
    return pair


def _row_slots(kind: str, rows: int, max_loras: int, generator) -> list[int]:
    if kind == "one-adapter":
        return [1] * rows
    if kind == "one-run":  # a prompt alone: one run of an adapter on every projection
        return [0] * rows
    if kind == "all-base":
        return [-1] * rows
    if kind == "distinct":  # decode: every row its own pick, base rows among them
        picks = torch.randint(-1, max_loras, (rows,), generator=generator)
        return picks.tolist()
    # prefill-like runs of varying length
    out: list[int] = []
    while len(out) < rows:
        length = int(torch.randint(1, 40, (1,), generator=generator))
        out.extend([int(torch.randint(-1, max_loras, (1,), generator=generator))] * length)
    return out[:rows]


def _runtimes(device: str, shape: str, dtype: torch.dtype, max_rank: int, rows: int,
              graph_pad: int = 0) -> tuple:  # fmt: skip
    """(config, slots, the kernels' runtime, the float32 torch reference) over 8 filled slots;
    graph_pad: steps of `rows` rows are narrower than a CUDA graph bucket that much wider."""
    config = tiny_model_config(**SHAPES[shape])
    slots, reference_slots = _filled_slots(config, 8, max_rank, dtype, device)
    runtime = LoRARuntime(slots, kernels="triton", max_rows=MAX_ROWS)
    if graph_pad:
        runtime.graph_rows = rows + graph_pad
        runtime.graph_buckets = (rows + graph_pad,)
    return config, slots, runtime, LoRARuntime(reference_slots, kernels="torch")


def check_against_torch(
    device: str,
    shape: str,
    dtype: torch.dtype,
    kind: str,
    rows: int,
    max_rank: int,
    long_segment_rows: int | None = None,
    write_tile_deltas: bool = True,
    graph_pad: int = 0,
) -> None:
    """The kernels' deltas against the torch path; with long_segment_rows, runs at least that
    long take the runtime's cuBLAS path beside the kernels (checked to happen);
    write_tile_deltas as LoRARuntime's (eager steps of a plain base); graph_pad: the step is
    narrower than a CUDA graph bucket `graph_pad` rows wider, so the kernels' tiles cover rows
    past the step's own, which an eager step must leave alone."""
    max_loras = 8
    config, slots, runtime, reference = _runtimes(device, shape, dtype, max_rank, rows, graph_pad)
    if long_segment_rows is not None:
        runtime.long_segment_rows = long_segment_rows
    runtime.write_tile_deltas = write_tile_deltas
    generator = torch.Generator().manual_seed(rows)
    row_slots = _row_slots(kind, rows, max_loras, generator)
    batch = LoRABatch.from_row_slots(row_slots)
    runtime.set_batch(batch)
    reference.set_batch(batch)
    if long_segment_rows is not None:  # both paths in one step
        long_rows = sum(n for n in batch.lengths if n >= long_segment_rows)
        assert 0 < long_rows < sum(batch.lengths), "the case needs long and short runs"
        assert runtime._num_tiles < batch.kernel_tiles().num_tiles
    base_rows = [row for row, slot in enumerate(row_slots) if slot < 0]
    tolerance = 2e-4 if dtype == torch.float32 else 3e-2
    for layer in range(config.num_layers):
        for projection in PROJECTIONS:
            spec = slots.shapes[projection]
            x = torch.randn(rows, spec.in_features, generator=generator).to(dtype).to(device)
            y = torch.randn(rows, spec.out_features, generator=generator).to(dtype).to(device)
            expected = y.to(torch.float32, copy=True)
            reference.apply(layer, projection, x.float(), expected)
            ours = y.clone()
            runtime.apply(layer, projection, x, ours)
            torch.testing.assert_close(ours.float(), expected, atol=tolerance, rtol=tolerance)
            assert torch.equal(ours[base_rows], y[base_rows]), projection
            # The same through project (eager: as apply; its side stream is for graph capture).
            projected = runtime.project(layer, projection, x, lambda _, y=y: y.clone())
            torch.testing.assert_close(projected.float(), expected, atol=tolerance, rtol=tolerance)
            assert torch.equal(projected[base_rows], y[base_rows]), projection
            # A plain x Wᵀ base (an eager step's projection): every adapter row's delta is
            # written first (long runs by cuBLAS, the rest by the expand in write mode), the
            # base rows zeroed, and the base matmul adds onto them; its forward runs only in a
            # step without adapter rows.
            weight = torch.randn(spec.out_features, spec.in_features, generator=generator) / 8
            base = PlainBase(weight.to(dtype).to(device))
            projected = runtime.project(layer, projection, x, base)
            assert base.calls == (0 if len(base_rows) < rows else 1), projection
            expected = (x.float() @ base.weight.float().t()).to(dtype).float()
            plain = expected.clone()
            reference.apply(layer, projection, x.float(), expected)
            # Each of the base product and the delta is rounded once to the output's dtype
            # (as a LoRA layer in that dtype adds them), so the bound scales with both.
            bound = tolerance * (1 + plain.abs() + (expected - plain).abs())
            error = (projected.float() - expected).abs()
            assert bool((error <= bound).all()), (projection, float((error - bound).max()))
            torch.testing.assert_close(
                projected[base_rows].float(), plain[base_rows], atol=tolerance, rtol=tolerance
            )


def check_splits_in_order(device: str, dtype: torch.dtype, repeats: int) -> None:
    """The shrink's K splits are summed in split order: the same step repeated gives the same
    bits, decode-sized (many splits) and prefill-sized alike, and the tile counters end at zero
    (the workspace, not float atomics, took the sums)."""
    config = tiny_model_config(**SHAPES["wide"])
    slots, _ = _filled_slots(config, 8, 16, dtype, device)
    runtime = LoRARuntime(slots, kernels="triton", max_rows=MAX_ROWS)
    runtime._partials.fill_(float("nan"))
    generator = torch.Generator().manual_seed(3)
    for kind, rows in (("distinct", 64), ("runs", 300)):
        runtime.set_batch(LoRABatch.from_row_slots(_row_slots(kind, rows, 8, generator)))
        for projection in PROJECTIONS:
            spec = slots.shapes[projection]
            x = torch.randn(rows, spec.in_features, generator=generator).to(dtype).to(device)
            y = torch.randn(rows, spec.out_features, generator=generator).to(dtype).to(device)
            first = y.clone()
            runtime.apply(0, projection, x, first)
            for _ in range(repeats):
                again = y.clone()
                runtime.apply(0, projection, x, again)
                assert torch.equal(again, first), (kind, projection)
    assert not bool(runtime._counters.any())
    assert not bool(runtime._partials.isnan().all()), "no partial went through the workspace"


class PlainBase(torch.nn.Module):
    """A base projection that says it is a plain x Wᵀ and counts the calls of its forward."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.calls = 0

    def plain_weight(self, rows: int) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x @ self.weight.t()


def check_swiglu_tiles(
    device: str,
    shape: str,
    dtype: torch.dtype,
    kind: str,
    rows: int,
    max_rank: int,
    graph_pad: int = 0,
    long_segment_rows: int | None = None,
) -> None:
    """gate_up through project with the fast path's SwiGLU as the runtime's tile consumer: a
    plain base matmul and the shrink, then SwiGLU adding each tile's deltas to gate and up as
    it reads them; against the torch path's deltas on the base product, then silu(gate) * up.
    graph_pad: a step narrower than its graph bucket (tiles cover rows past its own);
    long_segment_rows: runs at least that long get their u from cuBLAS and SwiGLU walks every
    row's tiles (checked to happen). A delta no kernel took fails the next projection."""
    from services.engine.backends.cuda_fast_path import TritonOps

    config, slots, runtime, reference = _runtimes(device, shape, dtype, max_rank, rows, graph_pad)
    ops = TritonOps()
    ops.epilogues, ops.bound, runtime.tile_consumer = runtime, True, ops
    if long_segment_rows is not None:
        runtime.long_segment_rows = long_segment_rows
    generator = torch.Generator().manual_seed(rows)
    batch = LoRABatch.from_row_slots(_row_slots(kind, rows, 8, generator))
    runtime.set_batch(batch)
    reference.set_batch(batch)
    if long_segment_rows is not None:  # long runs, and every row's tiles for SwiGLU
        assert not runtime._long.is_empty, "the case needs a long run"
        assert (
            runtime._num_all_tiles
            == batch.kernel_tiles(batch.rows_outside(rows), slots.zero_slot).num_tiles
        )
        if kind == "one-run":  # no kernel tile at all: every u from cuBLAS
            assert runtime._num_tiles == 0
    spec = slots.shapes["gate_up_proj"]
    half = spec.out_features // 2
    tolerance = 2e-4 if dtype == torch.float32 else 3e-2

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * scale).to(dtype).to(device)

    for layer in range(config.num_layers):
        x = rand(rows, spec.in_features)
        base = PlainBase(rand(spec.out_features, spec.in_features, scale=1 / 8))
        y = runtime.project(layer, "gate_up_proj", x, base)
        assert (runtime._pending is not None) == (not batch.is_empty), kind
        out = ops.silu_mul(y)
        assert runtime._pending is None
        plain = (x.float() @ base.weight.float().t()).to(dtype).float()
        expected = plain.clone()
        reference.apply(layer, "gate_up_proj", x.float(), expected)
        gate, up = expected[:, :half], expected[:, half:]
        silu = gate * torch.sigmoid(gate)
        want = silu * up
        # gate and up each within tolerance of their base product and delta (check_against_
        # torch); through silu(gate) * up (silu's slope at most 1.1), then rounded once more
        scale = 1 + plain.abs() + (expected - plain).abs()
        bound = tolerance * (
            1 + want.abs() + 1.1 * up.abs() * scale[:, :half] + silu.abs() * scale[:, half:]
        )
        error = (out.float() - want).abs()
        assert bool((error <= bound).all()), (kind, float((error - bound).max()))
    if not batch.is_empty:
        runtime.project(0, "gate_up_proj", x, base)  # left for SwiGLU, which never runs
        down = slots.shapes["down_proj"]
        with pytest.raises(RuntimeError, match="never took"):
            runtime.project(
                0, "down_proj", rand(rows, down.in_features),
                PlainBase(rand(down.out_features, down.in_features)),
            )  # fmt: skip


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kind", "rows"), [("distinct", 64), ("one-adapter", 40), ("runs", 300), ("all-base", 8)]
)
@pytest.mark.parametrize("max_rank", [16, 64])
def test_swiglu_adds_a_steps_tile_deltas_as_it_reads_gate_up(
    shape, dtype, kind, rows, max_rank
) -> None:
    check_swiglu_tiles(DEVICE, shape, dtype, kind, rows, max_rank)


def test_swiglu_tiles_leave_rows_past_a_narrower_step_alone() -> None:
    check_swiglu_tiles(DEVICE, "wide", torch.bfloat16, "distinct", 45, 16, graph_pad=19)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kind", "rows", "long_segment_rows"), [("runs", 300, 24), ("runs", 300, 1), ("one-run", 96, 1)]
)
def test_swiglu_adds_the_deltas_of_long_runs_through_cublas(
    dtype, kind, rows, long_segment_rows
) -> None:
    """Runs of at least long_segment_rows rows take their u from cuBLAS (1: every adapter run,
    no kernel tile but the base rows'; one-run: no kernel tile at all), and SwiGLU adds every
    row's delta."""
    check_swiglu_tiles(DEVICE, "wide", dtype, kind, rows, 16, long_segment_rows=long_segment_rows)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kind", "rows"),
    [("distinct", 64), ("one-adapter", 64), ("runs", 300), ("all-base", 8), ("distinct", 3)],
)
@pytest.mark.parametrize("max_rank", [16, 64])
def test_kernels_match_the_torch_path(shape, dtype, kind, rows, max_rank) -> None:
    check_against_torch(DEVICE, shape, dtype, kind, rows, max_rank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_narrower_than_its_graph_bucket_matches_the_torch_path(dtype) -> None:
    check_against_torch(DEVICE, "wide", dtype, "distinct", 45, 16, graph_pad=19)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("write_tile_deltas", [True, False])
def test_long_runs_through_cublas_beside_the_kernels_match_the_torch_path(
    dtype, write_tile_deltas
) -> None:
    check_against_torch(
        DEVICE, "wide", dtype, "runs", 300, 16, long_segment_rows=24,
        write_tile_deltas=write_tile_deltas,
    )  # fmt: skip


def test_the_shrink_sums_its_splits_in_order() -> None:
    check_splits_in_order(DEVICE, torch.bfloat16, repeats=20)


def check_graph_replay(device: str, entry: str = "apply") -> None:
    """A graph captured once computes each adapter mix set afterwards; `entry` "project":
    captured through LoRARuntime.project (on a GPU the shrink on a side stream, joined);
    "project-plain": through project over a plain x Wᵀ base, wider than the side stream's
    limit (the deltas written first, the base matmul adding onto them), replayed for batches
    narrower than the graph too (their padding rows get the base product alone)."""
    config = tiny_model_config(**SHAPES["wide"])
    slots, reference_slots = _filled_slots(config, 4, 16, torch.bfloat16, device)
    runtime = LoRARuntime(slots, kernels="triton", max_rows=MAX_ROWS)
    reference = LoRARuntime(reference_slots, kernels="torch")
    rows = 32
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, config.hidden_size, generator=generator).to(torch.bfloat16).to(device)
    out_features = slots.shapes["qkv_proj"].out_features
    y0 = torch.randn(rows, out_features, generator=generator).to(torch.bfloat16).to(device)
    y = y0.clone()
    runtime.launch_always = True
    runtime.set_batch(LoRABatch.from_row_slots([-1] * rows))  # captured with no adapter rows
    runtime.apply(0, "qkv_proj", x, y.clone())  # compile the kernels before capture
    base = PlainBase(torch.randn(out_features, config.hidden_size, generator=generator) / 8)
    base.weight = base.weight.to(torch.bfloat16).to(device)
    if entry == "project-plain":
        runtime.side_shrink_max_rows = rows // 4
        runtime.graph_rows, runtime.graph_buckets = rows, (rows // 2, rows)
        y0 = (x @ base.weight.t()).to(torch.bfloat16)
        runtime.project(0, "qkv_proj", x, base)  # compile the write mode too
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if entry == "project":
            y = runtime.project(0, "qkv_proj", x, lambda _: y0.clone())
        elif entry == "project-plain":
            y = runtime.project(0, "qkv_proj", x, base)
        else:
            runtime.apply(0, "qkv_proj", x, y)
    assert base.calls == 0
    mixes = [[0] * rows, [(row % 5) - 1 for row in range(rows)], [3, -1] * (rows // 2)]
    if entry == "project-plain":  # a batch of fewer rows than the graph's: padding after it
        mixes.append([2, -1, 0] * ((rows - 3) // 3))
    for mix in mixes:
        batch = LoRABatch.from_row_slots(mix)
        runtime.set_batch(batch)
        y.copy_(y0)
        graph.replay()
        expected = y0.to(torch.float32, copy=True)
        reference.set_batch(batch)
        reference.apply(0, "qkv_proj", x.float(), expected)
        # the base product and the delta each rounded once to bfloat16 (check_against_torch)
        bound = 3e-2 * (1 + y0.float().abs() + (expected - y0.float()).abs())
        error = (y.float() - expected).abs()
        assert bool((error <= bound).all()), (mix, float((error - bound).max()))


@pytest.mark.parametrize("entry", ["apply", "project", "project-plain"])
def test_a_captured_graph_serves_any_adapter_mix(entry) -> None:
    check_graph_replay(DEVICE, entry)


def test_an_asynchronous_slot_write_lands_what_an_ordered_one_writes() -> None:
    """A swap on the side stream, issued while the step stream is busy, must fill the slot as
    the in-order write does (zeros past its rank over a larger adapter included), and must not
    start before the work already issued on the step stream (which may still read the slot)."""
    config = tiny_model_config(**SHAPES["wide"])
    ordered, side = (
        LoRASlots(config, max_loras=2, max_rank=16, dtype=torch.bfloat16, device=DEVICE)
        for _ in range(2)
    )
    big = random_weights(ordered, "big", 16, PROJECTIONS, seed=1, scaled=True)
    small = random_weights(ordered, "small", 4, ("qkv_proj", "o_proj"), seed=2, scaled=True)
    ordered.write(1, big)
    side.write(1, stack_layers(big, pin=True), asynchronous=True).wait()
    ordered.write(1, small)
    torch.cuda.synchronize()
    # Keep the step stream busy, then read slot 1 on it: the side copy must wait for the read.
    before = side.a_stacks["qkv_proj"][:, 1].clone()
    torch.cuda._sleep(50_000_000)
    seen = side.a_stacks["qkv_proj"][:, 1].clone()
    write = side.write(1, stack_layers(small, pin=True), asynchronous=True)  # as the engine
    assert write is not None
    write.wait()
    assert write.done()
    torch.cuda.synchronize()
    torch.testing.assert_close(seen, before, rtol=0, atol=0)
    for name in PROJECTIONS:
        torch.testing.assert_close(side.a_stacks[name], ordered.a_stacks[name], rtol=0, atol=0)
        torch.testing.assert_close(side.b_stacks[name], ordered.b_stacks[name], rtol=0, atol=0)
        assert side.ranks[name] == ordered.ranks[name]
        assert side.rank_tensors[name].tolist() == ordered.rank_tensors[name].tolist()


def test_a_slot_write_waits_for_the_last_step_reading_that_slot_only() -> None:
    """A write into a slot that the step in flight does not read starts at once (during that
    step); one into a slot it reads waits for it to end (services/engine/lora/read_fences.py).
    Issuing either returns at once: nothing in it waits for the device."""
    config = tiny_model_config(**SHAPES["wide"])
    slots = LoRASlots(config, max_loras=2, max_rank=16, dtype=torch.bfloat16, device=DEVICE)
    runtime = LoRARuntime(slots, kernels="triton", max_rows=MAX_ROWS)
    weights = random_weights(slots, "a", 16, PROJECTIONS, seed=1, scaled=True)
    adapter = stack_layers(weights, pin=True)
    runtime.set_batch(LoRABatch.from_row_slots([1] * 4))  # a step reading slot 1
    runtime.set_batch(LoRABatch.from_row_slots([0] * 4))  # the next reads slot 0 only...
    torch.cuda._sleep(1_000_000_000)  # ...and runs long (about half a second)
    torch.cuda.set_sync_debug_mode("error")  # issuing a write never waits for the device
    try:
        early = slots.write(1, adapter, asynchronous=True, after=runtime.read_fence(1))
        late = slots.write(0, adapter, asynchronous=True, after=runtime.read_fence(0))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert early is not None and late is not None
    early.wait()
    assert not late.done()  # still behind the step in flight
    late.wait()
    torch.cuda.synchronize()
    for name in PROJECTIONS:
        torch.testing.assert_close(
            slots.a_stacks[name][:, 0], slots.a_stacks[name][:, 1], rtol=0, atol=0
        )
        torch.testing.assert_close(
            slots.b_stacks[name][:, 0], slots.b_stacks[name][:, 1], rtol=0, atol=0
        )


def test_direct_launches_compute_what_the_jit_path_computes(monkeypatch) -> None:
    """After its first launch per specialization a kernel skips Triton's dispatch
    (kernels/triton/launch.py): every later launch must give the JIT path's bits."""
    from services.engine.kernels.triton import launch, lora_expand, lora_shrink

    config = tiny_model_config(**SHAPES["wide"])
    slots, _ = _filled_slots(config, 8, 16, torch.bfloat16, DEVICE)
    generator = torch.Generator().manual_seed(5)
    results = {}
    for direct in (False, True):
        monkeypatch.setattr(launch, "DIRECT_LAUNCH", direct)
        before = (
            lora_shrink._launch_shrink.direct_launches + lora_expand._launch_expand.direct_launches
        )
        for rows, kind in ((64, "distinct"), (300, "runs"), (64, "distinct")):
            generator.manual_seed(rows)
            runtime = LoRARuntime(slots, kernels="triton", max_rows=MAX_ROWS)
            runtime.set_batch(LoRABatch.from_row_slots(_row_slots(kind, rows, 8, generator)))
            for projection in PROJECTIONS:
                spec = slots.shapes[projection]
                x = torch.randn(rows, spec.in_features, generator=generator).to(torch.bfloat16)
                y = torch.randn(rows, spec.out_features, generator=generator).to(torch.bfloat16)
                y = y.to(DEVICE)
                for _ in range(2):  # the second launch of each specialization is direct
                    out = y.clone()
                    runtime.apply(0, projection, x.to(DEVICE), out)
                    results.setdefault((rows, kind, projection), []).append(out)
        after = (
            lora_shrink._launch_shrink.direct_launches + lora_expand._launch_expand.direct_launches
        )
        assert (after > before) == direct
    torch.cuda.synchronize()
    for key, outs in results.items():
        for out in outs[1:]:
            assert torch.equal(out, outs[0]), key
