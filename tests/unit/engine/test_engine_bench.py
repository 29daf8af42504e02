"""loadtest.engine_bench: prompt mix, table rows, and the hand-over to the GPU benchmark."""

from __future__ import annotations

import loadtest.engine_bench as bench


def test_prompts_have_mixed_lengths_within_bounds():
    prompts = bench.make_prompts(8, 16, 192, vocab=49152, seed=0)
    lengths = sorted(len(prompt) for prompt in prompts)
    assert lengths[0] == 16 and lengths[-1] == 192 and len(set(lengths)) == 8
    assert all(100 <= token < 49151 for prompt in prompts for token in prompt)
    assert bench.make_prompts(8, 16, 192, 49152, 0) == prompts  # reproducible
    assert [len(p) for p in bench.make_prompts(1, 16, 192, 49152, 0)] == [16]


def test_row_ratio_and_table_line():
    row = bench.Row(8, "generate", 800, 256, sluice_s=2.0, transformers_s=6.0)
    assert row.sluice_tokens_per_s == 128.0 and row.transformers_tokens_per_s == 256 / 6
    assert row.ratio == 3.0
    assert "3.00" in bench.format_row(row)
    prefill = bench.Row(8, "prefill", 800, 8, sluice_s=1.0, transformers_s=2.0)
    assert prefill.sluice_tokens_per_s == 800.0


def test_cuda_is_handed_to_the_gpu_benchmark(monkeypatch):
    import loadtest.gpu_bench

    seen = {}
    monkeypatch.setattr(
        loadtest.gpu_bench, "main", lambda argv: seen.setdefault("argv", argv) and 7
    )
    assert bench.main(["--device", "cuda", "--batch-sizes", "1"]) == 7
    assert seen["argv"] == ["--device", "cuda", "--batch-sizes", "1"]


def test_unknown_device_is_an_error(capsys):
    assert bench.main(["--device", "tpu"]) == 2
    assert "--device" in capsys.readouterr().err
