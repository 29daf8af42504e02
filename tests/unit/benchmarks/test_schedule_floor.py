"""The engine's schedule priced at the ceilings (benchmarks/schedule_floor.py), on a CPU."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_stack import Shape, compute_bound, sharegpt_like_specs
from benchmarks.schedule_floor import main, schedule_floor
from loadtest.datasets import RequestSpec
from services.common.protocol.dummy_shapes import dummy_config

SHAPE = Shape.of(dummy_config("tiny"))
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=512, block_size=16)


def spec(index: int, prompt: int, output: int) -> RequestSpec:
    """A request whose prompt shares no block with another's (no prefix-cache hits)."""
    first = 10 + 500 * index  # within the host-only runner's vocabulary
    return RequestSpec(index, prompt, output, tuple(range(first, first + prompt)))


def test_a_lone_request_pays_the_weight_reads_every_step_and_its_kv_reads():
    # Matmuls free, 0.1 MB/s of copy: every step is weights + the KV it reads and writes.
    ceilings = {"matmul_tflop_s": 1e9, "copy_gb_s": 1e-4}
    prompt, output = 40, 6
    floor = schedule_floor(SHAPE, [spec(0, prompt, output)], engine=ENGINE, ceilings=ceilings)
    weight_bytes = 2 * (SHAPE.layer_matmul_params + SHAPE.hidden * SHAPE.vocab)
    kv_token_bytes = 2 * SHAPE.layers * SHAPE.kv_heads * SHAPE.head_dim * 2
    # The prefill writes 40 tokens; decode k reads the 40 + k - 1 before it and writes one.
    kv_tokens = prompt + sum(prompt + k for k in range(1, output))
    expected = (output * weight_bytes + kv_tokens * kv_token_bytes) / 1e5
    assert floor["steps"] == output and floor["weight_bound_steps"] == output
    assert floor["floor_s"] == pytest.approx(expected, rel=1e-3)
    # A float8 cache halves the KV part only.
    fp8 = schedule_floor(
        SHAPE, [spec(0, prompt, output)], engine=ENGINE, ceilings=ceilings, kv_element_bytes=1
    )
    halved = (output * weight_bytes + kv_tokens * kv_token_bytes / 2) / 1e5
    assert fp8["floor_s"] == pytest.approx(halved, rel=1e-3)


def test_a_long_prompt_is_chunked_by_the_step_token_budget():
    ceilings = {"matmul_tflop_s": 1.0, "copy_gb_s": 1000.0}
    floor = schedule_floor(SHAPE, [spec(0, 150, 5)], engine=ENGINE, ceilings=ceilings)
    assert floor["steps"] == 3 + 4  # 64 + 64 + 22 prompt tokens, then four decodes


def test_the_floor_never_beats_the_compute_bound_and_replays_the_batch_cap():
    specs = sharegpt_like_specs(40)
    specs = [spec(s.index, min(s.input_tokens, 200), min(s.output_tokens, 60)) for s in specs]
    ceilings = {"matmul_tflop_s": 1e-3, "copy_gb_s": 1.0}
    floor = schedule_floor(SHAPE, specs, engine=ENGINE, ceilings=ceilings)
    bound = compute_bound(SHAPE, specs, ceilings["matmul_tflop_s"])
    assert floor["floor_s"] >= bound["bound_s"] * 0.999
    # 40 requests 8 at a time: at least five rounds of the longest output in a round.
    assert floor["steps"] >= 5 * min(s.output_tokens for s in specs)
    assert floor["preemptions"] == 0


def test_the_command_reads_a_gpu_stack_report_and_writes_the_floors(tmp_path, capsys):
    report = {
        "device": "test device",
        "date": "2026-01-01T00:00:00+00:00",
        "command": "python -m benchmarks.gpu_stack",
        "model": "dummy:tiny",
        "kv_cache_dtype": "auto",
        "offline": {
            "ceilings": {"matmul_tflop_s": 1e-3, "copy_gb_s": 1.0},
            "engine": {**ENGINE, "max_num_batched_tokens": 1024, "execution_path": "x"},
            "fixed": {"requests": 3, "seconds": 50.0, "steps": 300},
        },
    }
    source = tmp_path / "gpu-stack-test.json"
    source.write_text(json.dumps(report))
    out = tmp_path / "floors.json"
    assert main([str(source), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["gpu-stack-test"]["sets"]["fixed"]
    assert row["measured_over_floor"] == pytest.approx(row["floor_s"] / 50.0, abs=1e-3)
    assert 0 < row["compute_bound_over_floor"] <= 1.0
    assert "sharegpt" not in json.loads(out.read_text())["gpu-stack-test"]["sets"]
    assert "gpu-stack-test fixed: measured 50.00 s" in capsys.readouterr().out
    (tmp_path / "other.json").write_text("{}")
    assert main([str(tmp_path / "other.json")]) == 2


def test_gpu_stack_adds_the_floors_after_its_offline_child_but_not_on_a_cpu_smoke_run():
    from benchmarks.gpu_stack import add_schedule_floors, headline

    offline = {
        "ceilings": {"matmul_tflop_s": 1e-3, "copy_gb_s": 1.0},
        "engine": {**ENGINE, "max_num_batched_tokens": 1024},
        "fixed": {"requests": 2, "seconds": 40.0, "steps": 260, "output_tok_s": 12.8},
    }
    add_schedule_floors(offline, "dummy:tiny", "auto")
    floor = offline["fixed"]["schedule_floor"]
    assert floor["steps"] == 256  # both 512-token prompts in the first step, then 255 decodes
    assert offline["fixed"]["over_schedule_floor"] == floor["measured_over_floor"]
    report = {"offline": offline}
    headline(report)
    assert report["offline_over_schedule_floor"] == offline["fixed"]["over_schedule_floor"]
    cut_short = {"ceilings": offline["ceilings"], "engine": offline["engine"]}  # no set timed
    add_schedule_floors(cut_short, "dummy:tiny", "auto")
    assert set(cut_short) == {"ceilings", "engine"}
    smoke = {"ceilings": {"matmul_tflop_s": 1.0}, "fixed": {"requests": 2, "seconds": 1.0}}
    add_schedule_floors(smoke, "dummy:tiny", "auto")
    assert "schedule_floor" not in smoke["fixed"]
