"""The GPU stack benchmark's request sets, compute bound and headline ratios (no GPU)."""

from __future__ import annotations

import pytest

from benchmarks.gpu_stack import (
    Shape,
    compute_bound,
    fixed_specs,
    headline,
    send_timeline,
    sharegpt_like_specs,
    work_flops,
)
from loadtest.datasets import RequestSpec
from loadtest.records import RequestRecord
from services.common.protocol.dummy_shapes import dummy_config


def test_request_sets_are_fixed_by_their_seed():
    fixed = fixed_specs(20)
    assert all(s.input_tokens == 512 and s.output_tokens == 256 for s in fixed)
    assert all(len(s.prompt_token_ids) == 512 for s in fixed)
    assert fixed == fixed_specs(20)
    mix = sharegpt_like_specs(2000)
    inputs = [s.input_tokens for s in mix]
    outputs = [s.output_tokens for s in mix]
    assert 200 < sum(inputs) / len(inputs) < 320 and 160 < sum(outputs) / len(outputs) < 260
    assert min(inputs) >= 8 and max(inputs) <= 2048 and max(outputs) <= 1024
    assert all(len(s.prompt_token_ids) == s.input_tokens for s in mix)
    assert mix[:50] == sharegpt_like_specs(2000)[:50]


def test_flops_of_the_8b_shape_match_the_hand_count():
    shape = Shape.of(dummy_config("llama-3-8b"))
    # 32 layers x (4096 x 6144 QKV + 4096^2 O + 3 x 4096 x 14336 MLP) ~ 6.98e9 parameters.
    assert shape.layer_matmul_params == 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    spec = RequestSpec(0, 512, 256, None)
    flops = work_flops(shape, [spec])
    processed = 512 + 256 - 1
    expected = 2 * shape.layer_matmul_params * processed + 2 * 4096 * 128256 * 256
    assert flops["matmul_flops"] == pytest.approx(expected)
    assert flops["attention_flops"] == pytest.approx(4 * 32 * 128 * 32 * processed * 768 / 2)
    # 1,000 such requests: ~11 PFLOP of matmuls (the LM head only for generated tokens).
    bound = compute_bound(shape, [spec] * 1000, matmul_tflop_s=750.0)
    assert 10.5 < bound["matmul_flops"] < 11.5
    assert bound["bound_output_tok_s"] == pytest.approx(256_000 / bound["bound_s"], rel=1e-3)


def test_headline_ratios_come_from_the_phases():
    report = {
        "offline": {"fixed": {"output_tok_s": 10_000.0, "over_compute_bound": 0.8}},
        "stack": {"saturation_fixed": {"output_tok_s": 9_600.0}},
    }
    headline(report)
    assert report["offline_output_tok_s"] == 10_000.0
    assert report["offline_over_compute_bound"] == 0.8
    assert report["stack_over_offline_tok_s"] == 0.96
    assert "stack_over_offline_sharegpt" not in report


def test_step_time_percentiles_are_in_ms():
    from benchmarks.gpu_stack import percentiles_ms

    stats = percentiles_ms([0.010] * 9 + [0.110])
    assert stats["p50"] == 10.0 and stats["max"] == 110.0 and stats["mean"] == 20.0
    assert percentiles_ms([]) == {}


def test_the_timeline_groups_requests_by_the_second_they_were_sent():
    records = []
    for index, (sent, status, ttft) in enumerate(
        [
            (10.0, "OK", 0.1),
            (10.5, "RESOURCE_EXHAUSTED", None),
            (11.2, "OK", 0.3),
            (11.9, "OK", 0.9),
            (13.0, "RESOURCE_EXHAUSTED", None),
        ]
    ):
        record = RequestRecord(index=index, scheduled_s=sent, sent_s=sent, status=status)
        if ttft is not None:
            record.chunk_times_s.append(sent + ttft)
        records.append(record)
    records.append(RequestRecord(index=9, scheduled_s=12.0))  # never sent: left out
    rows = send_timeline(records)
    assert [row["from_s"] for row in rows] == [0.0, 1.0, 3.0]
    assert [(row["sent"], row["refused"]) for row in rows] == [(2, 1), (2, 0), (1, 1)]
    assert rows[1]["ttft_p50_s"] == pytest.approx(0.6) and rows[1]["ttft_max_s"] == 0.9
    assert rows[2]["ttft_p50_s"] is None
    assert send_timeline([]) == []
